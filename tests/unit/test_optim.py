import math

import pytest
import torch

from scaletrain.config import ConfigError, OptimConfig, load_config
from scaletrain.optim import RMSpropTF, build_optimizer, decayed, loss_fn, lr_at, state_keys


def test_rmsprop_tf_matches_hand_computed_update():
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    g = [0.5, 1.0]
    opt = RMSpropTF([p], lr=0.1, decay=0.9, eps=1.0, momentum=0.5)
    expected, ms, mom = [1.0, -2.0], [1.0, 1.0], [0.0, 0.0]  # TF: accumulator starts at 1.0
    for _ in range(3):
        p.grad = torch.tensor(g)
        opt.step()
        for i in range(2):
            ms[i] = 0.9 * ms[i] + 0.1 * g[i] ** 2
            mom[i] = 0.5 * mom[i] + 0.1 * g[i] / math.sqrt(ms[i] + 1.0)  # eps inside the root
            expected[i] -= mom[i]
        assert p.detach().tolist() == pytest.approx(expected, abs=1e-7)


def test_multi_tensor_steps_equal_per_tensor_steps_exactly():
    """RMSpropTF's multi-tensor kernels over parameters of several shapes (one without a gradient)
    give bit for bit the per-tensor update; so does SGD's foreach path, which build_optimizer takes."""
    torch.manual_seed(0)
    shapes = [(64, 3, 3, 3), (64,), (10, 64), (7,)]
    init = [torch.randn(s) for s in shapes]
    grads = [[torch.randn(s) for s in shapes] for _ in range(3)]
    ps = [torch.nn.Parameter(t.clone()) for t in init]
    opt = RMSpropTF(ps, lr=0.1, decay=0.9, eps=1.0, momentum=0.9)
    ref = [t.clone() for t in init]
    ms, mom = [torch.ones_like(t) for t in init], [torch.zeros_like(t) for t in init]
    for step in grads:
        for p, g in zip(ps, step):
            p.grad = None if p.shape == (7,) else g.clone()
        opt.step()
        for i, g in enumerate(step[:3]):  # by hand, tensor by tensor, as TF 1.x's kernel
            ms[i].mul_(0.9).addcmul_(g, g, value=0.1)
            mom[i].mul_(0.9).addcdiv_(g, (ms[i] + 1.0).sqrt_(), value=0.1)
            ref[i].sub_(mom[i])
    assert all(torch.equal(p.detach(), r) for p, r in zip(ps, ref))  # the last: no gradient, untouched
    cfg = OptimConfig(name="sgd", lr=0.1, momentum=0.9)
    a, b = [torch.nn.Parameter(t.clone()) for t in init], [torch.nn.Parameter(t.clone()) for t in init]
    fast, loop = build_optimizer(cfg, a), torch.optim.SGD(b, lr=0.1, momentum=0.9, foreach=False)
    assert fast.defaults["foreach"] is True
    for step in grads:
        for x, y, g in zip(a, b, step):
            x.grad, y.grad = g.clone(), g.clone()
        fast.step()
        loop.step()
    assert all(torch.equal(x.detach(), y.detach()) for x, y in zip(a, b))


def test_rmsprop_tf_differs_from_torch_rmsprop():
    a = torch.nn.Parameter(torch.ones(3))
    b = torch.nn.Parameter(torch.ones(3))
    ta, tb = RMSpropTF([a], lr=0.1, decay=0.9, eps=1.0), torch.optim.RMSprop([b], lr=0.1, alpha=0.9, eps=1.0)
    a.grad = b.grad = torch.full((3,), 0.5)
    ta.step()
    tb.step()
    assert not torch.allclose(a, b)
    # first TF step: 0.1 * 0.5 / sqrt(0.9 + 0.1*0.25 + 1.0)
    assert a[0].item() == pytest.approx(1 - 0.05 / math.sqrt(1.925), abs=1e-7)


def test_loss_adds_half_weight_decay_times_squared_weights():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    x, y = torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1])
    params = decayed(model)
    assert len(params) == 1 and params[0] is model[0].weight  # bias not decayed
    logits = model(x)
    got = loss_fn(logits, y, params, 1e-2)
    want = torch.nn.functional.cross_entropy(logits, y) + 0.5e-2 * model[0].weight.pow(2).sum()
    assert got.item() == pytest.approx(want.item(), rel=1e-6)


def test_schedules():
    c = OptimConfig(lr=1.0, warmup_steps=4, schedule="step", step_size=10, gamma=0.5)
    assert [lr_at(c, s, 100, 32) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(c, 13, 100, 32) == 1.0 and lr_at(c, 14, 100, 32) == 0.5 and lr_at(c, 24, 100, 32) == 0.25
    cos = OptimConfig(lr=2.0, schedule="cosine")
    assert lr_at(cos, 0, 10, 32) == 2.0 and lr_at(cos, 5, 10, 32) == pytest.approx(1.0) and lr_at(cos, 10, 10, 32) == 0.0
    assert lr_at(OptimConfig(lr=0.3), 999, 10, 32) == 0.3


def test_the_noise_rule_scales_lr_by_the_gain_of_a_larger_update():
    """scale_lr = noise, N = 32, reference 32: (1 + 1) / (1 + 32/B): about linear well below N, at most 2x."""
    c = OptimConfig(lr=0.1, scale_lr="noise", noise_scale=32.0, reference_batch=32)
    assert lr_at(c, 0, 10, 32) == pytest.approx(0.1)
    assert lr_at(c, 0, 10, 96) == pytest.approx(0.1 * 2 / (1 + 1 / 3))
    assert lr_at(c, 0, 10, 4) == pytest.approx(0.1 * 2 / 9)
    assert lr_at(c, 0, 10, 10 ** 9) == pytest.approx(0.2)
    with pytest.raises(ConfigError, match="optim.noise_scale > 0"):
        load_config(None, ["optim.scale_lr=noise"])


@pytest.mark.parametrize("name,momentum", [("sgd", 0.9), ("sgd", 0.0), ("rmsprop-tf", 0.9)])
def test_state_keys_name_what_the_optimizer_keeps(name, momentum):
    """The PS sends a shard's optimizer state as these tensors, in this order."""
    cfg = OptimConfig(name=name, momentum=momentum)
    p = torch.nn.Parameter(torch.ones(5))
    opt = build_optimizer(cfg, [p])
    p.grad = torch.ones(5)
    opt.step()
    state = opt.state[p]
    assert set(state) == set(state_keys(cfg))
    assert all(state[k].shape == p.shape for k in state_keys(cfg))
