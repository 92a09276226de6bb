import csv
import itertools
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rank_lightning.analysis import sweep
from rank_lightning.analysis.sweep import (
    WEIGHT_DECAY_KEY,
    aggregate,
    check_arguments,
    find_sweep_runs,
    grid_points,
    parse_grid,
    run_sweep,
    short_names,
    sweep_table,
    write_figure,
)
from rank_lightning.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[2]
ZANGRANDO = ROOT / "configs/zangrando_mlp_digits.yaml"
WANDB_SWEEPS = sorted((ROOT / "configs/sweeps").glob("*_wandb.yaml"))
# Top-level keys of a W&B sweep configuration (docs.wandb.ai, "Sweep configuration options").
WANDB_KEYS = {
    "program",
    "entity",
    "project",
    "description",
    "name",
    "method",
    "metric",
    "parameters",
    "early_terminate",
    "command",
    "run_cap",
}

# Stands in for train.py: writes a metrics.csv whose values encode the grid point and the version, and refuses to
# reuse a run directory, so the runner's bookkeeping can be checked in milliseconds.
FAKE_TRAIN = """
import csv, json, os, sys
args = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--") and "=" in a)
csv_logger = json.loads(args["trainer.logger"])[0]["init_args"]
version = csv_logger["version"]
run_dir = os.path.join(csv_logger["save_dir"], csv_logger["name"], f"version_{version}")
os.makedirs(run_dir)
wd = float(args["model.init_args.weight_decay"])
if wd >= 1:  # a run that fails (e.g. diverges)
    sys.exit(3)
with open(os.path.join(run_dir, "metrics.csv"), "w", newline="") as file:
    writer = csv.writer(file)
    writer.writerow(["epoch", "step", "weight/fc/numerical_rank", "val/acc"])
    writer.writerow([0, 9, 64 - 1000 * wd - 10 * version, ""])
    writer.writerow([0, 9, "", 0.5 + version])
print("threads", os.environ.get("OMP_NUM_THREADS"))
"""


def _read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as file:
        return list(csv.DictReader(file))


# Grid parsing and naming


def test_parse_grid_keeps_order_and_brackets_and_appends_weight_decays():
    grid = parse_grid(
        ["data.init_args.sigma=0.05, 0.1", "--model.init_args.hidden_dims=[64,32],[32,16]"], ["0", "1e-3"]
    )
    assert list(grid) == ["data.init_args.sigma", "model.init_args.hidden_dims", WEIGHT_DECAY_KEY]
    assert grid["data.init_args.sigma"] == ["0.05", "0.1"]
    assert grid["model.init_args.hidden_dims"] == ["[64,32]", "[32,16]"]
    assert grid[WEIGHT_DECAY_KEY] == ["0", "1e-3"]


@pytest.mark.parametrize(
    ("specs", "weight_decays", "message"),
    [
        (["data.init_args.sigma"], None, "is not KEY=V1,V2"),
        (["=1,2"], None, "is not KEY=V1,V2"),
        (["data.init_args.sigma=0.1,,0.2"], None, "empty value"),
        (["data.init_args.sigma=0.1,0.1"], None, "repeats a value"),
        (["data.init_args.sigma=0.05,5e-2"], None, r"repeats a value: \['0.05', '5e-2'\]"),
        ([], ["1e-3", "0.001"], r"repeats a value: \['1e-3', '0.001'\]"),
        ([f"{WEIGHT_DECAY_KEY}=0"], ["1e-3"], "given twice"),
        ([], None, "the grid is empty"),
        # Accepted by the command-line check, then every run of the point failed at its optimizer.
        ([], ["0", "-1e-3"], r"weight decays must be finite numbers >= 0; got '-1e-3' among \['0', '-1e-3'\]"),
        ([f"{WEIGHT_DECAY_KEY}=1e-3,nan"], None, "weight decays must be finite numbers >= 0; got 'nan'"),
    ],
)
def test_parse_grid_rejects_bad_specifications(specs, weight_decays, message):
    with pytest.raises(ValueError, match=message):
        parse_grid(specs, weight_decays)


