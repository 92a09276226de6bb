"""Monitoring on a GPU: fit-time ratio, peak memory and host synchronisations, side by side in one run.

1. **ResNet-18, CIFAR-shaped** (random images ``3 x 32 x 32``, 10 classes, batch 512): ``ActivationRankMonitor`` on
   every block and ``WeightRankMonitor``, both every epoch, against the same fit without them. Target <= 1.05x.
2. **GPT-2-small-shaped** (``transformers``' ``GPT2LMHeadModel`` from a config with random weights: 12 layers,
   width 768, 12 heads, sequence 512, vocabulary 50,257, batch 8, dict batches with an attention mask), trained in
   ``bf16-mixed``; ``ActivationRankMonitor`` and ``WeightRankMonitor`` every 100 optimizer steps (step cadence) on
   all blocks. Target <= 1.02x.

For both: the median wall time of plain and monitored fits (they alternate, after one untimed warm-up fit that
compiles kernels and tunes cuDNN), the ratio, and the peak GPU memory of each fit (``max_memory_allocated``), whose
difference is the memory monitoring adds.

3. **Host synchronisations.** One more monitored fit of each model with ``torch.cuda.set_sync_debug_mode("warn")``:
   every CUDA operation that makes the host wait for the device raises a warning, recorded with the Python frame that
   caused it. Reported per training / validation batch, split into frames inside ``rank_lightning`` and elsewhere
   (Lightning, the model), and, for the step cadence, into the batches that close a monitored window (where one
   transfer of the results is expected) and all others (where monitoring should add none). The same audit on the
   plain fit gives the baseline the training loop itself causes.

Run (a GPU machine, the repository as working directory)::

    PYTHONPATH=. python benchmarks/bench_gpu.py --device cuda --out $OUT     # about 5 minutes on an H100
    PYTHONPATH=. python benchmarks/bench_gpu.py --device cpu --quick          # tiny sizes: checks the script

Writes ``bench_gpu.json`` (every number), ``bench_gpu.md`` (the summary) and ``sync_audit.txt`` (every recorded
synchronisation inside ``rank_lightning``, by source line) into ``--out``. ``--profile`` adds one monitored fit of
each case under ``cProfile`` and writes its largest entries (by cumulative time, the package's functions first) to
``profile_<case>.txt``: on a GPU the time of asynchronous work shows up at the next synchronisation, so read it
together with the audit.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import CSVLogger
from torch.utils.data import DataLoader, Dataset, TensorDataset

from rank_lightning.callbacks import ActivationRankMonitor, WeightRankMonitor
from rank_lightning.figure_workers import shutdown_figure_workers
from rank_lightning.modules import ImageClassifier

PACKAGE_DIR = str(Path(__file__).resolve().parents[1] / "rank_lightning")


@dataclass
class Case:
    """One model and its monitors; the fits compare ``make_callbacks()`` against no callbacks."""

    name: str
    target: float
    make_module: Callable[[], pl.LightningModule]
    make_loaders: Callable[[], dict[str, DataLoader]]
    make_callbacks: Callable[[], list[pl.Callback]]
    trainer_options: dict[str, Any] = field(default_factory=dict)
    every_n_train_steps: int | None = None


class _Tokens(Dataset):
    """Random token ids with a random amount of right padding (attention mask 0) per sequence."""

    def __init__(self, size: int, length: int, vocab: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (size, length), generator=generator)
        keep = torch.randint(length // 2, length + 1, (size, 1), generator=generator)
        self.mask = (torch.arange(length) < keep).long()

    def __len__(self) -> int:
        return self.ids.shape[0]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "attention_mask": self.mask[index]}


class _CausalLM(pl.LightningModule):
    """A GPT-2-shaped causal language model with random weights, trained on next-token prediction."""

    def __init__(self, layers: int, width: int, heads: int, length: int, vocab: int) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        # Token ids 0 mark begin and end: GPT-2's default 50256 lies outside the small vocabulary.
        ends = {"bos_token_id": 0, "eos_token_id": 0}
        config = GPT2Config(n_layer=layers, n_embd=width, n_head=heads, n_positions=length, vocab_size=vocab, **ends)
        self.model = GPT2LMHeadModel(config)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        return self.model(**batch, labels=labels).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-4)


def resnet_case(quick: bool, audit: bool = False) -> Case:
    # CIFAR-sized epochs: 50,176 training images (98 steps of 512) and 10,240 validation images (20 batches).
    batch, train, val, epochs = (16, 64, 32, 2) if quick else (512, 98 * 512, 20 * 512, 3)
    epochs = 1 if audit else epochs
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(train + val, 3, 32, 32, generator=generator)
    labels = torch.randint(0, 10, (train + val,), generator=generator)

    def loaders() -> dict[str, DataLoader]:
        return {
            "train_dataloaders": DataLoader(TensorDataset(images[:train], labels[:train]), batch_size=batch),
            "val_dataloaders": DataLoader(TensorDataset(images[train:], labels[train:]), batch_size=batch),
        }

    def module() -> pl.LightningModule:
        return ImageClassifier(backbone="resnet18", num_classes=10, input_shape=(3, 32, 32), lr=0.05)

    def callbacks() -> list[pl.Callback]:
        return [ActivationRankMonitor(num_classes=10, verbose=False), WeightRankMonitor(verbose=False)]

    name = f"ResNet-18 CIFAR-shaped, batch {batch}, {train // batch} steps x {epochs} epochs, monitors every epoch"
    return Case(name, 1.05, module, loaders, callbacks, {"max_epochs": epochs})


def gpt2_case(quick: bool, audit: bool = False) -> Case:
    layers, width, heads, length, vocab = (2, 64, 2, 32, 500) if quick else (12, 768, 12, 512, 50257)
    batch, steps, every = (4, 6, 2) if quick else (8, 300, 100)
    # The audited fit closes one window: every warning goes through Python, which slows every step.
    steps = every + max(2, every // 10) if audit else steps
    data = _Tokens(batch * steps, length, vocab)

    def loaders() -> dict[str, DataLoader]:
        return {"train_dataloaders": DataLoader(data, batch_size=batch)}

    def module() -> pl.LightningModule:
        return _CausalLM(layers, width, heads, length, vocab)

    def callbacks() -> list[pl.Callback]:
        return [
            ActivationRankMonitor(every_n_train_steps=every, verbose=False),
            WeightRankMonitor(every_n_train_steps=every, verbose=False),
        ]

    name = f"GPT-2-shaped ({layers} layers, width {width}, sequence {length}), bf16-mixed, {steps} steps, every {every}"
    options = {"max_epochs": 1, "precision": "bf16-mixed", "limit_val_batches": 0}
    return Case(name, 1.02, module, loaders, callbacks, options, every)


class SyncAudit(pl.Callback):
    """Attributes every CUDA synchronisation warning to the phase that raised it (``set_sync_debug_mode("warn")``).

    Must be the first callback: its hooks then run before the monitors' hooks of the same name, so that a batch's
    forward pass (``train`` / ``val``: forward hooks, per-batch work), the end-of-batch hooks (``train_end``: a
    step-cadence window closing) and the end-of-epoch hooks (``val_end``, ``train_epoch_end``) are told apart.
    """

    def __init__(self) -> None:
        self.records: list[tuple[str, int, str, int]] = []  # (phase, batch, filename, lineno)
        self.batches: Counter[str] = Counter()
        self._phase, self._batch = "setup", -1
        self._original = warnings.showwarning

    def _record(self, message: Any, category: type[Warning], filename: str, lineno: int, *args: Any) -> None:
        if "synchroniz" in str(message).lower():
            self.records.append((self._phase, self._batch, filename, lineno))
        else:
            self._original(message, category, filename, lineno, *args)

    def __enter__(self) -> SyncAudit:
        # Python shows a warning once per source line unless told otherwise: every synchronisation must be counted.
        self._filters = warnings.catch_warnings()
        self._filters.__enter__()
        warnings.filterwarnings("always", message=".*synchroniz.*")
        warnings.showwarning = self._record
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc: Any) -> None:
        torch.cuda.set_sync_debug_mode(0)
        self._filters.__exit__(*exc)
        warnings.showwarning = self._original

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._phase, self._batch = "train", trainer.global_step
        self.batches["train"] += 1

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self._phase, self._batch = "train_end", trainer.global_step

    def on_validation_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._phase, self._batch = "val", self.batches["val"]
        self.batches["val"] += 1

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._phase = "val_end"

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._phase = "train_epoch_end"

    def summary(self, every: int | None) -> dict[str, Any]:
        """Synchronisations per phase, split into rank_lightning frames and others; for a step cadence, the ends of
        the training batches that close a window (``global_step`` a multiple of ``every``) apart."""
        out: dict[str, Any] = {"batches": dict(self.batches)}
        for phase, step, filename, _ in self.records:
            where = "rank_lightning" if filename.startswith(PACKAGE_DIR) else "other"
            if phase == "train_end" and every is not None:
                phase = "train_end_window_close" if step % every == 0 else "train_end_other"
            out.setdefault(phase, Counter())[where] += 1
        return {key: dict(value) if isinstance(value, Counter) else value for key, value in out.items()}

    def package_lines(self) -> Counter[str]:
        return Counter(
            f"{Path(filename).relative_to(Path(PACKAGE_DIR).parent)}:{lineno} ({phase})"
            for phase, _, filename, lineno in self.records
            if filename.startswith(PACKAGE_DIR)
        )


class _FitEndClock:
    """Wall time spent in the monitors' ``on_fit_end`` (the PNG figures drawn at the end of fit)."""

    def __init__(self, callbacks: list[pl.Callback]) -> None:
        self.seconds = 0.0
        for callback in callbacks:
            hook = callback.on_fit_end

            def timed(*args: Any, hook: Callable[..., None] = hook) -> None:
                start = time.perf_counter()
                hook(*args)
                self.seconds += time.perf_counter() - start

            callback.on_fit_end = timed  # type: ignore[method-assign]


