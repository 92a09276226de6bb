import csv
import io
import sys
from pathlib import Path

import pytest
import torch

from rank_lightning.analysis.structural_impetus import (
    COMPONENT_LABELS,
    COMPONENTS,
    build_component,
    main,
    structural_impetus,
    structural_impetus_figure,
)

CHANNELS, SIZE, GROUPS = 4, 4, 2
DIM = CHANNELS * SIZE * SIZE


@pytest.fixture(scope="module")
def rows():
    result = structural_impetus(
        channels=CHANNELS, size=SIZE, num_samples=2 * DIM, groups=GROUPS, heads=2, dtype=torch.float64
    )
    return {row.component: row for row in result}


def test_every_component_is_measured_from_a_full_rank_start(rows):
    assert list(rows) == list(COMPONENTS)
    for row in rows.values():
        assert row.feature_rank_before == row.jacobian_rank_before == DIM
        assert row.dim_after == DIM
        # Feng et al. Theorem 2: no component raises the rank.
        assert row.feature_rank_after <= DIM and row.jacobian_rank_after <= DIM


def test_normalisation_layers_lose_their_invariant_directions(rows):
    """Per normalised group the output is invariant to a shift of the input: one Jacobian direction lost per group,
    and the features satisfy one linear constraint (zero mean) per group. The output is invariant to a rescaling only
    up to the epsilon of the normalisation, which leaves a singular value of about eps / variance relative to the
    others: above this small tolerance (7.6e-6 at d = 64) it counts, at the default d = 1024 (1.2e-4) it does not."""
    expected_groups = {"layernorm": 1, "groupnorm": GROUPS, "instancenorm": CHANNELS}
    for name, groups in expected_groups.items():
        row = rows[name]
        assert groups <= DIM - row.jacobian_rank_after <= 2 * groups, name
        assert DIM - row.feature_rank_after == groups, name
    # BatchNorm is an affine map per channel for one input: nothing is lost.
    assert rows["batchnorm"].jacobian_rank_after == rows["batchnorm"].feature_rank_after == DIM


def test_relu_keeps_the_features_but_halves_the_jacobian(rows):
    relu = rows["relu"]
    assert relu.feature_rank_after == DIM
    # The Jacobian keeps only the rows of active units, about half of them.
    assert 0.25 * DIM < relu.jacobian_rank_after < 0.75 * DIM
    assert rows["gelu"].feature_rank_after == DIM


def test_attention_component_maps_tokens():
    module = build_component("attention", CHANNELS, SIZE, heads=2)
    assert module(torch.randn(3, CHANNELS, SIZE, SIZE)).shape == (3, SIZE * SIZE, CHANNELS)
    with pytest.raises(ValueError, match="unknown component 'pool'; components are: linear, conv3x3"):
        build_component("pool", CHANNELS, SIZE)


def test_command_line_prints_a_markdown_table(capsys):
    argv = ["--channels", "4", "--size", "4", "--samples", "64", "--groups", "2", "--heads", "2"]
    main([*argv, "--components", "layernorm", "relu"])
    out = capsys.readouterr().out
    assert "| layernorm | 64 | 64 | 63 | 1 | 64 | 63 | 1 |" in out
    assert "| relu |" in out
    with pytest.raises(SystemExit):
        main(["--channels", "4", "--size", "4", "--samples", "10"])


SMALL = ["--channels", "4", "--size", "4", "--samples", "64", "--groups", "2", "--heads", "2"]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
COUNTS = ["feature_rank_before", "feature_rank_after", "jacobian_rank_before", "jacobian_rank_after"]


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as file:
        return list(csv.DictReader(file))


