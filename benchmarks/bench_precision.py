"""Per-batch Gram precision: float64 against float32 and TF32 products accumulated into float64 sums.

``ActivationSpectrum(gram_precision=...)`` streams every batch's Gram ``X^T X`` into float64 running sums; the
product itself runs in float64 (exact to float64 rounding), float32, or TF32 (CUDA tensor cores, 10-bit mantissa).
This benchmark measures, on realistic activations, what each choice costs per update and how far every metric moves
from the float64 result:

* ``resnet18_layer3_channel``: the ``layer3`` output of a CIFAR-shaped ResNet-18 (random weights, random images,
  ``(B, 256, 8, 8)``), channel reduction: ``d = 256``, ``N = B * 64`` rows per batch;
* ``resnet18_layer4_channel``: ``layer4``, ``(B, 512, 4, 4)``: ``d = 512``;
* ``gpt2_token``: the last block's hidden states of a GPT-2-shaped ``transformers`` model (random weights, random
  tokens), token reduction: ``d = 768`` (``--quick``: 64), ``N = B * T``;
* ``gpt2_medium_token``: the same at width 1024 (skipped with ``--quick``).

Activations are computed once (in float32, and cast to bfloat16 for the ``bfloat16`` input rows, as a
``bf16-mixed`` run hands them to a hook) and kept on the device, so only ``update`` is timed. For each case, input
dtype and precision: median milliseconds per ``update`` (device synchronised), the speed-up over float64, and the
error of every metric of ``ActivationSpectrumResult.as_dict()`` (uncentred and centred spectra, total cluster
variation) against the float64 run on the same inputs: relative error, and the absolute difference of the numerical
rank at the default tolerance (``finfo(float32).eps * min(N, d)``).

Run::

    python benchmarks/bench_precision.py --device cuda --out $OUT      # a GPU: full sizes, about 1-2 minutes
    python benchmarks/bench_precision.py --device cpu --quick          # a laptop: tiny sizes, seconds

Writes ``precision.json`` (every number), ``precision.csv`` (one row per case, input dtype, precision and metric)
and ``precision.md`` (the summary table) into ``--out``.
"""

from __future__ import annotations

import argparse
import csv
import inspect
import json
import math
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from rank_lightning.metrics import ActivationSpectrum

PRECISIONS = ("float64", "float32", "tf32")
RANK_KEYS = ("numerical_rank", "centered_numerical_rank")


@dataclass
class Case:
    """Activations of one layer: a list of batches on the device and the reduction that makes them a matrix."""

    name: str
    reduction: str
    batches: list[torch.Tensor]

    @property
    def num_features(self) -> int:
        return self.batches[0].shape[1] if self.reduction == "channel" else self.batches[0].shape[-1]


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def _resnet_cases(device: torch.device, batch: int, num_batches: int) -> list[Case]:
    from rank_lightning.models import create_model

    torch.manual_seed(0)
    model = create_model("resnet18", num_classes=10, in_channels=3, image_size=32).to(device).eval()
    captured: dict[str, list[torch.Tensor]] = {"layer3": [], "layer4": []}
    hooks = [
        getattr(model, name).register_forward_hook(lambda _m, _i, out, name=name: captured[name].append(out.detach()))
        for name in captured
    ]
    for _ in range(num_batches):
        model(torch.randn(batch, 3, 32, 32, device=device))
    for hook in hooks:
        hook.remove()
    return [Case(f"resnet18_{name}_channel", "channel", outs) for name, outs in captured.items()]