def fit(case: Case, monitored: bool, device: str, audit: SyncAudit | None = None) -> dict[str, float]:
    """One fit: wall seconds, seconds in the monitors' ``on_fit_end`` and peak GPU memory (MiB; 0 on a CPU).

    Each fit starts without figure worker processes (``rank_lightning.figure_workers``), as a fresh process would: a
    monitored fit starts them and they draw beside it at the end.
    """
    shutdown_figure_workers()
    torch.manual_seed(0)
    module = case.make_module()
    callbacks = case.make_callbacks() if monitored else []
    clock = _FitEndClock(callbacks)
    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    with tempfile.TemporaryDirectory() as directory:
        trainer = pl.Trainer(
            logger=CSVLogger(directory),
            callbacks=[*([audit] if audit else []), *callbacks],
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            num_sanity_val_steps=0,
            accelerator="gpu" if cuda else "cpu",
            devices=1,
            **case.trainer_options,
        )
        start = time.perf_counter()
        trainer.fit(module, **case.make_loaders())
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else 0.0
    return {"seconds": seconds, "fit_end_s": clock.seconds, "peak_mib": peak}


def overhead(case: Case, device: str, repeats: int) -> dict[str, Any]:
    """Alternating plain and monitored fits after one untimed warm-up; medians and their ratio."""
    fit(case, False, device)
    runs: dict[str, list[dict[str, float]]] = {"plain": [], "monitored": []}
    for repeat in range(repeats):
        order = (False, True) if repeat % 2 == 0 else (True, False)
        for monitored in order:
            runs["monitored" if monitored else "plain"].append(fit(case, monitored, device))
    plain = statistics.median(r["seconds"] for r in runs["plain"])
    monitored = statistics.median(r["seconds"] for r in runs["monitored"])
    fit_end = statistics.median(r["fit_end_s"] for r in runs["monitored"])
    peak_plain = max(r["peak_mib"] for r in runs["plain"])
    peak_monitored = max(r["peak_mib"] for r in runs["monitored"])
    result = {
        "case": case.name,
        "target": case.target,
        "plain_s": plain,
        "monitored_s": monitored,
        "ratio": monitored / plain,
        "meets_target": monitored / plain <= case.target,
        "fit_end_s": fit_end,
        "ratio_without_fit_end": (monitored - fit_end) / plain,
        "peak_mib_plain": peak_plain,
        "peak_mib_monitored": peak_monitored,
        "peak_mib_added": peak_monitored - peak_plain,
        "runs": runs,
    }
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}), flush=True)
    return result


