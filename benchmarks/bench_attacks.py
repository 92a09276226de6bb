"""Attack throughput of rank_lightning.attacks against torchattacks on the same model and batch.

Both libraries attack a CIFAR-shaped batch (32x32x3, normalised with the CIFAR-10 statistics) of random
pixels; FGSM and BIM / Iter-FGSM (eps = 8/255, alpha = 1/255, Kurakin's 10 steps) are timed alternately, and
the median throughput in images/s is printed with the ratio ours / torchattacks (target: at least 1/1.2), and
the same ratio of CPU times, which other processes on the machine disturb less.

Run::

    python benchmarks/bench_attacks.py                       # ResNet-18, 5 timed repeats per attack and library
    python benchmarks/bench_attacks.py --model small_cnn     # a small CNN, where per-call overhead shows more
    python benchmarks/bench_attacks.py --quick               # small CNN, 1 timed repeat: a smoke run
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torchattacks
from torch import nn

from rank_lightning.attacks import fgsm, iterative_fgsm, kurakin_steps
from rank_lightning.models import create_model

CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)


def small_cnn(num_classes: int = 10) -> nn.Module:
    """A VGG-like network with BatchNorm for 32x32x3 inputs, used when no ResNet-18 is registered."""

    def stage(c_in: int, c_out: int) -> list[nn.Module]:
        return [nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(), nn.MaxPool2d(2)]

    return nn.Sequential(
        *stage(3, 32), *stage(32, 64), *stage(64, 128), nn.Flatten(), nn.Linear(128 * 4 * 4, num_classes)
    )


def build_model(name: str, num_classes: int) -> tuple[nn.Module, str]:
    if name == "small_cnn":
        return small_cnn(num_classes), "small CNN (3 conv-BN-ReLU-pool stages)"
    return create_model(name, num_classes=num_classes), f"rank_lightning.models {name}"


def seconds(fn: Callable[[], torch.Tensor]) -> tuple[float, float]:
    """Wall-clock and process CPU time of one call; CPU time is the steadier of the two on a shared machine."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="one timed repeat, on the small CNN unless --model is given"
    )
    parser.add_argument("--model", default=None, help="small_cnn or a registered model name (default: resnet18)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--eps", type=float, default=8 / 255)
    parser.add_argument("--alpha", type=float, default=1 / 255)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    repeats = 1 if args.quick else args.repeats
    model_choice = args.model or ("small_cnn" if args.quick else "resnet18")

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model, model_name = build_model(model_choice, num_classes=10)
    model.eval()
    mean = torch.tensor(CIFAR10_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(CIFAR10_STD).view(1, 3, 1, 1)
    inputs = (torch.rand(args.batch_size, 3, 32, 32) - mean) / std
    targets = torch.randint(0, 10, (args.batch_size,))
    steps = kurakin_steps(args.eps)

    reference_fgsm = torchattacks.FGSM(model, eps=args.eps)
    reference_bim = torchattacks.BIM(model, eps=args.eps, alpha=args.alpha, steps=steps)
    for reference in (reference_fgsm, reference_bim):
        reference.set_normalization_used(CIFAR10_MEAN, CIFAR10_STD)

    cases = {
        "FGSM": (
            lambda: fgsm(model, inputs, targets, args.eps, mean=CIFAR10_MEAN, std=CIFAR10_STD),
            lambda: reference_fgsm(inputs, targets),
        ),
        f"BIM ({steps} steps)": (
            lambda: iterative_fgsm(
                model, inputs, targets, args.eps, alpha=args.alpha, steps=steps, mean=CIFAR10_MEAN, std=CIFAR10_STD
            ),
            lambda: reference_bim(inputs, targets),
        ),
    }

    print(f"model: {model_name}; batch {args.batch_size} x 3 x 32 x 32; eps = {args.eps * 255:g}/255; ", end="")
    print(f"alpha = {args.alpha * 255:g}/255; torch threads: {torch.get_num_threads()}; timed repeats: {repeats}")
    print(
        f"{'attack':<16}{'ours (img/s)':>14}{'torchattacks (img/s)':>22}{'ratio':>8}{'CPU-time ratio':>16}"
        f"{'max |diff|':>12}"
    )
    for name, (ours, theirs) in cases.items():
        difference = (ours() - theirs()).abs().max().item()  # also the warm-up run of both
        # Alternating the two spreads any drift in machine load evenly over both.
        ours_s, theirs_s = [], []
        for _ in range(repeats):
            ours_s.append(seconds(ours))
            theirs_s.append(seconds(theirs))
        ours_rate = args.batch_size / statistics.median(wall for wall, _ in ours_s)
        theirs_rate = args.batch_size / statistics.median(wall for wall, _ in theirs_s)
        cpu_ratio = statistics.median(cpu for _, cpu in theirs_s) / statistics.median(cpu for _, cpu in ours_s)
        print(
            f"{name:<16}{ours_rate:>14.1f}{theirs_rate:>22.1f}{ours_rate / theirs_rate:>8.2f}{cpu_ratio:>16.2f}"
            f"{difference:>12.2e}"
        )


if __name__ == "__main__":
    main()