@torch.no_grad()
def _gpt2_case(name: str, device: torch.device, width: int, seq: int, batch: int, num_batches: int) -> Case:
    from transformers import GPT2Config, GPT2Model

    torch.manual_seed(0)
    heads = max(1, width // 64)
    # Token ids 0 mark begin and end: GPT-2's default 50256 lies outside the small vocabulary.
    config = GPT2Config(
        n_layer=2, n_embd=width, n_head=heads, n_positions=seq, vocab_size=1000, bos_token_id=0, eos_token_id=0
    )
    model = GPT2Model(config).to(device).eval()
    outs = [
        model(input_ids=torch.randint(0, 1000, (batch, seq), device=device)).last_hidden_state
        for _ in range(num_batches)
    ]
    return Case(name, "token", outs)


def build_cases(device: torch.device, quick: bool) -> list[Case]:
    """The activations of every case, on ``device``."""
    if quick:
        cases = _resnet_cases(device, batch=8, num_batches=3)
        return [*cases, _gpt2_case("gpt2_token", device, width=64, seq=32, batch=4, num_batches=3)]
    cases = _resnet_cases(device, batch=256, num_batches=6)
    cases.append(_gpt2_case("gpt2_token", device, width=768, seq=512, batch=8, num_batches=6))
    cases.append(_gpt2_case("gpt2_medium_token", device, width=1024, seq=512, batch=8, num_batches=6))
    return cases


def _check_metric_api() -> None:
    if "gram_precision" not in inspect.signature(ActivationSpectrum.__init__).parameters:
        raise SystemExit("ActivationSpectrum has no gram_precision option in this version of rank_lightning")


def _timed(fn: Callable[[], None], device: torch.device) -> float:
    _synchronize(device)
    start = time.perf_counter()
    fn()
    _synchronize(device)
    return time.perf_counter() - start


def run_precision(case: Case, batches: list[torch.Tensor], precision: str, device: torch.device, repeats: int):
    """Median ms per update over ``repeats`` passes over the batches, and the metrics of the last pass."""
    times: list[float] = []
    result = None
    for _ in range(repeats + 1):  # the first pass warms up kernels and allocates the states
        metric = ActivationSpectrum(
            reduction=case.reduction,
            center="both",
            num_features=case.num_features,
            gram_precision=precision,
            max_gram_features=max(4096, case.num_features),
        ).to(device)
        elapsed = [_timed(lambda b=b, m=metric: m.update(b), device) for b in batches]
        times.append(statistics.median(elapsed) * 1e3)
        result = metric.compute()
    return statistics.median(times[1:]), result.as_dict()


def _errors(values: dict[str, float], reference: dict[str, float]) -> dict[str, float]:
    out = {}
    for key, ref in reference.items():
        value = values.get(key, math.nan)
        if key in RANK_KEYS:
            out[key] = abs(value - ref)
        elif key != "spectrum_rows":
            out[key] = abs(value - ref) / abs(ref) if ref else abs(value)
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (CPU smoke run)")
    parser.add_argument("--repeats", type=int, default=None, help="timed passes (default 5, --quick 1)")
    parser.add_argument("--out", type=Path, default=Path("."), help="directory of the result files")
    args = parser.parse_args(argv)
    _check_metric_api()
    device = torch.device(args.device)
    repeats = args.repeats or (1 if args.quick else 5)
    input_dtypes = [torch.float32] if args.quick else [torch.float32, torch.bfloat16]
    cases = build_cases(device, args.quick)
    rows, summary = [], []
    for case in cases:
        for dtype in input_dtypes:
            batches = [b.to(dtype) for b in case.batches]
            measured = {p: run_precision(case, batches, p, device, repeats) for p in PRECISIONS}
            base_ms, reference = measured["float64"]
            for precision, (ms, values) in measured.items():
                errors = _errors(values, reference)
                relative = {k: v for k, v in errors.items() if k not in RANK_KEYS and math.isfinite(v)}
                summary.append(
                    {
                        "case": case.name,
                        "d": case.num_features,
                        "rows_per_update": batches[0].numel() // case.num_features,
                        "input_dtype": str(dtype).removeprefix("torch."),
                        "precision": precision,
                        "ms_per_update": ms,
                        "speedup_vs_float64": base_ms / ms,
                        "max_relative_error": max(relative.values(), default=math.nan),
                        "worst_metric": max(relative, key=relative.get) if relative else "",
                        "numerical_rank_error": errors.get("numerical_rank", math.nan),
                        "centered_numerical_rank_error": errors.get("centered_numerical_rank", math.nan),
                        "numerical_rank_float64": reference.get("numerical_rank", math.nan),
                    }
                )
                rows.extend(
                    {
                        "case": case.name,
                        "input_dtype": summary[-1]["input_dtype"],
                        "precision": precision,
                        "metric": key,
                        "value": values.get(key, math.nan),
                        "float64_value": ref,
                        "error": errors.get(key, math.nan),
                    }
                    for key, ref in reference.items()
                )
            print(_table(summary[-len(PRECISIONS) :], header=False), flush=True)
    report = {
        "device": _device_name(device),
        "torch": torch.__version__,
        "quick": args.quick,
        "repeats": repeats,
        "tf32_note": "on a CPU tf32 runs as float32" if device.type != "cuda" else "",
        "summary": summary,
    }
    _write(args.out, report, rows)
    return report


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"


def _table(summary: list[dict], header: bool = True) -> str:
    lines = []
    if header:
        lines += [
            "| case | d | input | precision | ms/update | speed-up | max rel. error (metric) | rank error |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
    for row in summary:
        lines.append(
            f"| {row['case']} | {row['d']} | {row['input_dtype']} | {row['precision']} | {row['ms_per_update']:.3f} "
            f"| {row['speedup_vs_float64']:.2f}x | {row['max_relative_error']:.2e} ({row['worst_metric']}) "
            f"| {row['numerical_rank_error']:g} / {row['centered_numerical_rank_error']:g} |"
        )
    return "\n".join(lines)


def _write(out: Path, report: dict, rows: list[dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "precision.json").write_text(json.dumps(report, indent=1))
    with (out / "precision.csv").open("w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    text = (
        f"Gram precision on {report['device']} (torch {report['torch']}); errors against the float64 products on "
        "the same inputs; rank error = |numerical rank - float64's| uncentred / centred, default tolerance.\n\n"
        + _table(report["summary"])
        + "\n"
    )
    (out / "precision.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
