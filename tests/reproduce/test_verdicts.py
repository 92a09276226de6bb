"""The verdicts of the reproductions on made-up results (no training), and the marks of a quick run's summary."""

from __future__ import annotations

import csv

import pytest
import torch

from rank_lightning.reproduce import daneshmand, zangrando
from rank_lightning.reproduce.cli import main
from rank_lightning.reproduce.core import Claim, Context, ExperimentResult, write_summary

_EPOCHS = 2
_DIAGNOSTICS = ("rms_H_L_before", "relative_spread_H_L_before", "grad_norm_r_H_L_before", "r_H_L_before")


def _fig6_claim(accuracy: dict[str, float]) -> Claim:
    """The first claim of Fig. 6 (the ordering of training accuracies) for the final accuracies ``accuracy``."""
    names = [variant[0] for variant in daneshmand._VARIANTS]
    summary = [
        {"variant": name, "epoch": _EPOCHS - 1, "train_accuracy_mean": accuracy.get(name, 0.1), "r_H_L_mean": 1.0}
        for name in names
    ]
    diagnostics = [dict.fromkeys(_DIAGNOSTICS, 1.0) | {"variant": name, "r_H_L_after": 1.0} for name in names]
    return daneshmand._fig6_claims(summary, diagnostics, _EPOCHS, 8, "digits")[0]


def test_fig6_is_not_reproduced_when_bn_does_not_beat_vanilla():
    # Pre-trained beats BN, but BN sits at chance level with vanilla: half of "pre-trained > BN > vanilla" fails.
    claim = _fig6_claim({"vanilla": 0.11, "BN": 0.11, "layer-wise, 75 it. + rescaling": 0.21})
    assert claim.verdict == "partly"
    assert "BN (0.11) does not beat vanilla (0.11)" in claim.reason


def test_fig6_is_not_reproduced_when_pretraining_does_not_beat_bn():
    claim = _fig6_claim({"vanilla": 0.10, "BN": 0.89, "layer-wise, 75 it. + rescaling": 0.43})
    assert claim.verdict == "partly"  # pre-training trains (0.43 against 0.10) but stays below BN
    assert "pre-trained (0.43) does not beat BN (0.89)" in claim.reason
    assert "BN (0.89) does not beat vanilla" not in claim.reason


def test_fig6_is_reproduced_only_when_both_orderings_hold():
    claim = _fig6_claim({"vanilla": 0.10, "BN": 0.80, "Alg. 1 (last layer), 75 it.": 0.95})
    assert claim.verdict == "reproduced"
    assert claim.reason.startswith("both orderings hold")


@pytest.mark.parametrize(
    ("pretrained", "bn", "vanilla", "expected"),
    [
        (0.95, 0.80, 0.10, "reproduced"),
        (0.21, 0.11, 0.11, "partly"),
        (0.43, 0.89, 0.10, "partly"),
        (0.10, 0.89, 0.10, "not"),  # BN beating vanilla alone is the baseline, not what pre-training adds
        (0.81, 0.80, 0.10, "partly"),  # within the margin: pre-trained does not beat BN
    ],
)
def test_fig6_order_verdict(pretrained, bn, vanilla, expected):
    assert daneshmand._fig6_order_verdict(pretrained, bn, vanilla)[0] == expected


def test_fig4_5_needs_two_weight_decays_to_say_the_rank_falls():
    verdict, reason = zangrando._fig4_5_verdict({3e-2: 83.0}, (6.0, 6.5), (6.0, 7.0))
    assert verdict == "partly"
    assert "only one weight decay (0.03)" in reason


def test_fig4_5_checks_width_as_well_as_depth():
    # The rank doubles with the width (31 -> 61) while it is flat in depth and falls with weight decay.
    verdict, reason = zangrando._fig4_5_verdict({1e-3: 117.0, 3e-2: 83.0}, (31.0, 61.0), (120.0, 120.0))
    assert verdict == "partly"
    assert "range over widths 31.0-61.0 is not mild" in reason
    assert "depths" not in reason


@pytest.mark.parametrize(
    ("mean_rank", "width_range", "depth_range", "expected"),
    [
        ({1e-3: 117.0, 1e-2: 105.0, 3e-2: 25.0}, (5.7, 6.7), (6.0, 8.0), "reproduced"),
        ({1e-3: 117.0, 1e-2: 105.0, 3e-2: 25.0}, (5.7, 30.7), (6.0, 122.0), "partly"),
        ({1e-3: 117.0, 1e-2: 120.0, 3e-2: 25.0}, (5.7, 6.7), (6.0, 8.0), "partly"),  # not falling at every step
        ({1e-3: 100.0, 3e-2: 110.0}, (5.0, 60.0), (6.0, 122.0), "not"),
    ],
)
def test_fig4_5_verdict(mean_rank, width_range, depth_range, expected):
    assert zangrando._fig4_5_verdict(mean_rank, width_range, depth_range)[0] == expected


def test_fig4_5_quick_run_with_one_weight_decay_and_a_rank_growing_with_width_is_not_reproduced(tmp_path, monkeypatch):
    # No training; every hidden matrix reports its full rank, so the rank grows with the width and is flat in depth.
    monkeypatch.setattr(zangrando, "train_epochs", lambda *args, **kwargs: None)
    monkeypatch.setattr(zangrando, "rank_at_tail_error", lambda w, threshold=0.01: min(w.shape))
    context = Context(name="zangrando_fig4_5", quick=True, device=torch.device("cpu"), directory=tmp_path)
    (claim,) = zangrando.zangrando_fig4_5(context)
    assert claim.verdict == "partly", claim.ours
    assert "range over widths 32.0-64.0 is not mild" in claim.reason
    assert "only one weight decay" in claim.reason


def _results() -> list[ExperimentResult]:
    claim = Claim("feng_fig1", "a claim", "the paper's number", "ours", "reproduced", "why", 1.0)
    return [ExperimentResult("feng_fig1", [claim], [], 1.0, 1.0)]


def test_a_quick_summary_says_its_verdicts_come_from_smoke_test_sizes(tmp_path):
    csv_path, md_path = write_summary(_results(), tmp_path, quick=True)
    with csv_path.open() as handle:
        (row,) = list(csv.DictReader(handle))
    assert row["verdict"] == "reproduced"
    assert row["sizes"].startswith("quick") and "cannot confirm" in row["sizes"]
    text = md_path.read_text()
    assert text.startswith("**Quick mode: smoke-test sizes") and "confirm" in text.splitlines()[0]
    assert "| reproduced (quick size) |" in text


def test_a_default_summary_keeps_its_format(tmp_path):
    csv_path, md_path = write_summary(_results(), tmp_path)
    with csv_path.open() as handle:
        header = next(csv.reader(handle))
    assert header == ["experiment", "claim", "paper", "ours", "verdict", "reason", "value", "seconds", "cpu_seconds"]
    assert md_path.read_text().splitlines() == [
        "| experiment | claim | paper | ours | verdict |",
        "|---|---|---|---|---|",
        "| feng_fig1 | a claim | the paper's number | ours | reproduced |",
    ]


def test_quick_verdicts_are_printed_with_their_mark(tmp_path, capsys):
    assert main(["feng_fig1", "--quick", "--quiet", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Quick mode: smoke-test sizes")
    assert "(quick size)] Jacobian and feature ranks" in out
    assert main(["feng_fig1", "--quiet", "--out", str(tmp_path / "default")]) == 0
    out = capsys.readouterr().out
    assert "Quick mode" not in out and "(quick size)" not in out
    assert "[reproduced] Jacobian and feature ranks" in out
