"""FGSM, Iter-FGSM and Iter-LL-FGSM against torchattacks, on a trained digits model, and their side effects."""

from __future__ import annotations

import itertools

import pytest
import torch
import torchattacks
from torch import nn

from rank_lightning.attacks import (
    ATTACKS,
    attack,
    fgsm,
    iterative_fgsm,
    iterative_ll_fgsm,
    kurakin_steps,
    to_pixels,
)
from tests.attacks.conftest import RGB_MEAN, RGB_STD, DigitsTask, small_cnn

# Outputs are normalised values of magnitude <= 4, where one float32 ulp is 4.8e-7.
ATOL = 1e-6


def _least_likely(model: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(inputs).argmin(dim=1)


@pytest.mark.parametrize("eps", [1 / 255, 8 / 255])
def test_fgsm_matches_torchattacks(cnn, rgb_batch, eps):
    inputs, labels = rgb_batch
    reference = torchattacks.FGSM(cnn, eps=eps)
    reference.set_normalization_used(RGB_MEAN, RGB_STD)
    expected = reference(inputs, labels)
    result = fgsm(cnn, inputs, labels, eps, mean=RGB_MEAN, std=RGB_STD)
    torch.testing.assert_close(result, expected, atol=ATOL, rtol=0)
    assert (result - inputs).abs().max() > 0.5 * eps / max(RGB_STD)


@pytest.mark.parametrize(
    ("eps", "alpha", "steps"), [(4 / 255, 1 / 255, None), (8 / 255, 1 / 255, None), (8 / 255, 2 / 255, 3)]
)
def test_iterative_fgsm_matches_torchattacks_bim(cnn, rgb_batch, eps, alpha, steps):
    inputs, labels = rgb_batch
    # torchattacks' steps=0 means Kurakin's default, the same rule as steps=None here.
    reference = torchattacks.BIM(cnn, eps=eps, alpha=alpha, steps=steps or 0)
    reference.set_normalization_used(RGB_MEAN, RGB_STD)
    expected = reference(inputs, labels)
    result = iterative_fgsm(cnn, inputs, labels, eps, alpha=alpha, steps=steps, mean=RGB_MEAN, std=RGB_STD)
    torch.testing.assert_close(result, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("eps", [4 / 255, 8 / 255])
def test_iterative_ll_fgsm_matches_targeted_bim(cnn, rgb_batch, eps):
    inputs, labels = rgb_batch
    # torchattacks' own least-likely mode excludes the true label; targeting argmin explicitly is Kurakin's y_LL.
    targets = _least_likely(cnn, inputs)
    reference = torchattacks.BIM(cnn, eps=eps, alpha=1 / 255, steps=0)
    reference.set_normalization_used(RGB_MEAN, RGB_STD)
    reference.set_mode_targeted_by_function(lambda images, labels: targets, quiet=True)
    expected = reference(inputs, labels)
    result = iterative_ll_fgsm(cnn, inputs, eps, mean=RGB_MEAN, std=RGB_STD)
    torch.testing.assert_close(result, expected, atol=ATOL, rtol=0)


def test_kurakin_steps_closed_form():
    # min(k + 4, 1.25 k) for k grey levels, floored, in exact integer arithmetic.
    for k in range(0, 65):
        assert kurakin_steps(k / 255) == min(k + 4, (5 * k) // 4), k


@pytest.mark.parametrize("name", ATTACKS)
def test_accuracy_non_increasing_in_eps(digits: DigitsTask, name):
    clean = digits.accuracy(digits.inputs)
    assert clean > 0.9
    accuracies = [
        digits.accuracy(
            attack(name, digits.model, digits.inputs, digits.labels, k / 255, mean=digits.mean, std=digits.std)
        )
        for k in (0, 1, 2, 4, 8, 16, 32, 64)
    ]
    assert accuracies[0] == clean
    assert all(later <= earlier for earlier, later in itertools.pairwise(accuracies)), accuracies
    assert accuracies[-1] < 0.5 * clean, accuracies


@pytest.mark.parametrize("name", ATTACKS)
def test_eps_zero_returns_clean_batch(digits: DigitsTask, name):
    result = attack(name, digits.model, digits.inputs, digits.labels, 0.0, mean=digits.mean, std=digits.std)
    assert torch.equal(result, digits.inputs)


@pytest.mark.parametrize("name", ATTACKS)
def test_perturbation_stays_in_eps_ball_and_pixel_range(digits: DigitsTask, name):
    eps = 8 / 255
    result = attack(name, digits.model, digits.inputs, digits.labels, eps, mean=digits.mean, std=digits.std)
    pixels = to_pixels(result, digits.mean, digits.std)
    clean = to_pixels(digits.inputs, digits.mean, digits.std)
    assert (pixels - clean).abs().max() <= eps + 1e-6
    assert pixels.min() >= -1e-6 and pixels.max() <= 1 + 1e-6
    # Digits have many black and saturated pixels: clipping at [0, 1] must have bitten somewhere.
    assert ((pixels - clean).abs() < eps / 2).float().mean() > 0.1


@pytest.mark.parametrize("name", ["fgsm", "iter_fgsm"])
def test_untargeted_attacks_raise_the_loss(digits: DigitsTask, name):
    result = attack(name, digits.model, digits.inputs, digits.labels, 8 / 255, mean=digits.mean, std=digits.std)
    with torch.no_grad():
        clean_loss = nn.functional.cross_entropy(digits.model(digits.inputs), digits.labels, reduction="none")
        adversarial_loss = nn.functional.cross_entropy(digits.model(result), digits.labels, reduction="none")
    assert adversarial_loss.mean() > 2 * clean_loss.mean()
    # Confident samples whose float32 loss is exactly 0 have a zero gradient and stay put; no loss may drop.
    assert (adversarial_loss >= clean_loss).all()
    assert (adversarial_loss > clean_loss).float().mean() > 0.8


def test_least_likely_attack_lowers_the_target_loss(digits: DigitsTask):
    targets = _least_likely(digits.model, digits.inputs)
    result = iterative_ll_fgsm(digits.model, digits.inputs, 16 / 255, mean=digits.mean, std=digits.std)
    with torch.no_grad():
        clean_loss = nn.functional.cross_entropy(digits.model(digits.inputs), targets, reduction="none")
        adversarial_logits = digits.model(result)
        adversarial_loss = nn.functional.cross_entropy(adversarial_logits, targets, reduction="none")
    assert (adversarial_loss < clean_loss).float().mean() > 0.95
    assert (adversarial_logits.argmin(dim=1) == targets).float().mean() < 0.5


def test_batched_equals_one_sample_at_a_time(cnn, rgb_batch):
    inputs, labels = rgb_batch
    whole = iterative_fgsm(cnn, inputs, labels, 8 / 255, mean=RGB_MEAN, std=RGB_STD)
    pieces = torch.cat(
        [
            iterative_fgsm(cnn, inputs[i : i + 1], labels[i : i + 1], 8 / 255, mean=RGB_MEAN, std=RGB_STD)
            for i in range(len(labels))
        ]
    )
    torch.testing.assert_close(whole, pieces, atol=ATOL, rtol=0)


def test_works_under_no_grad(cnn, rgb_batch):
    inputs, labels = rgb_batch
    expected = iterative_fgsm(cnn, inputs, labels, 4 / 255, mean=RGB_MEAN, std=RGB_STD)
    with torch.no_grad():
        result = iterative_fgsm(cnn, inputs, labels, 4 / 255, mean=RGB_MEAN, std=RGB_STD)
    assert not result.requires_grad
    torch.testing.assert_close(result, expected, atol=0, rtol=0)


@pytest.mark.parametrize("name", ATTACKS)
def test_model_state_untouched(rgb_batch, name):
    inputs, labels = rgb_batch
    model = small_cnn()
    model.train()
    model[1].eval()  # a frozen BatchNorm inside a training model: mixed modes must survive
    model[0].bias.requires_grad_(False)
    model[0].weight.grad = torch.full_like(model[0].weight, 0.5)
    flags = [module.training for module in model.modules()]
    state = {key: value.clone() for key, value in model.state_dict().items()}
    requires_grad = [parameter.requires_grad for parameter in model.parameters()]

    attack(name, model, inputs, labels, 8 / 255, mean=RGB_MEAN, std=RGB_STD)

    assert [module.training for module in model.modules()] == flags
    for key, value in model.state_dict().items():
        assert torch.equal(value, state[key]), key
    assert [parameter.requires_grad for parameter in model.parameters()] == requires_grad
    assert torch.equal(model[0].weight.grad, torch.full_like(model[0].weight, 0.5))
    assert all(parameter.grad is None for name_, parameter in model.named_parameters() if name_ != "0.weight")


def test_attack_runs_in_eval_mode(rgb_batch):
    inputs, labels = rgb_batch
    model = small_cnn()
    expected = fgsm(model.eval(), inputs, labels, 8 / 255, mean=RGB_MEAN, std=RGB_STD)
    # In train mode dropout would randomise the gradient and BatchNorm would use batch statistics.
    result = fgsm(model.train(), inputs, labels, 8 / 255, mean=RGB_MEAN, std=RGB_STD)
    torch.testing.assert_close(result, expected, atol=0, rtol=0)
    assert model.training


@pytest.mark.parametrize("name", ATTACKS)
def test_inference_mode_raises(cnn, rgb_batch, name):
    inputs, labels = rgb_batch
    with torch.inference_mode(), pytest.raises(RuntimeError, match=r"Trainer\(inference_mode=False\)"):
        attack(name, cnn, inputs, labels, 8 / 255, mean=RGB_MEAN, std=RGB_STD)
    with torch.inference_mode():
        inference_inputs = inputs.clone()
    with pytest.raises(RuntimeError, match=r"inference tensors.*Trainer\(inference_mode=False\)"):
        attack(name, cnn, inference_inputs, labels, 8 / 255, mean=RGB_MEAN, std=RGB_STD)


def test_dispatcher(cnn, rgb_batch):
    inputs, labels = rgb_batch
    kwargs = {"mean": RGB_MEAN, "std": RGB_STD}
    torch.testing.assert_close(
        attack("fgsm", cnn, inputs, labels, 2 / 255, **kwargs), fgsm(cnn, inputs, labels, 2 / 255, **kwargs)
    )
    torch.testing.assert_close(
        attack("iter_fgsm", cnn, inputs, labels, 2 / 255, steps=4, **kwargs),
        iterative_fgsm(cnn, inputs, labels, 2 / 255, steps=4, **kwargs),
    )
    torch.testing.assert_close(
        attack("iter_ll_fgsm", cnn, inputs, labels, 2 / 255, alpha=0.5 / 255, **kwargs),
        iterative_ll_fgsm(cnn, inputs, 2 / 255, alpha=0.5 / 255, **kwargs),
    )
    with pytest.raises(ValueError, match="unknown attack 'pgd'; attacks are: fgsm, iter_fgsm, iter_ll_fgsm"):
        attack("pgd", cnn, inputs, labels, 2 / 255, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"eps": -1 / 255}, r"eps must lie in \[0, 1\] in pixel units .*got -0.0039"),
        ({"eps": float("nan")}, r"eps must lie in \[0, 1\] in pixel units .*got nan$"),
        # Grey levels passed as pixel units: clipped to the image, every budget from 1 on was the same attack.
        ({"eps": 8.0}, r"eps must lie in \[0, 1\] in pixel units .*got 8.0, did you mean 8/255\?"),
        ({"alpha": -0.1}, "alpha must be"),
        ({"steps": -1}, "steps must be"),
        ({"steps": 2.0}, "steps must be"),
        ({"mean": (0.5, 0.5), "std": RGB_STD}, "mean has 2 values but the inputs have 3 channels"),
        ({"mean": RGB_MEAN, "std": None}, "give both mean and std"),
        ({"mean": RGB_MEAN, "std": (0.2, 0.0, 0.2)}, "std must be positive"),
        # Normalised inputs passed as if already in [0, 1].
        ({"mean": None, "std": None}, r"un-normalised inputs span \[-2.*not pixels in \[0, 1\]"),
    ],
)
def test_bad_arguments(cnn, rgb_batch, kwargs, message):
    inputs, labels = rgb_batch
    arguments = {"eps": 8 / 255, "alpha": 1 / 255, "steps": None, "mean": RGB_MEAN, "std": RGB_STD} | kwargs
    with pytest.raises(ValueError, match=message):
        iterative_fgsm(cnn, inputs, labels, **arguments)