def sync_audit(case: Case, device: str) -> dict[str, Any]:
    """Synchronisations of one plain and one monitored (shortened) fit (CUDA only)."""
    out: dict[str, Any] = {"case": case.name}
    for monitored in (False, True):
        with SyncAudit() as audit:
            fit(case, monitored, device, audit)
        key = "monitored" if monitored else "plain"
        out[key] = audit.summary(case.every_n_train_steps)
        if monitored:
            out["package_lines"] = dict(audit.package_lines().most_common())
    print(json.dumps({k: v for k, v in out.items() if k != "package_lines"}), flush=True)
    return out


def profile(case: Case, device: str, out: Path, tag: str) -> None:
    """One monitored fit under cProfile; its top entries go to ``out / f"profile_{tag}.txt"``."""
    profiler = cProfile.Profile()
    profiler.enable()
    fit(case, True, device)
    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text).sort_stats("cumulative")
    stats.print_stats("rank_lightning", 60)
    stats.sort_stats("tottime").print_stats(40)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"profile_{tag}.txt").write_text(text.getvalue())


def _markdown(report: dict[str, Any]) -> str:
    lines = [
        f"# Monitoring on {report['device']} (torch {report['torch']}, Lightning {report['lightning']})",
        "",
        "| case | plain s | monitored s | ratio | target | figures s | ratio w/o figures | peak MiB plain "
        "| peak MiB monitored | added MiB |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in report["overhead"]:
        lines.append(
            f"| {r['case']} | {r['plain_s']:.2f} | {r['monitored_s']:.2f} | {r['ratio']:.3f}x | "
            f"<= {r['target']}x {'met' if r['meets_target'] else 'MISSED'} | {r['fit_end_s']:.2f} | "
            f"{r['ratio_without_fit_end']:.3f}x | {r['peak_mib_plain']:.0f} | "
            f"{r['peak_mib_monitored']:.0f} | {r['peak_mib_added']:.0f} |"
        )
    for audit in report["sync"]:
        lines += ["", f"Host synchronisations, {audit['case']} (by phase: rank_lightning frames / other frames):"]
        for key in ("plain", "monitored"):
            lines.append(f"- {key}: {json.dumps(audit[key])}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    parser.add_argument("--quick", action="store_true", help="tiny sizes (checks the script on a CPU)")
    parser.add_argument("--repeats", type=int, default=None, help="timed fits of each kind (default 3, --quick 1)")
    parser.add_argument("--parts", nargs="+", default=["resnet18", "gpt2"], choices=("resnet18", "gpt2"))
    parser.add_argument("--out", type=Path, default=Path("."), help="directory of the result files")
    parser.add_argument("--profile", action="store_true", help="also profile one monitored fit of each case")
    parser.add_argument("--no-audit", action="store_true", help="skip the synchronisation audit")
    args = parser.parse_args(argv)
    if args.device == "cuda":
        torch.backends.cudnn.benchmark = True
    repeats = args.repeats or (1 if args.quick else 3)
    cases = {"resnet18": resnet_case, "gpt2": gpt2_case}
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "lightning": pl.__version__,
        "quick": args.quick,
        "repeats": repeats,
        "overhead": [],
        "sync": [],
    }
    package_lines: dict[str, dict[str, int]] = {}
    for part in args.parts:
        report["overhead"].append(overhead(cases[part](args.quick), args.device, repeats))
        _write(args.out, report, package_lines)
    if args.profile:
        for part in args.parts:
            profile(cases[part](args.quick), args.device, args.out, part)
    if args.device == "cuda" and not args.no_audit:
        for part in args.parts:
            audit = sync_audit(cases[part](args.quick, audit=True), args.device)
            package_lines[audit["case"]] = audit.pop("package_lines")
            report["sync"].append(audit)
            _write(args.out, report, package_lines)
    print(_markdown(report))
    return report


def _write(out: Path, report: dict[str, Any], package_lines: dict[str, dict[str, int]]) -> None:
    """(Re)write the result files, after every part, so that a run cut short keeps what it measured."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_gpu.json").write_text(json.dumps(report, indent=1))
    (out / "bench_gpu.md").write_text(_markdown(report))
    with (out / "sync_audit.txt").open("w") as file:
        for name, lines in package_lines.items():
            file.write(f"{name}: synchronisations raised inside rank_lightning, by source line\n")
            file.writelines(f"  {count:5d}  {line}\n" for line, count in lines.items())


if __name__ == "__main__":
    main()
