import csv
import io
import math
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import CSVLogger
from torch import nn

from rank_lightning.analysis.report import available_namespaces, find_runs, load_run, main, write_figures
from rank_lightning.callbacks import WeightRankMonitor
from rank_lightning.callbacks.curves import FIGURE_DIR, write_curve_file

METRICS = ["numerical_rank", "stable_rank"]
DEPTH_ORDER = ["z_in", "m_mid", "a_out"]


class _Classifier(pl.LightningModule):
    def __init__(self, weight_decay: float) -> None:
        super().__init__()
        # Names sort alphabetically against depth, so the report must take the order from the run.
        self.z_in = nn.Linear(6, 16)
        self.m_mid = nn.Linear(16, 16)
        self.a_out = nn.Linear(16, 3)
        self.weight_decay = weight_decay

    def forward(self, x):
        return self.a_out(torch.relu(self.m_mid(torch.relu(self.z_in(x)))))

    def training_step(self, batch, batch_idx):
        return nn.functional.cross_entropy(self(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        self.log("val/acc", (self(batch[0]).argmax(1) == batch[1]).float().mean())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.2, weight_decay=self.weight_decay)


def _loader(seed: int) -> torch.utils.data.DataLoader:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(48, 6, generator=generator)
    data = torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long())
    return torch.utils.data.DataLoader(data, batch_size=16)


def _train(
    weight_decay: float, *, max_epochs: int = 2, ckpt_path: Path | None = None, **trainer_options
) -> tuple[WeightRankMonitor, pl.Trainer]:
    torch.manual_seed(0)
    monitor = WeightRankMonitor(metrics=METRICS, verbose=False)
    trainer = pl.Trainer(
        max_epochs=max_epochs,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[monitor],
        **trainer_options,
    )
    trainer.fit(_Classifier(weight_decay), _loader(0), _loader(1), ckpt_path=ckpt_path)
    return monitor, trainer


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> tuple[Path, dict[str, tuple[WeightRankMonitor, float]]]:
    root = tmp_path_factory.mktemp("sweep")
    runs = {}
    for name, weight_decay in (("wd0", 0.0), ("wd1", 0.5)):
        monitor, trainer = _train(weight_decay, logger=CSVLogger(root, name=name))
        runs[f"{name}/version_0"] = (monitor, float(trainer.callback_metrics["val/acc"]))
    return root, runs


