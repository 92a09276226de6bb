"""Every reproduction runs at --quick size, writes finite numbers, and the claims that hold at that size hold."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
import torch

from rank_lightning.reproduce import EXPERIMENTS, run_experiments
from rank_lightning.reproduce.cli import main
from rank_lightning.reproduce.core import Claim, ExperimentResult


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, ExperimentResult]]:
    """All experiments once, at quick size, in one process (the costly part of this module)."""
    directory, results = run_experiments(list(EXPERIMENTS), tmp_path_factory.mktemp("reproduce"), quick=True)
    return directory, {result.name: result for result in results}


def _claims(results: dict[str, ExperimentResult], name: str) -> list[Claim]:
    return results[name].claims


def _numbers(path: Path) -> list[float]:
    with path.open() as handle:
        rows = list(csv.DictReader(handle))
    assert rows, f"{path} has no rows"
    values = []
    for row in rows:
        for cell in row.values():
            try:
                values.append(float(cell))
            except ValueError:
                continue
    return values


def test_every_experiment_writes_a_figure_finite_tables_and_claims(quick_run):
    directory, results = quick_run
    assert set(results) == set(EXPERIMENTS)
    for name, result in results.items():
        figures = [p for p in result.files if p.suffix == ".png"]
        tables = [p for p in result.files if p.suffix == ".csv"]
        assert figures and tables and result.claims, name
        for path in figures:
            assert path.is_file() and path.stat().st_size > 1000, path
        for path in tables:
            numbers = _numbers(path)
            assert numbers, path
            # A NaN is allowed only where a metric is undefined by construction; none of these tables has one.
            assert all(math.isfinite(v) for v in numbers), f"non-finite number in {path}"
        for claim in result.claims:
            assert claim.verdict in ("reproduced", "partly", "not")
            assert claim.claim and claim.paper and claim.ours
    with (directory / "summary.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == sum(len(r.claims) for r in results.values())
    assert all(row["sizes"].startswith("quick") for row in rows)
    # the quick-mode note, a blank line, the header and its rule, one line per claim
    assert (directory / "summary.md").read_text().count("\n") == len(rows) + 4


def test_batch_norm_keeps_rank_of_order_sqrt_width_and_vanilla_collapses(quick_run):
    bn, vanilla = _claims(quick_run[1], "daneshmand_fig2")
    width = 32
    # The figure's statement: the rank itself stays above sqrt(d). The verdict used to rest on r(H) >= sqrt(d) / 2
    # alone and said "reproduced" beside r(H_64) = 4.95 < 5.66 under "BN rank stays above sqrt(d) = 5.66".
    assert bn.value >= math.sqrt(width), bn.ours
    assert vanilla.value <= 1.5, vanilla.ours
    assert bn.verdict == vanilla.verdict == "reproduced"


def test_theorem5_holds_within_its_finite_depth_error(quick_run):
    (claim,) = _claims(quick_run[1], "feng_fig1")
    assert claim.verdict == "reproduced", claim.ours
    assert claim.value <= 5.0  # the rate error times the depth: O(1)


def test_rank_falls_with_weight_decay(quick_run):
    rank_claim = _claims(quick_run[1], "zangrando_fig3")[0]
    assert rank_claim.value < 0, rank_claim.ours  # 1% rank at the largest decay minus the one without decay
    autoencoder = _claims(quick_run[1], "zangrando_fig1")[0]
    assert autoencoder.value < 0.5, autoencoder.ours  # tail error at rank K: small sigma, large decay vs the reverse


def test_the_default_initialisation_leaves_deep_vanilla_features_without_spread_and_rescaling_restores_it(quick_run):
    directory = quick_run[0]
    with (directory / "daneshmand_fig6" / "diagnostics.csv").open() as handle:
        rows = {row["variant"]: row for row in csv.DictReader(handle)}
    vanilla = rows["vanilla"]
    assert float(vanilla["r_H_L_before"]) < 1.1
    # The default initialisation shrinks the input-dependent part of the signal layer by layer until the biases'
    # constant vector is all that is left (depth 8 at quick size; at depth 32 it falls below float32 resolution).
    assert float(vanilla["relative_spread_H_L_before"]) < 0.05
    rescaled = rows["rescaling only"]
    assert float(rescaled["rms_H_L_after"]) == pytest.approx(1.0, rel=1e-3)
    assert float(rescaled["relative_spread_H_L_after"]) > 10 * float(vanilla["relative_spread_H_L_before"])


def test_a_second_run_never_overwrites_the_first(tmp_path, capsys):
    assert main(["feng_fig1", "--quick", "--quiet", "--out", str(tmp_path)]) == 0
    assert main(["feng_fig1", "--quick", "--quiet", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "feng_fig1" / "feng_fig1.png").is_file()
    assert (tmp_path / "run_2" / "feng_fig1" / "feng_fig1.png").is_file()
    assert "already held a run's files" in capsys.readouterr().out


def test_list_names_every_experiment(capsys):
    assert main(["--list"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in EXPERIMENTS)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["no_such_experiment"], "unknown experiment"),
        ([], "name at least one experiment"),
        (["feng_fig1", "--threads", "0"], "--threads must be positive"),
        (["feng_fig1", "--device", "not-a-device"], "invalid --device"),
        (["feng_fig4", "--device", "meta"], "unsupported device 'meta'; valid device types are: cpu, cuda, mps"),
        (["feng_fig1", "feng_fig1"], "experiment(s) named more than once: feng_fig1"),
    ],
)
def test_bad_arguments_are_refused_with_the_valid_choices(argv, message, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    assert message in capsys.readouterr().err


def test_a_data_dir_without_fashion_mnist_is_refused_not_replaced_by_the_digits(tmp_path, capsys):
    missing = tmp_path / "no_data"
    with pytest.raises(SystemExit):
        main(["feng_fig4", "--quick", "--quiet", "--data-dir", str(missing), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert f"--data-dir: data folder '{missing}' holds no Fashion-MNIST files" in err
    assert "FashionMNIST/raw" in err
    assert not (tmp_path / "out").exists()
    with pytest.raises(FileNotFoundError, match="holds no Fashion-MNIST files"):
        run_experiments(["feng_fig4"], tmp_path / "out", quick=True, data_dir=missing)
    assert not (tmp_path / "out").exists()


def test_all_with_other_names_and_an_output_file_are_refused_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["all", "feng_fig1"])
    assert "'all' runs every experiment and takes no other name; got all feng_fig1" in capsys.readouterr().err
    taken = tmp_path / "taken.txt"
    taken.write_text("kept")
    with pytest.raises(SystemExit):
        main(["feng_fig1", "--quick", "--out", str(taken)])
    assert f"--out: output folder '{taken}' is an existing file" in capsys.readouterr().err
    assert taken.read_text() == "kept"


def test_run_experiments_refuses_an_unknown_name(tmp_path):
    with pytest.raises(ValueError, match="valid choices are: daneshmand_fig2"):
        run_experiments(["feng_fig9"], tmp_path)


def test_claim_refuses_an_unknown_verdict():
    with pytest.raises(ValueError, match="reproduced, partly, not"):
        Claim("x", "claim", "paper", "ours", "maybe")


def test_an_lr_layer_never_switched_on_is_not_compared_as_an_lr_model(tmp_path, monkeypatch):
    from rank_lightning.reproduce import sanyal

    # The layer switches on at a training accuracy no network reaches: the "LR model" is the network without it.
    monkeypatch.setattr(sanyal, "_SWITCH_ON_ACCURACY", 1.01)
    with pytest.raises(RuntimeError, match=r"never switched on \(training accuracy below 101% in 4 epochs\): "):
        run_experiments(["sanyal"], tmp_path, quick=True)
    table = (tmp_path / "sanyal" / "low_dimensional_accuracy.csv").read_text()
    assert '"LR-Layer, lambda = 1, 1",128,' in table


def test_a_device_this_machine_lacks_is_refused_before_any_work(tmp_path, monkeypatch):
    from rank_lightning.reproduce.core import check_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"device 'cuda:3' does not exist: this machine has 1 CUDA device\(s\)"):
        run_experiments(["feng_fig4"], tmp_path / "out", quick=True, device="cuda:3")
    assert not (tmp_path / "out").exists()
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(ValueError, match="device 'mps' was asked for but MPS is not available"):
        check_device("mps")
    assert check_device("cpu") == torch.device("cpu")


def test_a_saved_figure_is_a_palette_png_of_at_most_96_colours(tmp_path):
    # Pillow 9.0 (the lowest supported) has no Image.Quantize enum: every experiment stopped at its first figure.
    import matplotlib.pyplot as plt
    from PIL import Image

    from rank_lightning.reproduce.core import Context

    context = Context(name="demo", quick=True, device=torch.device("cpu"), directory=tmp_path)
    figure, axes = plt.subplots(figsize=(2, 1))
    axes.imshow(torch.linspace(0, 1, 400).reshape(20, 20).numpy(), cmap="viridis")
    path = context.save(figure, "figure")
    plt.close(figure)
    assert path == tmp_path / "demo" / "figure.png" and context.files == [path]
    with Image.open(path) as image:
        assert image.mode == "P" and image.size == (144, 72)
        assert 2 < len(image.getcolors()) <= 96