def test_grid_points_are_the_product_with_readable_unique_names():
    points = grid_points({"data.init_args.sigma": ["0.1", "0.5"], WEIGHT_DECAY_KEY: ["0", "1e-3", "1e-2"]})
    expected = list(itertools.product(["0.1", "0.5"], ["0", "1e-3", "1e-2"]))
    assert [tuple(p.values.values()) for p in points] == expected
    assert points[1].name == "sigma=0.1__weight_decay=1e-3"
    assert points[1].arguments() == ["--data.init_args.sigma=0.1", f"--{WEIGHT_DECAY_KEY}=1e-3"]
    assert len({p.name for p in points}) == 6
    assert grid_points({"model.init_args.hidden_dims": ["[64,32]"]})[0].name == "hidden_dims=_64_32_"


def test_short_names_fall_back_to_the_whole_key():
    names = short_names(
        ["model.init_args.lr", "data.init_args.lr", "model.init_args.backbone_kwargs.depth"], ("depth",)
    )
    assert names == {
        "model.init_args.lr": "model.init_args.lr",
        "data.init_args.lr": "data.init_args.lr",
        "model.init_args.backbone_kwargs.depth": "model.init_args.backbone_kwargs.depth",
    }
    assert grid_points({"model.init_args.backbone_kwargs.depth": ["16"]})[0].name == "depth=16"
    with pytest.raises(ValueError, match="share the name"):
        grid_points({"trainer.logger.name": ["a b", "a_b"]})


def test_check_arguments_rejects_a_key_the_cli_does_not_know():
    check_arguments([str(ZANGRANDO)], {WEIGHT_DECAY_KEY: ["0", "1e-3"], "data.init_args.batch_size": ["32"]})
    unknown = r"ImageClassifier has no option 'weight_decy' \(did you mean 'weight_decay'\?\)"
    with pytest.raises(ValueError, match=unknown):
        check_arguments([str(ZANGRANDO)], {"model.init_args.weight_decy": ["0"]})
    with pytest.raises(ValueError, match="rejects"):
        check_arguments([str(ZANGRANDO)], {WEIGHT_DECAY_KEY: ["not-a-number"]})


# The runner's bookkeeping, with a stand-in for train.py


def test_runner_never_overwrites_and_aggregates_the_newest_finished_version(tmp_path, monkeypatch):
    fake = tmp_path / "fake_train.py"
    fake.write_text(FAKE_TRAIN)
    monkeypatch.setattr(sweep, "train_command", lambda: [sys.executable, str(fake)])
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    out = tmp_path / "sweep"
    points = grid_points(parse_grid([], ["0", "0.01"]))
    messages: list[str] = []
    first = run_sweep(["c.yaml"], points, out, processes=2, echo=messages.append)
    assert [(r.label, r.returncode) for r in first] == [
        ("weight_decay=0/version_0", 0),
        ("weight_decay=0.01/version_0", 0),
    ]
    kept = (out / "weight_decay=0/version_0/metrics.csv").read_text()
    second = run_sweep(["c.yaml"], points, out, processes=1, echo=messages.append)
    assert [r.version for r in second] == [1, 1]
    assert (out / "weight_decay=0/version_0/metrics.csv").read_text() == kept
    # One thread per run however many run at once, so that a point's numbers do not depend on --processes.
    for run in (*first, *second):
        assert "threads 1" in run.log_path.read_text()
    record = json.loads(second[1].record_path.read_text())
    assert record["values"] == {WEIGHT_DECAY_KEY: "0.01"} and record["returncode"] == 0
    assert record["omp_num_threads"] == "1"
    assert "--config=c.yaml" in record["command"] and f"--{WEIGHT_DECAY_KEY}=0.01" in record["command"]
    failed = run_sweep(["c.yaml"], grid_points(parse_grid([], ["1"])), out, echo=messages.append)
    assert failed[0].returncode == 3 and any("FAILED" in m for m in messages)

    chosen, skipped = find_sweep_runs(out)
    assert [r.label for r in chosen] == ["weight_decay=0/version_1", "weight_decay=0.01/version_1"]
    assert [r.label for r in skipped] == ["weight_decay=1/version_0"]
    csv_path, md_path, figure = aggregate(out, echo=messages.append)
    rows = _read_csv(csv_path)
    assert [(r["weight_decay"], float(r["weight/numerical_rank"]), float(r["val/acc"])) for r in rows] == [
        ("0", 54.0, 1.5),
        ("0.01", 44.0, 1.5),
    ]
    assert "| weight_decay | run | namespace | layer |" in md_path.read_text()
    assert figure.stat().st_size > 10_000
    assert any("skipped weight_decay=1/version_0" in m for m in messages)


