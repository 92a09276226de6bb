"""Command line of the reproductions.

Usage::

    python -m rank_lightning.reproduce --list
    python -m rank_lightning.reproduce daneshmand_fig2 feng_fig1 --out reproductions
    python -m rank_lightning.reproduce all --quick --device cuda

Each run writes into ``--out`` (default ``reproductions``), or into a new ``run_<n>`` folder inside it when it already
holds files: one folder per experiment with its figure(s) and CSV files, and ``summary.csv`` / ``summary.md`` with
one row per claim. A progress bar is drawn on a terminal (``--quiet`` turns it off). ``--quick`` runs mark every
printed verdict and the summary as coming from smoke-test sizes, which cannot confirm the papers' claims.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch

from rank_lightning.analysis.output import fresh_directory, print_written, show_progress
from rank_lightning.reproduce.core import EXPERIMENTS, QUICK_NOTE, check_device, marked_verdict, run_experiments
from rank_lightning.reproduce.training import check_data_dir

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m rank_lightning.reproduce",
        description="Reproduce the figures and tables of the four rank papers; each experiment says whether the "
        "paper's claim holds here.",
    )
    parser.add_argument("names", nargs="*", help="experiments to run ('all' for every one; see --list)")
    parser.add_argument("--list", action="store_true", help="list the experiments and exit")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke-test sizes (well under a minute each); their verdicts cannot confirm the claims",
    )
    parser.add_argument("--device", default="cpu", help="torch device: cpu, cuda, cuda:1, mps (default cpu)")
    parser.add_argument("--out", default="reproductions", help="output folder (never overwritten)")
    parser.add_argument("--seed", type=int, default=0, help="base seed (default 0)")
    parser.add_argument(
        "--data-dir",
        default=None,
        help="folder holding torchvision's FashionMNIST/raw files, used by every experiment that trains a classifier "
        "(default: the bundled digits)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default 1: the networks are small, more threads only add waiting)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the named experiments and print the summary table; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.list:
        width = max(len(name) for name in EXPERIMENTS)
        for name, item in EXPERIMENTS.items():
            print(f"{name:<{width}}  {item.paper}: {item.title}")
        return 0
    if not args.names:
        parser.error("name at least one experiment, or 'all' (see --list)")
    if "all" in args.names and args.names != ["all"]:
        parser.error(f"'all' runs every experiment and takes no other name; got {' '.join(args.names)}")
    names = list(EXPERIMENTS) if args.names == ["all"] else args.names
    unknown = [name for name in names if name not in EXPERIMENTS]
    if unknown:
        parser.error(f"unknown experiment(s) {', '.join(unknown)}; experiments are: all, {', '.join(EXPERIMENTS)}")
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        parser.error(f"experiment(s) named more than once: {', '.join(repeated)}")
    if args.threads < 1:
        parser.error(f"--threads must be positive, got {args.threads}")
    torch.set_num_threads(args.threads)
    try:
        device = check_device(args.device)
    except ValueError as error:
        parser.error(f"invalid --device: {error}")
    try:
        data_dir = check_data_dir(args.data_dir)
        fresh_directory(args.out)
    except (FileNotFoundError, NotADirectoryError) as error:
        parser.error(f"{'--data-dir' if isinstance(error, FileNotFoundError) else '--out'}: {error}")
    directory, results = run_experiments(
        names,
        args.out,
        quick=args.quick,
        device=device,
        seed=args.seed,
        data_dir=data_dir,
        show=show_progress(args.quiet),
    )
    if args.quick:
        print(f"{QUICK_NOTE[0].upper()}{QUICK_NOTE[1:]}.")
    for result in results:
        print(f"{result.name} ({result.seconds:.0f} s, {result.cpu_seconds:.0f} s CPU)")
        for claim in result.claims:
            shown = marked_verdict(claim.verdict, args.quick)
            print(f"  [{shown}] {claim.claim}\n      paper: {claim.paper}\n      ours:  {claim.ours}")
    print_written(
        directory,
        {
            "figures": [p for r in results for p in r.files if p.suffix == ".png"],
            "tables": [p for r in results for p in r.files if p.suffix == ".csv"],
            "summary": [directory / "summary.csv", directory / "summary.md"],
        },
        requested=args.out,
    )
    return 0
