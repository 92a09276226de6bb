"""rank_lightning.callbacks"""

from rank_lightning.callbacks.curves import LayerCurves as LayerCurves
from rank_lightning.callbacks.low_rank import LowDimensionalEvaluation as LowDimensionalEvaluation
from rank_lightning.callbacks.low_rank import LowRankProjection as LowRankProjection
from rank_lightning.callbacks.rank_pretraining import RankPretraining as RankPretraining
from rank_lightning.callbacks.weight_rank import WeightRankMonitor as WeightRankMonitor
from rank_lightning.callbacks.activation_rank import ActivationRankMonitor as ActivationRankMonitor
