"""rank_lightning.analysis"""