def _read(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as file:
        return list(csv.DictReader(file))


def test_summary_holds_the_last_epoch_of_every_run_and_layer(sweep, tmp_path):
    root, runs = sweep
    assert main([str(root), "--out", str(tmp_path)]) == 0

    rows = _read(tmp_path / "summary.csv")
    assert [(r["run"], r["layer"], r["depth"]) for r in rows] == [
        (run, layer, str(depth)) for run in runs for depth, layer in enumerate(DEPTH_ORDER)
    ]
    for row in rows:
        monitor, final_accuracy = runs[row["run"]]
        assert row["epoch"] == "1"
        for metric in METRICS:
            expected = monitor.curves.history[1][row["layer"]][metric]
            assert float(row[f"weight/{metric}"]) == pytest.approx(expected, rel=1e-6)
        assert float(row["val/acc"]) == pytest.approx(final_accuracy)
    # Weight decay shrinks the weights: the runs must differ, or the comparison shows nothing.
    assert rows[0]["weight/stable_rank"] != rows[3]["weight/stable_rank"]

    markdown = (tmp_path / "summary.md").read_text().splitlines()
    assert markdown[0].startswith("| run | namespace | layer | depth | epoch | weight/numerical_rank |")
    assert len(markdown) == 2 + len(rows)
    figures = {p.name for p in tmp_path.glob("*.png")}
    assert figures == {f"weight_{m}_{kind}.png" for m in METRICS for kind in ("vs_epoch", "vs_depth")}


def test_runs_without_csv_are_read_from_the_curve_file(tmp_path):
    monitor, _ = _train(0.0, logger=False, default_root_dir=tmp_path / "run")
    run = load_run(tmp_path / "run")
    assert run.layers == {"weight": DEPTH_ORDER}
    assert run.metrics("weight") == METRICS
    history = monitor.curves.history
    # The untrained weights (epoch -1) and the two trained epochs.
    assert run.curves["weight"]["m_mid"]["stable_rank"] == {e: history[e]["m_mid"]["stable_rank"] for e in (-1, 0, 1)}
    assert run.final == {}


def _csv_epochs(run: Path, key: str) -> list[int]:
    return [int(row["epoch"]) for row in _read(run / "metrics.csv") if row.get(key)]


def test_a_run_resumed_into_a_new_version_folder_is_reported_from_its_first_epoch(tmp_path):
    root = tmp_path / "logs"
    _, first = _train(0.0, logger=CSVLogger(root, name="run"))
    first.save_checkpoint(tmp_path / "last.ckpt")
    resumed, _ = _train(0.0, max_epochs=4, ckpt_path=tmp_path / "last.ckpt", logger=CSVLogger(root, name="run"))
    run_dir = root / "run" / "version_1"
    # The resumed run's CSV starts at the resume; its curve file holds the whole history.
    assert _csv_epochs(run_dir, "weight/m_mid/stable_rank") == [2, 3]
    history = resumed.curves.history
    assert sorted(history) == [-1, 0, 1, 2, 3]

    run = load_run(run_dir)
    for layer in DEPTH_ORDER:
        for metric in METRICS:
            assert run.curves["weight"][layer][metric] == {e: history[e][layer][metric] for e in history}
    assert run.superseded == {}
    assert run.final == {"val/acc": pytest.approx(float(_read(run_dir / "metrics.csv")[-1]["val/acc"]))}


@pytest.mark.filterwarnings("ignore:Experiment logs directory .* exists and is not empty")
def test_a_run_resumed_into_its_own_folder_shows_the_values_of_the_last_fit_and_names_the_replaced_ones(
    tmp_path, capsys
):
    root = tmp_path / "logs"
    _, first = _train(0.0, max_epochs=1, logger=CSVLogger(root, name="run", version=0))
    first.save_checkpoint(tmp_path / "epoch_0.ckpt")
    _train(0.0, max_epochs=3, ckpt_path=tmp_path / "epoch_0.ckpt", logger=CSVLogger(root, name="run", version=0))
    # Resumed once more from epoch 0, into the same folder, with a larger weight decay: epochs 1 and 2 are replaced.
    logger = CSVLogger(root, name="run", version=0)
    with pytest.warns(UserWarning, match="epochs 1-2 are trained again"):
        last, _ = _train(0.5, max_epochs=3, ckpt_path=tmp_path / "epoch_0.ckpt", logger=logger)
    run_dir = root / "run" / "version_0"
    assert _csv_epochs(run_dir, "weight/m_mid/stable_rank") == [1, 2]

    run = load_run(run_dir)
    history = last.curves.history
    assert sorted(history) == [-1, 0, 1, 2]
    assert run.curves["weight"]["z_in"]["stable_rank"] == {e: history[e]["z_in"]["stable_rank"] for e in history}
    assert run.superseded == {"weight": [1, 2]}

    assert main([str(run_dir), "--out", str(tmp_path / "report")]) == 0
    out = capsys.readouterr().out
    assert "values replaced by a resumed fit, not drawn: version_0 weight epochs 1-2" in out
    assert {r["epoch"] for r in _read(tmp_path / "report" / "summary.csv")} == {"2"}


def _write_csv(path: Path, rows: list[dict[str, object]]) -> None:
    path.mkdir(parents=True)
    columns = sorted({key for row in rows for key in row})
    with (path / "metrics.csv").open("w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


def test_csv_parsing_without_curve_file_uses_natural_layer_order(tmp_path):
    _write_csv(
        tmp_path / "lightning_logs" / "version_10",
        [
            {"epoch": 0, "step": 3, "train/loss": 1.0},
            {"epoch": 0, "step": 3, "rank/layer10/flatten/numerical_rank": 5, "rank/layer2/flatten/numerical_rank": 7},
            {"epoch": 1, "step": 7, "rank/layer10/flatten/numerical_rank": 4, "rank/layer2/flatten/numerical_rank": 6},
            {"epoch": 1, "step": 7, "val/acc": 0.5, "weight/layer2/stable_rank": "nan"},
        ],
    )
    _write_csv(tmp_path / "lightning_logs" / "version_9", [{"epoch": 0, "step": 1, "weight/fc/stable_rank": 2.0}])
    found = find_runs([tmp_path / "lightning_logs"])
    assert [label for label, _ in found] == ["version_9", "version_10"]

    run = load_run(found[1][1])
    assert run.layers == {"rank": ["layer2", "layer10"], "weight": ["layer2"]}
    assert run.curves["rank"]["layer10"]["flatten/numerical_rank"] == {0: 5.0, 1: 4.0}
    assert math.isnan(run.curves["weight"]["layer2"]["stable_rank"][1])
    assert run.final == {"val/acc": 0.5}
    assert run.last_point("rank") == 1


def _jacobian_run(directory: Path) -> Path:
    """A run of JacobianRankMonitor (configs/feng_digits.yaml): curves under ``jacobian``, a CSV with other keys."""
    history = {epoch: {"layer1": {"rank": 8.0 - epoch}, "layer2": {"rank": 6.0 - epoch}} for epoch in (0, 1)}
    write_curve_file(
        directory / FIGURE_DIR / "jacobian_curves.json", "jacobian", ["layer1", "layer2"], ["rank"], history
    )
    _write_csv(directory / "csv", [{"epoch": 1, "jacobian/layer1/rank": 7.0, "clsdim/cls_dim": 8, "val/acc": 0.9}])
    (directory / "csv" / "metrics.csv").rename(directory / "metrics.csv")
    return directory


def test_runs_of_other_namespaces_are_skipped_with_the_namespaces_they_have(tmp_path, capsys):
    weights, jacobian = _one_run(tmp_path / "logs"), _jacobian_run(tmp_path / "logs" / "feng")
    assert available_namespaces(jacobian) == ["jacobian"]
    assert main([str(weights), str(jacobian), "--out", str(tmp_path / "report")]) == 0
    suggestion = "feng (it has jacobian: --namespaces rank rank_train weight jacobian)"
    assert f"skipped, no keys of rank rank_train weight: {suggestion}" in capsys.readouterr().out

    with pytest.raises(SystemExit) as exit_info:
        main([str(jacobian), "--out", str(tmp_path / "alone")])
    assert exit_info.value.code == 2
    assert "no keys of the namespaces rank rank_train weight in feng (it has jacobian: --namespaces jacobian)" in (
        capsys.readouterr().err
    )
    assert main([str(jacobian), "--out", str(tmp_path / "alone"), "--namespaces", "jacobian"]) == 0
    assert [r["layer"] for r in _read(tmp_path / "alone" / "summary.csv")] == ["layer1", "layer2"]


@pytest.mark.parametrize("make", [False, True], ids=["missing", "empty"])
def test_paths_without_runs_are_reported(tmp_path, capsys, make):
    path = tmp_path / "nothing"
    if make:
        path.mkdir()
    with pytest.raises(SystemExit) as exit_info:
        main([str(path), "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert str(path) in capsys.readouterr().err


@pytest.mark.slow
def test_command_line_on_a_real_run(sweep, tmp_path):
    root, _ = sweep
    result = subprocess.run(
        [sys.executable, "-m", "rank_lightning.analysis.report", str(root / "wd0"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "1 run(s): version_0" in result.stdout
    assert len(_read(tmp_path / "summary.csv")) == len(DEPTH_ORDER)
    assert (tmp_path / "weight_stable_rank_vs_depth.png").stat().st_size > 1000


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _one_run(root: Path, metrics: Sequence[str] = ("numerical_rank",)) -> Path:
    rows = [{"epoch": e, "step": e, **{f"weight/fc/{m}": 3 - e for m in metrics}} for e in (0, 1)]
    _write_csv(root / "version_0", rows)
    return root / "version_0"


def test_a_second_report_never_overwrites_the_first(tmp_path, capsys):
    run, out = _one_run(tmp_path / "logs"), tmp_path / "report"
    assert main([str(run), "--out", str(out)]) == 0
    first = {path.name: path.read_bytes() for path in out.iterdir()}
    assert set(first) == {
        "summary.csv",
        "summary.md",
        "weight_numerical_rank_vs_epoch.png",
        "weight_numerical_rank_vs_depth.png",
    }
    capsys.readouterr()

    assert main([str(run), "--out", str(out)]) == 0
    assert {path.name: path.read_bytes() for path in out.iterdir() if path.is_file()} == first
    assert {path.name for path in (out / "run_2").iterdir()} == set(first)
    assert f"written to {out / 'run_2'}" in capsys.readouterr().out


def test_summary_of_what_was_written_fits_one_screen(tmp_path, capsys):
    metrics = ("numerical_rank", "stable_rank", "soft_rank")
    run, out = _one_run(tmp_path / "logs", metrics), tmp_path / "report"
    assert main([str(run), "--out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) <= 8
    text = "\n".join(lines)
    assert "1 run(s): version_0" in text
    assert f"written to {out}" in text
    assert "6 figures" in text and "weight_numerical_rank_vs_epoch.png" in text
    assert "summary.csv, summary.md" in text
    assert (out / "weight_soft_rank_vs_depth.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("terminal", "quiet", "shown"),
    [(True, False, True), (True, True, False), (False, False, False)],
    ids=["terminal", "quiet", "pipe"],
)
def test_progress_only_on_a_terminal_unless_quiet(tmp_path, monkeypatch, terminal, quiet, shown):
    run = _one_run(tmp_path / "logs")
    stdout = _Terminal() if terminal else io.StringIO()
    monkeypatch.setattr(sys, "stdout", stdout)
    assert main([str(run), "--out", str(tmp_path / "report"), *(["--quiet"] if quiet else [])]) == 0
    text = stdout.getvalue()
    assert ("reading runs" in text) is shown
    assert ("drawing figures" in text) is shown
    assert "1 run(s): version_0" in text


def _train_by_step(root: Path, name: str) -> WeightRankMonitor:
    """Two epochs of three optimizer steps, weights measured every step: several points per epoch."""
    torch.manual_seed(0)
    monitor = WeightRankMonitor(metrics=METRICS, every_n_train_steps=1, verbose=False)
    trainer = pl.Trainer(
        max_epochs=2,
        logger=CSVLogger(root, name=name),
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[monitor],
        default_root_dir=root,
    )
    trainer.fit(_Classifier(0.0), _loader(0), _loader(1))
    return monitor


def test_step_cadence_runs_are_reported_against_the_step_from_the_curve_file_or_the_csv(tmp_path):
    monitor = _train_by_step(tmp_path, "stepped")
    history = monitor.curves.history
    assert sorted(history) == [0, 1, 2, 3, 4, 5, 6]  # the untrained weights at step 0, then every step
    run_dir = tmp_path / "stepped" / "version_0"
    from_file = load_run(run_dir)
    assert from_file.x_axes == {"weight": "step"}
    assert from_file.curves["weight"]["m_mid"]["stable_rank"] == {
        s: history[s]["m_mid"]["stable_rank"] for s in history
    }

    # Without the curve file, the CSV's step column keys the values: one key per epoch would keep 2 of 7 points.
    (run_dir / FIGURE_DIR / "weight_curves.json").unlink()
    from_csv = load_run(run_dir)
    assert from_csv.x_axes == {"weight": "step"}
    for layer in DEPTH_ORDER:
        curve = from_csv.curves["weight"][layer]["stable_rank"]
        assert curve == pytest.approx({s: history[s][layer]["stable_rank"] for s in history}, rel=1e-6)
    assert from_csv.last_point("weight") == 6

    out = tmp_path / "report"
    assert main([str(run_dir), "--out", str(out), "--quiet"]) == 0
    assert {p.name for p in out.glob("*.png")} == {
        f"weight_{m}_{k}.png" for m in METRICS for k in ("vs_step", "vs_depth")
    }
    rows = _read(out / "summary.csv")
    assert {(r["epoch"], r["step"]) for r in rows} == {("", "6")}
    for row in rows:
        assert float(row["weight/stable_rank"]) == pytest.approx(history[6][row["layer"]]["stable_rank"], rel=1e-6)


def test_runs_keyed_by_epoch_and_by_step_get_a_figure_for_each_axis(tmp_path):
    _train(0.0, logger=CSVLogger(tmp_path, name="by_epoch"))
    _train_by_step(tmp_path, "by_step")
    runs = [load_run(directory, label=label) for label, directory in find_runs([tmp_path])]
    assert [run.x_axis("weight") for run in runs] == ["epoch", "step"]
    out = tmp_path / "report"
    assert main([str(tmp_path), "--out", str(out), "--quiet"]) == 0
    kinds = ("vs_epoch", "vs_step", "vs_depth")
    assert {p.name for p in out.glob("*.png")} == {f"weight_{m}_{k}.png" for m in METRICS for k in kinds}
    rows = _read(out / "summary.csv")
    assert {(r["run"], r["epoch"], r["step"]) for r in rows} == {
        ("by_epoch/version_0", "1", ""),
        ("by_step/version_0", "", "6"),
    }


def test_a_file_given_as_run_directory_names_the_run_folder(tmp_path, capsys):
    run = _one_run(tmp_path / "logs")
    with pytest.raises(SystemExit) as exit_info:
        main([str(run / "metrics.csv"), "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    given = str(run / "metrics.csv")
    assert f"run directory {given!r} is a file, not a folder: give a run's folder ({str(run)!r} for this file)" in err
    assert "does not exist" not in err


def test_an_unreadable_curve_file_is_one_message_naming_it(tmp_path, capsys):
    run = _one_run(tmp_path / "logs")
    curve_file = run / FIGURE_DIR / "weight_curves.json"
    curve_file.parent.mkdir()
    curve_file.write_text('{"namespace": "weight", "lay')
    with pytest.raises(SystemExit) as exit_info:
        main([str(run), "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"error: cannot read the curve file {str(curve_file)!r} (JSONDecodeError: " in err
    assert "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_figures_of_a_namespace_draw_only_the_runs_that_hold_it(tmp_path, monkeypatch):
    weights, jacobian = _one_run(tmp_path / "logs"), _jacobian_run(tmp_path / "logs" / "feng")
    runs = [load_run(d, label=label, namespaces=["weight", "jacobian"]) for label, d in find_runs([weights, jacobian])]
    jobs = []
    monkeypatch.setattr("rank_lightning.analysis.report.draw_figures", lambda todo, on_figure: jobs.extend(todo) or [])
    write_figures(runs, tmp_path / "out")
    drawn = {job.path.name: list(job.args[3]) for job in jobs}
    assert drawn == {
        "weight_numerical_rank_vs_epoch.png": ["version_0"],
        "weight_numerical_rank_vs_depth.png": ["version_0"],
        "jacobian_rank_vs_epoch.png": ["feng"],
        "jacobian_rank_vs_depth.png": ["feng"],
    }
    depth = next(job for job in jobs if job.path.name == "jacobian_rank_vs_depth.png")
    assert depth.kwargs["x_labels"] == {"feng": "epoch"}


def test_a_run_measuring_fewer_layers_keeps_the_depth_order_of_the_figures(tmp_path, monkeypatch):
    # "a_last" sorts first and measured the last layer alone; the figures' panels still go input to output.
    for name, layers in (("a_last", ["a_out"]), ("b_all", DEPTH_ORDER)):
        history = {0: {layer: {"stable_rank": 1.0} for layer in layers}}
        path = tmp_path / name / FIGURE_DIR / "weight_curves.json"
        write_curve_file(path, "weight", layers, ["stable_rank"], history)
    runs = [load_run(directory, label=label) for label, directory in find_runs([tmp_path])]
    assert [run.label for run in runs] == ["a_last", "b_all"]
    jobs = []
    monkeypatch.setattr("rank_lightning.analysis.report.draw_figures", lambda todo, on_figure: jobs.extend(todo) or [])
    write_figures(runs, tmp_path / "out")
    assert {job.path.name: job.args[2] for job in jobs} == {
        "weight_stable_rank_vs_epoch.png": DEPTH_ORDER,
        "weight_stable_rank_vs_depth.png": DEPTH_ORDER,
    }


def test_a_requested_namespace_or_final_metric_no_run_has_is_named(tmp_path, capsys):
    run = _one_run(tmp_path / "logs")
    argv = [str(run), "--namespaces", "weight", "wieght", "--final-metrics", "val/accc", "--out", str(tmp_path / "o")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "--namespaces wieght: no run has keys wieght/<layer>/<metric>; the runs have: weight\n" in out
    assert "--final-metrics val/accc: no run logged it; the runs logged no run-level key\n" in out
    assert main([str(run), "--out", str(tmp_path / "defaults")]) == 0
    assert "no run" not in capsys.readouterr().out


def test_a_missing_final_metric_is_named_with_those_the_runs_logged(tmp_path, capsys):
    _write_csv(tmp_path / "run", [{"epoch": 0, "step": 3, "weight/fc/numerical_rank": 2.0, "val/loss": 0.5}])
    assert main([str(tmp_path / "run"), "--final-metrics", "val/los", "--out", str(tmp_path / "o")]) == 0
    assert "--final-metrics val/los: no run logged it; the runs logged: val/loss\n" in capsys.readouterr().out


def test_curve_files_an_earlier_run_left_in_the_folder_are_named_not_mixed_in(tmp_path, capsys):
    run = tmp_path / "version_0"
    for stem, value in (("weight_curves-v1", 9.0), ("weight_curves", 4.0)):
        history = {0: {"fc": {"numerical_rank": value}}}
        write_curve_file(run / FIGURE_DIR / f"{stem}.json", "weight", ["fc"], ["numerical_rank"], history)
    assert main([str(run), "--out", str(tmp_path / "out")]) == 0
    assert (
        "version_0: the curves of an earlier run in its folder, kept as rank_curves/weight_curves-v1.json, are not "
        "reported (copied into a folder of their own as rank_curves/<namespace>_curves.json, they are)\n"
    ) in capsys.readouterr().out
    assert [r["weight/numerical_rank"] for r in _read(tmp_path / "out" / "summary.csv")] == ["4.0"]