def test_out_writes_the_figure_the_plotted_numbers_and_the_table(tmp_path, capsys):
    out = tmp_path / "fig3"
    rows = main([*SMALL, "--components", "layernorm", "relu", "--out", str(out)])
    stdout = capsys.readouterr().out

    assert (out / "structural_impetus.png").read_bytes()[:8] == PNG_SIGNATURE
    records = _read_csv(out / "structural_impetus.csv")
    assert [(r["component"], r["label"]) for r in records] == [("layernorm", "LN"), ("relu", "ReLU")]
    for row, record in zip(rows, records, strict=True):
        assert {key: int(record[key]) for key in COUNTS} == {key: getattr(row, key) for key in COUNTS}
        assert int(record["dim_before"]) == int(record["dim_after"]) == DIM
        assert int(record["feature_rank_lost"]) == row.feature_rank_before - row.feature_rank_after
        assert int(record["jacobian_rank_lost"]) == row.jacobian_rank_before - row.jacobian_rank_after
    table = (out / "structural_impetus.md").read_text()
    assert "| layernorm | 64 | 64 | 63 | 1 | 64 | 63 | 1 |" in table
    assert "N = 64 samples" in table
    # The summary names the folder and every file in it.
    for name in ("structural_impetus.png", "structural_impetus.csv", "structural_impetus.md"):
        assert name in stdout
    assert str(out) in stdout


def test_the_figure_draws_the_numbers_of_the_csv(rows):
    measured = list(rows.values())
    figure = structural_impetus_figure(measured, caption="N = 128")
    features, jacobians = figure.axes
    for axes, kind in ((features, "feature"), (jacobians, "jacobian")):
        before, after = axes.containers
        assert [bar.get_height() for bar in before] == [getattr(r, f"{kind}_rank_before") for r in measured]
        assert [bar.get_height() for bar in after] == [getattr(r, f"{kind}_rank_after") for r in measured]
        assert [t.get_text() for t in axes.get_xticklabels()] == [COMPONENT_LABELS[r.component] for r in measured]
    (legend,) = figure.legends
    assert [t.get_text() for t in legend.get_texts()] == [
        f"FC width d = {DIM}",
        "before: Gaussian input → FC",
        "after: Gaussian input → FC → component",
    ]
    assert features.get_title() == "(a) PCA dimension of the feature space"
    assert jacobians.get_title() == "(b) Rank of the Jacobian matrix"
    assert features.get_ylabel() == "feature dimension (numerical rank)"
    assert jacobians.get_ylabel() == "rank of the Jacobian"
    assert figure.texts[-1].get_text() == "N = 128"


def test_a_second_run_never_overwrites_the_first(tmp_path, capsys):
    out = tmp_path / "fig3"
    main([*SMALL, "--components", "relu", "--out", str(out)])
    first = {path.name: path.read_bytes() for path in out.iterdir()}
    main([*SMALL, "--components", "gelu", "--out", str(out)])

    assert {path.name: path.read_bytes() for path in out.iterdir() if path.is_file()} == first
    assert [r["component"] for r in _read_csv(out / "run_2" / "structural_impetus.csv")] == ["gelu"]
    assert str(out / "run_2") in capsys.readouterr().out


@pytest.mark.parametrize(
    ("terminal", "quiet", "shown"),
    [(True, False, True), (True, True, False), (False, False, False)],
    ids=["terminal", "quiet", "pipe"],
)
def test_progress_only_on_a_terminal_unless_quiet(monkeypatch, terminal, quiet, shown):
    stdout = _Terminal() if terminal else io.StringIO()
    monkeypatch.setattr(sys, "stdout", stdout)
    main([*SMALL, "--components", "relu", *(["--quiet"] if quiet else [])])
    text = stdout.getvalue()
    assert ("measuring components" in text) is shown
    assert "| relu |" in text


@pytest.mark.parametrize(
    ("option", "value"), [("--heads", "0"), ("--groups", "0"), ("--channels", "0"), ("--size", "-2")]
)
def test_a_size_below_one_is_refused_naming_the_option_and_value(option, value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([option, value])
    assert exit_info.value.code == 2
    assert f"error: argument {option}: {value!r} is not a whole number of at least 1\n" in capsys.readouterr().err