def test_functional_attacks_reject_grey_levels(cnn, rgb_batch):
    inputs, labels = rgb_batch
    for call in (
        lambda: fgsm(cnn, inputs, labels, 16, mean=RGB_MEAN, std=RGB_STD),
        lambda: attack("iter_ll_fgsm", cnn, inputs, labels, 16, mean=RGB_MEAN, std=RGB_STD),
        lambda: kurakin_steps(16),
    ):
        with pytest.raises(ValueError, match="did you mean 16/255"):
            call()


class _DictOutput(nn.Module):
    """The CNN of the tests, returning its logits as a Hugging Face model does (a mapping with ``"logits"``)."""

    def __init__(self, wrapped: nn.Module, kind: str) -> None:
        super().__init__()
        self.wrapped, self.kind = wrapped, kind

    def forward(self, x: torch.Tensor):
        from transformers.modeling_outputs import SequenceClassifierOutput

        logits = self.wrapped(x)
        return {"logits": logits} if self.kind == "dict" else SequenceClassifierOutput(logits=logits)


@pytest.mark.parametrize("kind", ["dict", "model_output"])
@pytest.mark.parametrize("name", ATTACKS)
def test_logits_read_from_dict_and_model_output(cnn, rgb_batch, name, kind):
    inputs, labels = rgb_batch
    expected = attack(name, cnn, inputs, labels, 4 / 255, mean=RGB_MEAN, std=RGB_STD)
    got = attack(name, _DictOutput(cnn, kind), inputs, labels, 4 / 255, mean=RGB_MEAN, std=RGB_STD)
    assert torch.equal(got, expected)


def test_output_without_logits_names_what_forward_returned(cnn, rgb_batch):
    model = nn.Sequential(cnn, _Wrap())
    with pytest.raises(TypeError, match=r"forward returned a dict with keys \['scores'\]; return a tensor"):
        attack("fgsm", model, *rgb_batch, 4 / 255, mean=RGB_MEAN, std=RGB_STD)


class _Wrap(nn.Module):
    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"scores": x}


@pytest.mark.parametrize("name", ATTACKS)
def test_token_ids_are_refused_by_dtype(name):
    model = nn.Sequential(nn.Embedding(50, 4), nn.Flatten(), nn.Linear(32, 3))
    token_ids = torch.randint(0, 50, (4, 8), generator=torch.Generator().manual_seed(0))
    message = r"inputs have dtype torch.int64 \(token ids\?\), which have no input gradient"
    with pytest.raises(ValueError, match=message):
        attack(name, model, token_ids, torch.zeros(4, dtype=torch.long), 8 / 255)
