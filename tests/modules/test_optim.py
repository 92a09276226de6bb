import pytest
import torch
from torch import nn

from rank_lightning.modules.optim import build_optimizer, build_scheduler, split_decay_parameters


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3, bias=False), nn.LayerNorm(3))


def test_split_excludes_biases_and_norm_parameters():
    net = _net()
    decay, no_decay = split_decay_parameters(net)
    assert {id(p) for p in decay} == {id(net[0].weight), id(net[3].weight)}
    expected = {id(net[0].bias), id(net[1].weight), id(net[1].bias), id(net[4].weight), id(net[4].bias)}
    assert {id(p) for p in no_decay} == expected


def test_split_can_decay_everything():
    net = _net()
    decay, no_decay = split_decay_parameters(net, decay_norm_and_bias=True)
    assert not no_decay
    assert len(decay) == len(list(net.parameters()))


def test_no_decay_group_is_not_decayed():
    torch.manual_seed(0)
    net = _net()
    opt = build_optimizer(net, name="sgd", lr=0.1, weight_decay=0.5, momentum=0.0)
    before_bias, before_w = net[0].bias.detach().clone(), net[0].weight.detach().clone()
    for p in net.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    # With zero gradients only weight decay moves a parameter: w <- w - lr * wd * w.
    torch.testing.assert_close(net[0].bias, before_bias)
    torch.testing.assert_close(net[0].weight, before_w * (1 - 0.1 * 0.5))


@pytest.mark.parametrize("name", ["sgd", "adam", "adamw"])
def test_optimizers_build(name):
    opt = build_optimizer(_net(), name=name, lr=1e-3, weight_decay=1e-4)
    assert opt.param_groups[0]["weight_decay"] == 1e-4
    assert opt.param_groups[1]["weight_decay"] == 0.0


def test_bad_settings_name_the_choices():
    with pytest.raises(ValueError, match=r"unknown optimizer 'lbfgs'.*sgd, adam, adamw"):
        build_optimizer(_net(), name="lbfgs")
    with pytest.raises(ValueError, match="weight_decay"):
        build_optimizer(_net(), weight_decay=-1.0)
    opt = build_optimizer(_net())
    with pytest.raises(ValueError, match=r"unknown scheduler 'poly'.*cosine"):
        build_scheduler(opt, name="poly")
    with pytest.raises(ValueError, match="max_epochs"):
        build_scheduler(opt, name="cosine", max_epochs=None)


def test_cosine_schedule_reaches_zero():
    opt = build_optimizer(_net(), lr=1.0)
    sched = build_scheduler(opt, name="cosine", max_epochs=4)
    for _ in range(4):
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-12)


def test_lr_layer_parameters_are_never_decayed():
    from rank_lightning.nn import LRLayer

    net = nn.Sequential(LRLayer(4, rank=2), nn.Linear(4, 3))
    decay, no_decay = split_decay_parameters(net, decay_norm_and_bias=True)
    assert {id(p) for p in decay} == {id(net[1].weight), id(net[1].bias)}
    assert {id(p) for p in no_decay} == {id(net[0].weight), id(net[0].bias)}
