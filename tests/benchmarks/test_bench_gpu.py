"""benchmarks/bench_gpu.py at its tiny CPU sizes: the script a GPU session runs works before the GPU is there.

Device time is scarce, so the script must not fail on its first run there: both cases fit plain and monitored, the
report has every field the summary prints, and the result files are written. (The timings themselves mean nothing on
a CPU at these sizes; the synchronisation audit needs CUDA and is not run.)
"""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def bench(monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_gpu", BENCHMARKS / "bench_gpu.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_both_cases_fit_plain_and_monitored_and_the_results_are_written(bench, tmp_path):
    report = bench.main(["--device", "cpu", "--quick", "--out", str(tmp_path)])
    cases = report["overhead"]
    assert [case["case"].split(",")[0] for case in cases] == ["ResNet-18 CIFAR-shaped", "GPT-2-shaped (2 layers"]
    for case in cases:
        assert case["plain_s"] > 0 and case["monitored_s"] > 0
        assert case["ratio"] == pytest.approx(case["monitored_s"] / case["plain_s"])
        assert case["meets_target"] == (case["ratio"] <= case["target"])
        # The figures are drawn at fit end inside the monitored fit, so they are part of its time.
        assert 0 < case["fit_end_s"] < case["monitored_s"]
        assert math.isfinite(case["ratio_without_fit_end"])
    assert report["sync"] == []  # the audit needs CUDA
    assert json.loads((tmp_path / "bench_gpu.json").read_text()) == report
    summary = (tmp_path / "bench_gpu.md").read_text()
    assert summary.count("| ResNet-18 CIFAR-shaped") == 1 and summary.count("| GPT-2-shaped") == 1