def test_threads_are_the_same_for_every_number_of_processes(tmp_path, monkeypatch):
    fake = tmp_path / "fake_train.py"
    fake.write_text(FAKE_TRAIN)
    monkeypatch.setattr(sweep, "train_command", lambda: [sys.executable, str(fake)])
    points = grid_points(parse_grid([], ["0", "0.01"]))
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    for processes in (1, 2):
        runs = run_sweep(["c.yaml"], points, tmp_path / "env", processes=processes, echo=lambda _: None)
        assert all("threads 3" in run.log_path.read_text() for run in runs)
        runs = run_sweep(["c.yaml"], points, tmp_path / "flag", processes=processes, threads=2, echo=lambda _: None)
        assert all("threads 2" in run.log_path.read_text() for run in runs)
    with pytest.raises(ValueError, match="threads must be a positive integer, got 0"):
        run_sweep(["c.yaml"], points, tmp_path / "none", threads=0)


# Aggregation of synthetic logs


def _synthetic_run(out: Path, values: dict[str, str], name: str, metrics: dict[str, list[float]]) -> None:
    """A finished run whose metrics.csv has one row per epoch and value list entry."""
    run_dir = out / name / "version_0"
    run_dir.mkdir(parents=True)
    columns = ["epoch", "step", *metrics]
    epochs = len(next(iter(metrics.values())))
    with (run_dir / "metrics.csv").open("w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(columns)
        for epoch in range(epochs):
            writer.writerow([epoch, 10 * epoch, *(metrics[c][epoch] for c in metrics)])
    record = {"point": name, "values": values, "version": 0, "command": [], "returncode": 0, "seconds": 1.0}
    (out / name / "version_0.json").write_text(json.dumps(record))


def test_aggregation_of_synthetic_runs_gives_the_last_epoch_values(tmp_path):
    out = tmp_path / "sweep"
    expected = {}
    for sigma, wd in itertools.product(["0.1", "0.5"], ["0", "1e-3", "1e-2"]):
        shrink = 1 + 100 * float(wd)
        metrics = {
            "weight/enc.0/numerical_rank": [16.0, 16.0 / shrink],
            "weight/enc.0/tail_error_k4": [0.5, 0.5 / shrink / float(sigma)],
            "weight/dec/numerical_rank": [16.0, 8.0 / shrink],
            "rank/layer1/tcv": [9.0, float(sigma) * 3],
            "val/loss": [1.0, float(wd)],
        }
        name = f"sigma={sigma}__weight_decay={wd}"
        _synthetic_run(out, {"data.init_args.sigma": sigma, WEIGHT_DECAY_KEY: wd}, name, metrics)
        expected[(sigma, wd)] = {key: values[-1] for key, values in metrics.items()}
    csv_path, md_path, figure = aggregate(out, table_metrics=["weight/*", "rank/*tcv"])
    rows = _read_csv(csv_path)
    assert list(rows[0])[:7] == ["sigma", "weight_decay", "run", "namespace", "layer", "depth", "epoch"]
    assert len(rows) == 6 * 3
    # Sorted numerically by sigma, then weight decay; "1e-3" < "1e-2" numerically, not as text.
    assert [(r["sigma"], r["weight_decay"]) for r in rows[::3]] == list(
        itertools.product(["0.1", "0.5"], ["0", "1e-3", "1e-2"])
    )
    for row in rows:
        want = expected[(row["sigma"], row["weight_decay"])]
        assert row["epoch"] == "1"
        assert float(row["val/loss"]) == pytest.approx(want["val/loss"])
        for column in ("numerical_rank", "tail_error_k4", "tcv"):
            key = f"{row['namespace']}/{row['layer']}/{column}"
            if key in want:
                assert float(row[f"{row['namespace']}/{column}"]) == pytest.approx(want[key])
            else:
                assert row.get(f"{row['namespace']}/{column}", "") == ""
    md = md_path.read_text().splitlines()
    # Layers of one namespace in natural order when no curves file gives the depth order.
    assert (
        len(md) == 2 + 18
        and md[2] == "| 0.1 | 0 | sigma=0.1__weight_decay=0/version_0 | weight | dec | 0 | 1 | 8 |  |  | 0 |"
    )
    assert figure.is_file() and figure.stat().st_size > 10_000


def test_x_axis_puts_zero_a_decade_below_on_a_log_scale():
    positions, scale, ticks, labels = sweep._x_axis(["1e-2", "0", "1e-4"])
    assert scale == "log"
    assert positions == {"0": pytest.approx(1e-5), "1e-4": 1e-4, "1e-2": 1e-2}
    assert labels == ["0", "1e-4", "1e-2"] and ticks == sorted(ticks)
    assert sweep._x_axis(["1", "2", "3"])[1] == "linear"
    assert sweep._x_axis(["0", "0.5"])[1] == "log"
    positions, scale, _, labels = sweep._x_axis(["relu", "tanh"])
    assert (positions, scale, labels) == ({"relu": 0.0, "tanh": 1.0}, "linear", ["relu", "tanh"])


def test_write_figure_names_the_valid_x_columns(tmp_path):
    out = tmp_path / "sweep"
    _synthetic_run(out, {WEIGHT_DECAY_KEY: "0"}, "weight_decay=0", {"weight/fc/numerical_rank": [3.0]})
    columns, rows = sweep_table(find_sweep_runs(out)[0])
    assert columns == ["weight_decay", "run", "namespace", "layer", "depth", "epoch", "weight/numerical_rank"]
    assert rows[0]["weight/numerical_rank"] == 3.0 and rows[0]["layer"] == "fc"
    with pytest.raises(ValueError, match="unknown x column 'sigma'; grid columns are: weight_decay"):
        write_figure(columns, rows, tmp_path / "f.png", x="sigma")
    with pytest.raises(FileNotFoundError, match="no sweep run"):
        find_sweep_runs(tmp_path)


def test_aggregate_explains_runs_without_rank_metrics(tmp_path):
    _synthetic_run(tmp_path, {WEIGHT_DECAY_KEY: "0"}, "weight_decay=0", {"val/acc": [0.5]})
    with pytest.raises(ValueError, match=re.escape("logged no rank/... or rank_train/... or weight/... metrics")):
        aggregate(tmp_path)


def test_aggregate_names_metric_patterns_that_match_nothing(tmp_path):
    metrics = {"weight/fc/numerical_rank": [3.0], "weight/fc/stable_rank": [2.5]}
    _synthetic_run(tmp_path, {WEIGHT_DECAY_KEY: "0"}, "weight_decay=0", metrics)
    messages: list[str] = []
    figure_metrics = ["weight/numerical_rank", "weight/stable_rnk"]
    csv_path, _, _ = aggregate(tmp_path, figure_metrics=figure_metrics, table_metrics=["rank/*"], echo=messages.append)
    assert messages == [
        "--table-metrics pattern 'rank/*' matches no metric of these runs; they have: weight/numerical_rank, "
        "weight/stable_rank",
        "--figure-metrics pattern 'weight/stable_rnk' matches no metric of these runs; they have: "
        "weight/numerical_rank, weight/stable_rank",
    ]
    assert float(_read_csv(csv_path)[0]["weight/numerical_rank"]) == 3.0


# The W&B sweep files


@pytest.mark.parametrize("path", WANDB_SWEEPS, ids=lambda p: p.name)
def test_wandb_sweep_file_is_valid_and_its_parameters_parse(path, capsys):
    from wandb.sdk.launch.sweeps.utils import create_sweep_command_args

    content = yaml.safe_load(path.read_text())
    assert set(content) <= WANDB_KEYS and {"program", "method", "parameters", "command"} <= set(content)
    assert content["method"] == "grid" and (ROOT / content["program"]).is_file()
    command = content["command"]
    assert command[:3] == ["${env}", "${interpreter}", "${program}"] and command[-1] == "${args}"
    assert "configs/loggers/wandb.yaml" in command
    parameters = content["parameters"]
    assert all(isinstance(spec["values"], list) and spec["values"] for spec in parameters.values())
    assert all(isinstance(v, (int, float)) for spec in parameters.values() for v in spec["values"])
    # Every value of every parameter once: the i-th command line takes the i-th value of each (cycling).
    for i in range(max(len(spec["values"]) for spec in parameters.values())):
        values = {key: spec["values"][i % len(spec["values"])] for key, spec in parameters.items()}
        # The arguments exactly as the agent formats them.
        args = create_sweep_command_args({"args": {k: {"value": v} for k, v in values.items()}})["args"]
        with pytest.raises(SystemExit) as exit_info:
            cli_main(
                [*(str(ROOT / c) if c.startswith("configs/") else c for c in command[3:-1]), *args, "--print_config"]
            )
        assert exit_info.value.code in (0, None)
        printed = yaml.safe_load(capsys.readouterr().out)
        assert "WandbLogger" in json.dumps(printed["trainer"]["logger"])
        for key, value in values.items():
            node = printed
            for part in key.split("."):
                node = node[part]
            assert math.isclose(float(node), value)


def test_the_wandb_sweep_runs_the_same_grid_as_the_documented_command():
    content = yaml.safe_load((ROOT / "configs/sweeps/zangrando_mlp_digits_wandb.yaml").read_text())
    grid = parse_grid([], ["0", "1e-4", "1e-3", "5e-3", "1e-2"])
    assert content["parameters"][WEIGHT_DECAY_KEY]["values"] == [float(v) for v in grid[WEIGHT_DECAY_KEY]]
    assert "configs/zangrando_mlp_digits.yaml" in content["command"]


# End to end


@pytest.mark.slow
def test_tiny_digits_sweep_runs_train_py_and_aggregates(tmp_path):
    overlay = tmp_path / "every_epoch.yaml"
    overlay.write_text(
        yaml.safe_dump(
            {
                "trainer": {
                    "max_epochs": 1,
                    "enable_checkpointing": False,
                    "enable_progress_bar": False,
                    "callbacks": [
                        {
                            "class_path": "rank_lightning.callbacks.WeightRankMonitor",
                            "init_args": {"every_n_epochs": 1, "tail_ranks": [10], "verbose": False},
                        },
                        {
                            "class_path": "rank_lightning.callbacks.ActivationRankMonitor",
                            "init_args": {"every_n_epochs": 1, "metrics": ["numerical_rank", "tcv"], "verbose": False},
                        },
                    ],
                }
            }
        )
    )
    out = tmp_path / "sweep_wd"
    command = [sys.executable, "-m", "rank_lightning.analysis.sweep", "--config", str(ZANGRANDO)]
    command += ["--config", str(overlay), "--weight-decays", "0", "1e-2", "--processes", "2", "--out", str(out)]
    env = dict(os.environ, PYTHONPATH=str(ROOT), WANDB_MODE="disabled")
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    for name in ("weight_decay=0", "weight_decay=1e-2"):
        assert (out / name / "version_0" / "metrics.csv").is_file()
        assert (out / name / "version_0" / "config.yaml").is_file()
        assert json.loads((out / name / "version_0.json").read_text())["returncode"] == 0
    rows = _read_csv(out / "sweep.csv")
    weight_layers = [f"backbone.layers.{i}.linear" for i in range(4)] + ["backbone.head"]
    assert [(r["weight_decay"], r["namespace"], r["layer"]) for r in rows] == [
        (wd, ns, layer)
        for wd in ("0", "1e-2")
        for ns, layers in (("rank", [f"layer{i}" for i in range(1, 5)]), ("weight", weight_layers))
        for layer in layers
    ]
    for column in ("weight/numerical_rank", "weight/tail_error_k10", "rank/numerical_rank", "rank/tcv", "val/acc"):
        assert column in rows[0]
    head = next(r for r in rows if r["layer"] == "backbone.head")
    assert float(head["weight/numerical_rank"]) == 10 and float(head["weight/tail_error_k10"]) == 0
    assert all(0 <= float(r["val/acc"]) <= 1 and r["epoch"] == "0" for r in rows)
    assert (out / "sweep.png").stat().st_size > 10_000
    # Re-aggregation from the runs alone gives the same table.
    before = (out / "sweep.csv").read_text()
    assert sweep.main(["--out", str(out), "--aggregate-only"]) == 0
    assert (out / "sweep.csv").read_text() == before


def test_main_ends_with_a_summary_of_what_it_wrote_and_where(tmp_path, monkeypatch, capsys):
    fake = tmp_path / "fake_train.py"
    fake.write_text(FAKE_TRAIN)
    monkeypatch.setattr(sweep, "train_command", lambda: [sys.executable, str(fake)])
    monkeypatch.setattr(sweep, "check_arguments", lambda configs, grid, extra: None)
    out = tmp_path / "sweep"
    code = sweep.main(["--config", "c.yaml", "--weight-decays", "0", "0.01", "1", "--out", str(out), "--quiet"])
    printed = capsys.readouterr().out
    assert code == 1  # the weight decay 1 run fails in the fake script
    assert "[3/3] FAILED" in printed and "2 of 3 run(s) finished in" in printed
    assert f"written to {out}:" in printed
    assert re.search(r"^\s+2 tables\s+sweep\.csv, sweep\.md$", printed, re.M), printed
    folders = r"^\s+2 run folders\s+weight_decay=0/version_0, weight_decay=0\.01/version_0$"
    assert re.search(folders, printed, re.M), printed
    assert "1 run(s) failed: weight_decay=1/version_0 (see their .log files)" in printed


def test_run_lines_reach_a_pipe_whole_and_as_written(tmp_path, monkeypatch, capsys):
    # A log gets each run's line on one line, its path unbroken and its brackets kept (no console markup).
    fake = tmp_path / "fake_train.py"
    fake.write_text(FAKE_TRAIN)
    monkeypatch.setattr(sweep, "train_command", lambda: [sys.executable, str(fake)])
    monkeypatch.setattr(sweep, "check_arguments", lambda configs, grid, extra: None)
    out = tmp_path / "sweeps [bold]" / ("long_folder_name_" * 4)
    assert sweep.main(["--config", "c.yaml", "--weight-decays", "0", "1", "--out", str(out), "--quiet"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "[1/2] start  weight_decay=0/version_0"
    assert re.fullmatch(r"\[1/2\] done   weight_decay=0/version_0 in \d+ s", lines[2]), lines
    assert lines[3] == "[2/2] start  weight_decay=1/version_0"
    log = out / "weight_decay=1" / "version_0.log"
    failed = rf"\[2/2\] FAILED \(exit 3, see {re.escape(str(log))}\) weight_decay=1/version_0 in \d+ s"
    assert re.fullmatch(failed, lines[4]), lines
    assert re.fullmatch(r"1 of 2 run\(s\) finished in \d+ s", lines[5]), lines


def test_the_figure_title_names_the_step_for_runs_keyed_by_step():
    by_epoch, by_step = {"epoch": 3, "layer": "fc"}, {"epoch": None, "step": 40, "layer": "fc"}
    assert sweep.last_point([by_epoch]) == "epoch"
    assert sweep.last_point([by_step]) == "step"
    assert sweep.last_point([by_epoch, {**by_epoch, "step": None}, by_step]) == "epoch or step"
