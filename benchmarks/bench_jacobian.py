"""Forward-mode partial Jacobian against reverse-mode ``torch.autograd.functional.jacobian`` (Feng et al. eq. 5).

Both compute the same sub-Jacobian ``d f(x) / d x_P`` of a CIFAR ResNet-18 (eval mode) from the input to a block, for
the central patch ``P`` of one 32 x 32 input. Forward mode (:func:`rank_lightning.functional.partial_jacobian`) costs
about ``K = |P|`` batched forward passes; reverse mode costs one backward pass per output. Default: up to ``layer3``
(256 x 8 x 8 = 16,384 outputs) with an 8 x 8 x 3 patch (K = 192); reverse mode takes minutes on two CPU cores.
``--quick`` uses 16 x 16 inputs, stops at the global average pool (512 outputs) and takes a 4 x 4 x 3 patch, so both
finish in about a minute even on a busy machine.

Printed: the time of each, their ratio, the numerical rank of each Jacobian (they must agree) and the largest absolute
difference between them. The forward-mode timing excludes a first warm-up call, which loads torch's forward-mode
decompositions once per process.

Usage::

    python benchmarks/bench_jacobian.py            # layer3, 8 x 8 x 3 patch
    python benchmarks/bench_jacobian.py --quick    # 16 x 16 inputs, avgpool, 4 x 4 x 3 patch
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from rank_lightning.functional import Patch, capture_block_outputs, numerical_rank, partial_jacobian


def cifar_resnet18() -> tuple[nn.Module, str]:
    """ResNet-18 for 32 x 32 inputs: the package's backbone, or torchvision's with a CIFAR stem if it is missing."""
    try:
        from rank_lightning.models import create_model

        return create_model("resnet18", num_classes=10), "rank_lightning resnet18"
    except (ImportError, ValueError):
        import torchvision

        model = torchvision.models.resnet18(num_classes=10)
        model.conv1 = nn.Conv2d(3, 64, 3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
        return model, "torchvision resnet18 with a CIFAR stem"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="16 x 16 inputs, avgpool, 4 x 4 x 3 patch")
    parser.add_argument("--layer", default=None, help="dotted module path of the output block (default layer3)")
    parser.add_argument("--patch-size", type=int, default=None, help="side of the central patch (default 8)")
    parser.add_argument("--image-size", type=int, default=None, help="side of the input image (default 32)")
    parser.add_argument("--chunk-size", type=int, default=None, help="forward-mode directions per chunk")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    layer = args.layer or ("avgpool" if args.quick else "layer3")
    side = args.patch_size or (4 if args.quick else 8)
    image_size = args.image_size or (16 if args.quick else 32)

    if args.threads is not None:
        # On a machine shared with other jobs, fewer threads than cores avoids threads waiting on each other.
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model, description = cifar_resnet18()
    model.eval()
    x = torch.randn(3, image_size, image_size)
    patch = Patch.central(x.shape, size=side)
    mask = patch.mask(x.shape)
    block = capture_block_outputs(model, {layer: layer})

    def f(batch: torch.Tensor) -> torch.Tensor:
        return block(batch)[layer]

    partial_jacobian(f, x, torch.tensor([0]))  # warm-up, see the module docstring

    start = time.perf_counter()
    with torch.no_grad():
        forward = partial_jacobian(f, x, patch, chunk_size=args.chunk_size)
    forward_s = time.perf_counter() - start

    flat_index = mask.flatten().nonzero().squeeze(1)

    def g(values: torch.Tensor) -> torch.Tensor:
        # The image with its patch replaced by `values`; its Jacobian at the patch's own values is d f / d x_P.
        return f(x.flatten().index_put((flat_index,), values).view(1, *x.shape)).flatten()

    start = time.perf_counter()
    reverse = torch.autograd.functional.jacobian(g, x.flatten()[flat_index])
    reverse_s = time.perf_counter() - start

    print(f"model: {description}, eval mode, torch {torch.__version__}, {torch.get_num_threads()} threads")
    outputs, directions = forward.shape
    print(
        f"sub-Jacobian: {image_size}x{image_size} input -> {layer}, {outputs} outputs x K = {directions} "
        f"({side}x{side}x3 patch)"
    )
    print(f"forward mode (vmap of jvp):          {forward_s:9.2f} s")
    print(f"reverse mode (autograd.functional):  {reverse_s:9.2f} s")
    print(f"speed-up: {reverse_s / forward_s:.1f}x")
    print(f"numerical rank: forward {int(numerical_rank(forward))}, reverse {int(numerical_rank(reverse))}")
    difference = (forward - reverse).abs().max().item()
    print(f"max |forward - reverse| = {difference:.2e} (max |J| = {forward.abs().max().item():.2e})")


if __name__ == "__main__":
    main()
