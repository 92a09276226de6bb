"""Daneshmand et al., *Batch Normalization Provably Avoids Rank Collapse* (NeurIPS 2020): Fig. 2 with Theorem 2,
Fig. 1, and Fig. 6 with the rank-increasing pre-training of Sec. 4 and App. G.

Conventions. ``H`` is the ``N x d`` matrix of one hidden layer's outputs (samples x features; the paper's ``d x N``
transposed). ``r(H) = Tr(M)^2 / ||M||_F^2`` with ``M = H^T H / N`` (their eq. 4,
:func:`~rank_lightning.functional.participation_ratio`, uncentred as in the paper) and ``rank_0.5`` (their eq. 3,
:func:`~rank_lightning.functional.soft_rank`) counts the eigenvalues of ``M`` at least 0.5. BatchNorm makes
``Tr(M) = d``; a vanilla network's features are rescaled to ``Tr(M) = d`` before ``rank_0.5`` is taken, so that the
threshold means the same ("half the average variance") for both. The numerical rank is
:func:`~rank_lightning.functional.numerical_rank` (tolerance ``finfo(float32).eps * min(N, d) * s_1``, the
``torch.matrix_rank`` rule of their Fig. 1 footnote).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence

import torch
from matplotlib.figure import Figure
from torch import Tensor, nn

from rank_lightning.functional.spectral import numerical_rank, participation_ratio, soft_rank
from rank_lightning.layers import buffers_kept, train_mode
from rank_lightning.models import create_model
from rank_lightning.reproduce.core import Claim, Context, experiment, verdict
from rank_lightning.reproduce.training import Dataset, accuracy, load_classification, train_epochs

__all__ = [
    "daneshmand_fig1",
    "daneshmand_fig2",
    "daneshmand_fig6",
    "last_layer_pretraining",
    "layerwise_pretraining",
    "rescale_layerwise",
]

_BLUE, _ORANGE, _GREEN, _RED, _PURPLE, _BROWN, _GREY = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#555555",
)


def _ci95(values: Sequence[float]) -> float:
    """Half-width of the normal 95% confidence interval of the mean (0 for a single value)."""
    n = len(values)
    if n < 2:
        return 0.0
    mean = sum(values) / n
    return 1.96 * math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def soft_rank_scaled(h: Tensor, tau: float = 0.5) -> int:
    """``rank_tau`` of ``h`` rescaled so that ``Tr(H^T H / N) = d`` (module docstring)."""
    h64 = h.detach().to(torch.float64)
    scale = h64.square().sum(dim=1).mean() / h64.shape[1]
    if not torch.isfinite(scale) or scale == 0:
        return 0
    return int(soft_rank(h64 / scale.sqrt(), tau=tau))


# -- Fig. 2 and Theorem 2 ---------------------------------------------------------------------------------------------


@experiment(
    "daneshmand_fig2",
    paper="Daneshmand et al. 2020",
    title="Fig. 2 / Theorem 2: rank of the last hidden layer vs depth at random init, vanilla vs BN",
)
def daneshmand_fig2(context: Context) -> list[Claim]:
    """Gaussian inputs ``N = d = 32``, bias-free MLPs of width 32 (linear and ReLU), vanilla vs BatchNorm (batch
    statistics), PyTorch's default initialisation; ``r(H_L)``, ``rank_0.5`` and the numerical rank of layer ``L``
    for ``L`` in the depth grid, over independent networks (paper: 10 runs, mean and 95% interval)."""
    width = 32
    depths = [1, 2, 4, 8, 16, 32, 64]
    seeds = context.size(10, 3)
    rows: list[dict[str, object]] = []
    context.total(2 * 2 * seeds)
    for activation in ("identity", "relu"):
        for batch_norm in (False, True):
            for seed in range(seeds):
                torch.manual_seed(context.seed + seed)
                model = create_model(
                    "mlp",
                    input_shape=(width,),
                    num_classes=0,
                    depth=max(depths),
                    width=width,
                    activation=activation,
                    batch_norm=batch_norm,
                    bias=False,
                ).to(context.device)
                h = torch.randn(width, width, device=context.device)  # (N, d) Gaussian inputs
                model.train()
                with torch.no_grad():
                    for depth, block in enumerate(model.layers, start=1):
                        h = block(h)
                        if depth in depths:
                            rows.append(
                                {
                                    "activation": "linear" if activation == "identity" else activation,
                                    "network": "BN" if batch_norm else "vanilla",
                                    "seed": seed,
                                    "depth": depth,
                                    "r_H": float(participation_ratio(h)),
                                    "rank_0.5": soft_rank_scaled(h),
                                    "numerical_rank": int(numerical_rank(h)),
                                }
                            )
                context.advance()
    context.write_csv("rank_vs_depth", rows)
    summary = _summarise(rows, ("activation", "network", "depth"), ("r_H", "rank_0.5", "numerical_rank"))
    context.write_csv("rank_vs_depth_mean_ci95", summary)
    context.save(_fig2(summary, depths, width), "daneshmand_fig2")

    def at(activation: str, network: str, metric: str, depth: int = max(depths)) -> float:
        return next(
            float(r[f"{metric}_mean"])
            for r in summary
            if (r["activation"], r["network"], r["depth"]) == (activation, network, depth)
        )

    bound = math.sqrt(width)
    bn = {a: at(a, "BN", "r_H") for a in ("linear", "relu")}
    vanilla = {a: at(a, "vanilla", "r_H") for a in ("linear", "relu")}
    bn_avg = {
        a: _mean([float(r["rank_0.5_mean"]) for r in summary if (r["activation"], r["network"]) == (a, "BN")])
        for a in ("linear", "relu")
    }
    # Fig. 2 plots the rank itself (rank_0.5 here) and states it stays above sqrt(d); r(H), a lower bound of the
    # rank, backs Theorem 2's Omega(sqrt(d)) with the constant 1/2.
    bn_rank = {a: at(a, "BN", "rank_0.5") for a in ("linear", "relu")}
    rank_holds = all(v >= bound for v in bn_rank.values())
    bound_holds = all(v >= 0.5 * bound for v in bn.values())
    vanilla_holds = all(v <= 1.5 for v in vanilla.values())
    return [
        Claim(
            "daneshmand_fig2",
            f"BN keeps the rank of H_L of order sqrt(d) at any depth (d = {width}, L = {max(depths)})",
            f"BN rank stays above sqrt(d) = {bound:.2f} (Fig. 2); Theorem 2: Omega(sqrt(d))",
            f"BN rank_0.5 at L = {max(depths)}: linear {bn_rank['linear']:.1f}, ReLU {bn_rank['relu']:.1f}; "
            f"r(H_{max(depths)}): linear {bn['linear']:.2f}, ReLU {bn['relu']:.2f}; mean rank_0.5 over depths: "
            f"linear {bn_avg['linear']:.1f}, ReLU {bn_avg['relu']:.1f}",
            verdict(rank_holds and bound_holds, partly=rank_holds or bound_holds),
            "asserted: the rank rank_0.5 at the deepest layer >= sqrt(d) (the figure's statement) and its lower bound "
            "r(H) >= sqrt(d) / 2 (Theorem 2's Omega(sqrt(d))), for both activations",
            value=min(bn_rank.values()),
        ),
        Claim(
            "daneshmand_fig2",
            "vanilla networks collapse towards rank 1 with depth",
            "r(H_L) -> 1 (Fig. 2, Lemma 3)",
            f"vanilla r(H_64): linear {vanilla['linear']:.3f}, ReLU {vanilla['relu']:.3f}",
            verdict(vanilla_holds),
            "asserted: r(H_64) <= 1.5 for both activations",
            value=max(vanilla.values()),
        ),
    ]


def _summarise(
    rows: Sequence[dict[str, object]], keys: Sequence[str], metrics: Sequence[str]
) -> list[dict[str, object]]:
    """Mean and 95% interval of ``metrics`` over the rows sharing ``keys`` (in first-seen order)."""
    groups: dict[tuple[object, ...], list[dict[str, object]]] = {}
    for row in rows:
        groups.setdefault(tuple(row[k] for k in keys), []).append(row)
    summary = []
    for key, members in groups.items():
        entry: dict[str, object] = dict(zip(keys, key))
        entry["runs"] = len(members)
        for metric in metrics:
            values = [float(m[metric]) for m in members if math.isfinite(float(m[metric]))]
            entry[f"{metric}_mean"] = _mean(values) if values else math.nan
            entry[f"{metric}_ci95"] = _ci95(values) if values else math.nan
        summary.append(entry)
    return summary


def _fig2(summary: Sequence[dict[str, object]], depths: Sequence[int], width: int) -> Figure:
    figure = Figure(figsize=(8.5, 3.4), layout="constrained")
    axes = figure.subplots(1, 2, sharey=True)
    for ax, activation in zip(axes, ("linear", "relu")):
        for network, color in (("BN", _BLUE), ("vanilla", _ORANGE)):
            for metric, style, name in (("r_H", "-", "r(H)"), ("rank_0.5", "--", "rank$_{0.5}$")):
                rows = [r for r in summary if (r["activation"], r["network"]) == (activation, network)]
                xs = [int(r["depth"]) for r in rows]
                mean = [float(r[f"{metric}_mean"]) for r in rows]
                ci = [float(r[f"{metric}_ci95"]) for r in rows]
                ax.plot(xs, mean, style, marker="o", ms=3, color=color, label=f"{network} {name}")
                ax.fill_between(
                    xs, [m - c for m, c in zip(mean, ci)], [m + c for m, c in zip(mean, ci)], color=color, alpha=0.15
                )
        ax.axhline(math.sqrt(width), color="k", linestyle=":", label=r"$\sqrt{d}$ (Theorem 2)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(list(depths), [str(d) for d in depths])
        ax.set_xlabel("number of layers L")
        ax.set_title(f"{'Linear' if activation == 'linear' else 'ReLU'} activations")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("rank of the last hidden layer")
    axes[1].legend(fontsize=7, loc="lower left")
    figure.suptitle(f"Gaussian inputs, width d = N = {width}: BN vs vanilla (mean, 95% CI)", fontsize=10)
    return figure


# -- Fig. 1 -----------------------------------------------------------------------------------------------------------


@experiment(
    "daneshmand_fig1",
    paper="Daneshmand et al. 2020",
    title="Fig. 1: rank at init and training accuracy vs depth (ReLU MLPs, width 128)",
)
def daneshmand_fig1(context: Context) -> list[Claim]:
    """ReLU MLPs of width 128, depth 1-32, vanilla vs BN, PyTorch's initialisation; numerical rank of the last
    hidden layer at initialisation (training inputs) and training accuracy after SGD (batch 128) with the learning
    rate grid-searched per depth and network (best mean final accuracy over seeds); mean and 95% interval."""
    data = load_classification(context.data_dir, max_train=context.size(None, 256)).to(context.device)
    depths = context.size([1, 2, 4, 8, 16, 32], [1, 8])
    seeds = context.size(3, 1)
    epochs = context.size(30, 2)
    lrs = context.size([0.003, 0.03, 0.3], [0.1])
    rank_samples = data.x_train[:512]
    rows: list[dict[str, object]] = []
    context.total(len(depths) * 2 * seeds * len(lrs))
    for depth in depths:
        for batch_norm in (False, True):
            for seed in range(seeds):
                torch.manual_seed(context.seed + seed)
                initial = _mlp(data, depth, batch_norm).to(context.device)
                with torch.no_grad(), train_mode(initial), buffers_kept(initial):
                    rank = int(numerical_rank(initial.forward_features(rank_samples)))
                for lr in lrs:
                    model = copy.deepcopy(initial)
                    train_epochs(model, data.x_train, data.y_train, epochs=epochs, lr=lr, seed=context.seed + seed)
                    rows.append(
                        {
                            "network": "BN" if batch_norm else "vanilla",
                            "depth": depth,
                            "seed": seed,
                            "lr": lr,
                            "rank_at_init": rank,
                            "train_accuracy": accuracy(model, data.x_train, data.y_train),
                        }
                    )
                    context.advance()
    context.write_csv("runs", rows)
    best = _best_lr(rows, ("network", "depth"), "train_accuracy")
    summary = _summarise(best, ("network", "depth"), ("rank_at_init", "train_accuracy"))
    for entry in summary:
        entry["best_lr"] = next(
            r["lr"] for r in best if (r["network"], r["depth"]) == (entry["network"], entry["depth"])
        )
    context.write_csv("rank_and_accuracy_vs_depth", summary)
    context.save(_fig1(summary, depths, data.name, epochs), "daneshmand_fig1")

    def at(network: str, metric: str) -> float:
        return next(float(r[f"{metric}_mean"]) for r in summary if (r["network"], r["depth"]) == (network, max(depths)))

    deep = max(depths)
    collapsed = at("vanilla", "rank_at_init") <= 2 and at("vanilla", "train_accuracy") <= 0.3
    bn_ok = at("BN", "train_accuracy") >= 0.8
    return [
        Claim(
            "daneshmand_fig1",
            f"deep vanilla ReLU MLPs have rank ~1 at init and do not train; BN ones do ({data.name}, depth {deep})",
            "vanilla: rank collapses and training fails beyond ~10 layers; BN: high rank, trains (Fashion-MNIST)",
            f"depth {deep}: vanilla rank {at('vanilla', 'rank_at_init'):.1f}, train acc "
            f"{at('vanilla', 'train_accuracy'):.2f}; BN rank {at('BN', 'rank_at_init'):.1f}, train acc "
            f"{at('BN', 'train_accuracy'):.2f}",
            verdict(collapsed and bn_ok, partly=collapsed or bn_ok),
            f"{data.name}, {epochs} epochs (paper: 75), {seeds} seeds (paper: 5), lr grid {lrs}",
            value=at("vanilla", "train_accuracy"),
        )
    ]


def _mlp(data: Dataset, depth: int, batch_norm: bool, width: int = 128, init: str | None = None) -> nn.Module:
    return create_model(
        "mlp", input_shape=(data.num_features,), depth=depth, width=width, batch_norm=batch_norm, init=init
    )


def _best_lr(rows: Sequence[dict[str, object]], keys: Sequence[str], metric: str) -> list[dict[str, object]]:
    """The rows of the learning rate with the best mean ``metric`` over seeds, per group of ``keys``."""
    by_lr: dict[tuple[object, ...], dict[float, list[dict[str, object]]]] = {}
    for row in rows:
        by_lr.setdefault(tuple(row[k] for k in keys), {}).setdefault(float(row["lr"]), []).append(row)
    chosen: list[dict[str, object]] = []
    for groups in by_lr.values():
        lr = max(groups, key=lambda value: _mean([float(r[metric]) for r in groups[value]]))
        chosen += groups[lr]
    return chosen


def _fig1(summary: Sequence[dict[str, object]], depths: Sequence[int], data_name: str, epochs: int) -> Figure:
    figure = Figure(figsize=(8.5, 3.3), layout="constrained")
    left, right = figure.subplots(1, 2)
    for network, color in (("BN", _BLUE), ("vanilla", _ORANGE)):
        rows = [r for r in summary if r["network"] == network]
        xs = [int(r["depth"]) for r in rows]
        for ax, metric in ((left, "rank_at_init"), (right, "train_accuracy")):
            mean = [float(r[f"{metric}_mean"]) for r in rows]
            ci = [float(r[f"{metric}_ci95"]) for r in rows]
            ax.errorbar(xs, mean, yerr=ci, marker="o", ms=4, capsize=3, color=color, label=network)
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(depths), [str(d) for d in depths])
        ax.set_xlabel("number of hidden layers")
        ax.grid(alpha=0.3)
    left.set_ylabel("rank of last hidden layer at init")
    left.set_title("Rank after random initialisation")
    right.set_ylabel("training accuracy")
    right.set_title(f"Training accuracy after {epochs} epochs (best lr)")
    right.set_ylim(0, 1.02)
    right.legend()
    figure.suptitle(f"ReLU MLPs of width 128 on {data_name} (mean, 95% CI)", fontsize=10)
    return figure


# -- Fig. 6 and Sec. 4: rank-increasing pre-training ------------------------------------------------------------------


def _ascend(parameters: Sequence[Tensor], objective: Callable[[], Tensor], steps: int, step_size: float) -> None:
    """``steps`` ascent steps on ``objective``; each moves the parameters by ``step_size`` times their norm, along the
    gradient divided by its norm (see :func:`last_layer_pretraining`). Stops early when the gradient vanishes."""
    for _ in range(steps):
        value = objective()
        if not value.requires_grad:
            return
        grads = torch.autograd.grad(value, parameters, allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g for p, g in zip(parameters, grads)]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        size = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.detach()) for p in parameters]))
        if not torch.isfinite(norm) or norm == 0:
            return
        with torch.no_grad():
            for p, g in zip(parameters, grads):
                p.add_(g, alpha=float(step_size * size / norm))


def last_layer_pretraining(model: nn.Module, batches: Sequence[Tensor], steps: int, step_size: float) -> None:
    """Daneshmand et al. App. G, Alg. 1: for each minibatch ``X_k``, gradient-ascent steps on ``r(H_L(X_k))`` (last
    hidden layer) with respect to all parameters; ``steps`` in total, spread evenly over ``batches``.

    The step is normalised (``step_size`` times the parameters' norm along the unit gradient, without momentum): the
    gradient of ``r(H)`` spans many orders of magnitude through a deep network, so that no fixed plain step size
    suits every step. The package's :class:`~rank_lightning.callbacks.RankPretraining` also follows the unit
    gradient by default, but with a step of fixed length ``lr`` (not relative to the parameters' norm) and SGD
    momentum 0.9, so its ``lr`` is not this ``step_size``.
    """
    parameters = [p for p in model.parameters() if p.requires_grad]
    per_batch = [steps // len(batches) + (i < steps % len(batches)) for i in range(len(batches))]
    with train_mode(model):
        for batch, count in zip(batches, per_batch):
            _ascend(
                parameters, lambda batch=batch: participation_ratio(model.forward_features(batch)), count, step_size
            )


def layerwise_pretraining(
    model: nn.Module, batch: Tensor, steps: int, step_size: float, *, rescale: bool = False
) -> None:
    """Layer-wise rank-increasing pre-training (Daneshmand et al. Sec. 4 and Fig. 6: "``r(H_l)`` in each layer
    ``l``"): for ``l = 1 .. L`` in turn, ``steps`` ascent steps on ``r(H_l)`` with respect to layer ``l``'s
    parameters, its input ``H_{l-1}`` fixed.

    With ``rescale`` each layer's weight and bias are then divided by the root mean square of its output, so that
    ``H_l`` has unit second moment (``r(H_l)`` is scale-invariant and does not change): the repair of the signal scale
    that the default initialisation loses (:func:`daneshmand_fig6`).
    """
    h = batch
    with train_mode(model):
        for block in model.layers:
            _ascend(list(block.parameters()), lambda block=block, h=h: participation_ratio(block(h)), steps, step_size)
            if rescale:
                _rescale(block, h)
            with torch.no_grad():
                h = block(h)


def rescale_layerwise(model: nn.Module, batch: Tensor) -> None:
    """Divide each layer's weight and bias by the root mean square of its output on ``batch``, layer by layer, so that
    every hidden layer's output has unit second moment (ranks unchanged up to rounding)."""
    h = batch
    with train_mode(model):
        for block in model.layers:
            _rescale(block, h)
            with torch.no_grad():
                h = block(h)


@torch.no_grad()
def _rescale(block: nn.Module, h: Tensor) -> None:
    rms = block(h).square().mean().sqrt()
    if torch.isfinite(rms) and rms > 0:
        block.linear.weight.div_(rms)
        if block.linear.bias is not None:
            block.linear.bias.div_(rms)


@torch.no_grad()
def _diagnose(model: nn.Module, batch: Tensor) -> dict[str, float]:
    """Why a network can or cannot train: r(H_L), the spread of H_L across samples relative to its size (0 for an
    all-zero H_L, which does not vary either), its root mean square, and the norm of the gradient of r(H_L) with
    respect to all parameters."""
    with train_mode(model), buffers_kept(model):
        h = model.forward_features(batch).double()
        with torch.enable_grad():
            r = participation_ratio(model.forward_features(batch))
            grads = torch.autograd.grad(r, list(model.parameters()), allow_unused=True) if r.requires_grad else []
    grad_norm = math.sqrt(sum(float(g.square().sum()) for g in grads if g is not None))
    spread = float((h - h.mean(dim=0)).norm() / h.norm()) if float(h.norm()) > 0 else 0.0
    return {
        "r_H_L": float(participation_ratio(h)),
        "relative_spread_H_L": spread,
        "rms_H_L": float(h.square().mean().sqrt()),
        "grad_norm_r_H_L": grad_norm,
    }


_VARIANTS = (
    # name, pre-training, iterations, init, batch_norm, colour, line style
    ("vanilla", None, 0, None, False, _BLUE, "-"),
    ("Alg. 1 (last layer), 25 it.", "last", 25, None, False, _ORANGE, ":"),
    ("Alg. 1 (last layer), 75 it.", "last", 75, None, False, _GREEN, ":"),
    ("layer-wise, 25 it.", "layerwise", 25, None, False, _ORANGE, "-"),
    ("layer-wise, 75 it.", "layerwise", 75, None, False, _GREEN, "-"),
    ("layer-wise, 75 it. + rescaling", "layerwise_rescaled", 75, None, False, _RED, "-"),
    ("rescaling only", "rescaled", 0, None, False, _GREY, "-."),
    ("BN", None, 0, None, True, _PURPLE, "--"),
    ("BN, asymmetric init", None, 0, "asymmetric", True, _BROWN, "--"),
)


def _pretrain(model: nn.Module, kind: str | None, steps: int, step_size: float, batches: Sequence[Tensor]) -> None:
    if kind == "last":
        last_layer_pretraining(model, batches, steps, step_size)
    elif kind == "layerwise":
        layerwise_pretraining(model, batches[0], steps, step_size)
    elif kind == "layerwise_rescaled":
        layerwise_pretraining(model, batches[0], steps, step_size, rescale=True)
    elif kind == "rescaled":
        rescale_layerwise(model, batches[0])


@experiment(
    "daneshmand_fig6",
    paper="Daneshmand et al. 2020",
    title="Fig. 6 / Sec. 4: rank pre-training (last-layer and layer-wise) vs BN vs BN with asymmetric init",
)
def daneshmand_fig6(context: Context) -> list[Claim]:
    """Depth-32 ReLU MLPs of width 128 (PyTorch's initialisation, biases included), training accuracy and
    ``r(H_L)`` over epochs for the variants of :data:`_VARIANTS`; the pre-training step size is grid-searched
    (largest ``r(H_L)`` after pre-training, first seed) and the SGD learning rate too (best final accuracy)."""
    data = load_classification(context.data_dir, max_train=context.size(None, 256)).to(context.device)
    depth = context.size(32, 8)
    seeds = context.size(3, 1)
    epochs = context.size(20, 2)
    lrs = context.size([0.01, 0.1], [0.1])
    step_sizes = context.size([0.003, 0.01, 0.03], [0.01])
    probe = data.x_train[:128]
    batches = [data.x_train[start : start + 128] for start in range(0, min(len(data.x_train), 5 * 128), 128)]
    curves: list[dict[str, object]] = []
    diagnostics: list[dict[str, object]] = []
    context.total(len(_VARIANTS) * seeds * len(lrs) + 4 * len(step_sizes))
    chosen_step: dict[str, float] = {}
    for name, kind, steps, init, batch_norm, *_ in _VARIANTS:
        if kind in ("last", "layerwise", "layerwise_rescaled") and len(step_sizes) > 1:
            scores = {}
            for step_size in step_sizes:
                torch.manual_seed(context.seed)
                model = _mlp(data, depth, batch_norm, init=init).to(context.device)
                _pretrain(model, kind, steps, step_size, batches)
                scores[step_size] = _diagnose(model, probe)["r_H_L"]
                scores[step_size] = scores[step_size] if math.isfinite(scores[step_size]) else -1.0
                context.advance()
            chosen_step[name] = max(scores, key=scores.__getitem__)
        else:
            chosen_step[name] = step_sizes[0]
        for seed in range(seeds):
            torch.manual_seed(context.seed + seed)
            initial = _mlp(data, depth, batch_norm, init=init).to(context.device)
            before = _diagnose(initial, probe)
            _pretrain(initial, kind, steps, chosen_step[name], batches)
            after = _diagnose(initial, probe)
            diagnostics.append(
                {"variant": name, "seed": seed, "step_size": chosen_step[name]}
                | {f"{k}_before": v for k, v in before.items()}
                | {f"{k}_after": v for k, v in after.items()}
            )
            for lr in lrs:
                model = copy.deepcopy(initial)
                curve = [_epoch_row(name, seed, lr, -1, model, data, probe)]

                def record(
                    epoch: int,
                    model: nn.Module = model,
                    curve: list = curve,
                    lr: float = lr,
                    name: str = name,
                    seed: int = seed,
                ) -> None:
                    curve.append(_epoch_row(name, seed, lr, epoch, model, data, probe))

                train_epochs(
                    model, data.x_train, data.y_train, epochs=epochs, lr=lr, seed=context.seed + seed,
                    after_epoch=record,
                )  # fmt: skip
                curves += curve
                context.advance()
    context.write_csv("curves", curves)
    context.write_csv("diagnostics", diagnostics)
    final = [r for r in curves if r["epoch"] == epochs - 1]
    best = _best_lr(final, ("variant",), "train_accuracy")
    best_lr = {str(r["variant"]): float(r["lr"]) for r in best}
    shown = [r for r in curves if float(r["lr"]) == best_lr[str(r["variant"])]]
    summary = _summarise(shown, ("variant", "epoch"), ("train_accuracy", "r_H_L"))
    context.write_csv("curves_best_lr_mean_ci95", summary)
    context.save(_fig6(summary, depth, data.name), "daneshmand_fig6")
    return _fig6_claims(summary, diagnostics, epochs, depth, data.name)


def _epoch_row(
    variant: str, seed: int, lr: float, epoch: int, model: nn.Module, data: Dataset, probe: Tensor
) -> dict[str, object]:
    with torch.no_grad(), train_mode(model), buffers_kept(model):
        r = float(participation_ratio(model.forward_features(probe)))
    return {
        "variant": variant,
        "seed": seed,
        "lr": lr,
        "epoch": epoch,
        "train_accuracy": accuracy(model, data.x_train, data.y_train),
        "r_H_L": r,
    }


def _fig6(summary: Sequence[dict[str, object]], depth: int, data_name: str) -> Figure:
    figure = Figure(figsize=(10, 3.8), layout="constrained")
    left, right = figure.subplots(1, 2)
    for name, _, _, _, _, color, style in _VARIANTS:
        rows = [r for r in summary if r["variant"] == name]
        xs = [int(r["epoch"]) + 1 for r in rows]
        for ax, metric in ((left, "train_accuracy"), (right, "r_H_L")):
            mean = [float(r[f"{metric}_mean"]) for r in rows]
            ci = [float(r[f"{metric}_ci95"]) for r in rows]
            ax.plot(xs, mean, linestyle=style, color=color, marker="o", ms=2.5, label=name)
            lower = [m - c for m, c in zip(mean, ci)]
            if metric == "r_H_L" and min(lower) <= 0:
                continue  # a band reaching 0 (seeds with all units dead) cannot be drawn on the log axis
            ax.fill_between(xs, lower, [m + c for m, c in zip(mean, ci)], color=color, alpha=0.12)
    left.set_ylabel("training accuracy")
    left.set_ylim(0, 1.02)
    right.set_ylabel("r(H$_L$), lower bound on rank")
    right.set_yscale("log")
    # r(H) >= 1 for any non-zero H; 0 means every unit is dead. The bottom leaves room for both without letting a
    # confidence band that reaches zero stretch the log axis.
    right.set_ylim(bottom=0.2)
    for ax in (left, right):
        ax.set_xlabel("epoch (0: after pre-training)")
        ax.grid(alpha=0.3)
    right.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    figure.suptitle(f"{data_name}, ReLU MLP depth {depth}, width 128 (mean, 95% CI; best lr per variant)", fontsize=10)
    return figure


# Training accuracies closer than this count as equal (two seeds of one variant differ by about as much).
_ACCURACY_MARGIN = 0.02


def _fig6_order_verdict(pretrained: float, bn: float, vanilla: float) -> tuple[str, str]:
    """Verdict on Fig. 6's ordering "pre-trained > BN > vanilla" in training accuracy, and the reason's first part.

    ``reproduced`` only when both orderings hold (each by more than :data:`_ACCURACY_MARGIN`); ``partly`` when
    pre-training beats BN or at least trains (beats vanilla by 0.1); ``not`` otherwise (BN beating vanilla alone is
    the paper's baseline, not what pre-training adds). The reason names the orderings that fail.
    """
    above_bn = pretrained > bn + _ACCURACY_MARGIN
    bn_above_vanilla = bn > vanilla + _ACCURACY_MARGIN
    failed = []
    if not above_bn:
        failed.append(f"pre-trained ({pretrained:.2f}) does not beat BN ({bn:.2f})")
    if not bn_above_vanilla:
        failed.append(f"BN ({bn:.2f}) does not beat vanilla ({vanilla:.2f})")
    reason = "both orderings hold" if not failed else "; ".join(failed)
    holds = above_bn and bn_above_vanilla
    return verdict(holds, partly=above_bn or pretrained > vanilla + 0.1), reason


def _fig6_claims(
    summary: Sequence[dict[str, object]], diagnostics: Sequence[dict[str, object]], epochs: int, depth: int, data: str
) -> list[Claim]:
    def final(variant: str, metric: str = "train_accuracy") -> float:
        return next(float(r[f"{metric}_mean"]) for r in summary if (r["variant"], r["epoch"]) == (variant, epochs - 1))

    def diag(variant: str, key: str) -> float:
        return _mean([float(r[key]) for r in diagnostics if r["variant"] == variant])

    vanilla, bn, asym = final("vanilla"), final("BN"), final("BN, asymmetric init")
    last75, layer75 = final("Alg. 1 (last layer), 75 it."), final("layer-wise, 75 it.")
    repaired, rescaled = final("layer-wise, 75 it. + rescaling"), final("rescaling only")
    best_pretrained = max(last75, layer75, repaired)
    setting = f"{data}, depth {depth}, {epochs} epochs"
    order_verdict, order_reason = _fig6_order_verdict(best_pretrained, bn, vanilla)
    return [
        Claim(
            "daneshmand_fig6",
            "rank pre-training lets vanilla SGD train and outperform BN on deep MLPs",
            "pre-trained (75 it.) > BN > vanilla in training accuracy (Fig. 6, Fashion-MNIST, depth 32)",
            f"train acc: vanilla {vanilla:.2f}, Alg. 1 75 it. {last75:.2f}, layer-wise 75 it. {layer75:.2f}, "
            f"layer-wise + rescaling {repaired:.2f}, BN {bn:.2f}",
            order_verdict,
            f"{order_reason} (pre-trained: its best variant; accuracies within {_ACCURACY_MARGIN:g} count as "
            f"equal). {setting}. Cause found: PyTorch's default init shrinks the signal (rms of H_L "
            f"{diag('vanilla', 'rms_H_L_before'):.1e}, relative spread across samples "
            f"{diag('vanilla', 'relative_spread_H_L_before'):.1e}, |grad r(H_L)| "
            f"{diag('vanilla', 'grad_norm_r_H_L_before'):.1e}); r(H) is scale-invariant, so raising it leaves the "
            "signal too small for SGD; rescaling each layer repairs it",
            value=best_pretrained,
        ),
        Claim(
            "daneshmand_fig6",
            "rank pre-training raises r(H_L) of a deep vanilla network",
            "r(H_L) rises with pre-training iterations and stays raised in training (Fig. 6 right)",
            f"r(H_L) after pre-training: Alg. 1 75 it. {diag('Alg. 1 (last layer), 75 it.', 'r_H_L_after'):.2f}, "
            f"layer-wise 75 it. {diag('layer-wise, 75 it.', 'r_H_L_after'):.2f}, layer-wise 75 it. + rescaling "
            f"{diag('layer-wise, 75 it. + rescaling', 'r_H_L_after'):.2f} (vanilla "
            f"{diag('vanilla', 'r_H_L_after'):.2f})",
            verdict(
                min(diag(v, "r_H_L_after") for v in ("Alg. 1 (last layer), 75 it.", "layer-wise, 75 it."))
                > 2 * diag("vanilla", "r_H_L_after"),
                partly=diag("layer-wise, 75 it. + rescaling", "r_H_L_after") > 2 * diag("vanilla", "r_H_L_after"),
            ),
            "measured on 128 training inputs after pre-training, mean over seeds; without rescaling the ascent has "
            "no gradient to follow (H_L is constant to float32 precision)",
            value=diag("layer-wise, 75 it. + rescaling", "r_H_L_after"),
        ),
        Claim(
            "daneshmand_fig6",
            "asymmetric init breaks BN (lower rank, slower training)",
            "BN with asymmetric init trains far worse than BN (Fig. 6 dashed lines)",
            f"train acc BN {bn:.2f} vs asymmetric {asym:.2f}; r(H_L) at init "
            f"{diag('BN', 'r_H_L_before'):.2f} vs {diag('BN, asymmetric init', 'r_H_L_before'):.2f}",
            verdict(
                asym < bn - 0.05 and diag("BN, asymmetric init", "r_H_L_before") < diag("BN", "r_H_L_before"),
                partly=diag("BN, asymmetric init", "r_H_L_before") < diag("BN", "r_H_L_before"),
            ),
            setting,
            value=asym,
        ),
        Claim(
            "daneshmand_fig6",
            "rescaling alone (no rank objective) vs rank pre-training plus rescaling",
            "not in the paper (control for the cause found above)",
            f"train acc: rescaling only {rescaled:.2f}, layer-wise 75 it. + rescaling {repaired:.2f}",
            verdict(repaired > rescaled + 0.02, partly=repaired >= rescaled - 0.02),
            "reproduced = the rank objective adds accuracy beyond the scale repair",
            value=repaired - rescaled,
        ),
    ]
