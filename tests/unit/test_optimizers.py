"""adamw, lars, lamb and a class of one's own: their updates, a PS shard's share of them, their resume."""

import pytest
import torch
from torch.testing import assert_close

from scaletrain import schedule
from scaletrain.compute import Backprop
from scaletrain.config import ConfigError, load_config
from scaletrain.models import build_model
from scaletrain.optim import AdamW, Lamb, Lars, build_optimizer, loss_decay, state_keys
from scaletrain.ps.server import Shard
from scaletrain.ps.sharding import gather
from scaletrain.strategies import traits

from conftest import RECIPES

STEADY = ["optim.schedule=constant", "optim.warmup_steps=0", "optim.weight_decay=0.05", "train.steps=10"]


def layers(seed=0):
    """A weight, its bias and a normalisation scale: one of each kind the exclusions tell apart."""
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in [(4, 3, 2), (4,), (4,)]]


def grads(params, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(p.shape, generator=g) for p in params] for _ in range(steps)]


def run(opt, params, steps):
    for gs in steps:
        for p, g in zip(params, gs):
            p.grad = g.clone()
        opt.step()


def test_adamw_is_torchs_with_biases_and_norms_not_decayed():
    ours, ref = layers(), layers()
    steps = grads(ours, 4)
    run(AdamW(ours, lr=0.1, weight_decay=0.1), ours, steps)
    run(torch.optim.AdamW([{"params": ref[:1]}, {"params": ref[1:], "weight_decay": 0.0}], lr=0.1,
                          weight_decay=0.1, foreach=False), ref, steps)
    for a, b in zip(ours, ref):
        assert_close(a, b)


def lars_by_hand(w, g, buf, lr, wd, mu, eta, excluded):
    if not excluded:
        wn, gn = w.norm(), g.norm()
        g = (g + wd * w) * (eta * wn / (gn + wd * wn + 1e-8))
    buf.mul_(mu).add_(g)
    w.sub_(lr * buf)


def lamb_by_hand(w, g, m, v, t, lr, wd, excluded):
    m.mul_(0.9).add_(0.1 * g)
    v.mul_(0.999).add_(0.001 * g * g)
    u = (m / (1 - 0.9 ** t)) / ((v / (1 - 0.999 ** t)).sqrt() + 1e-6)
    if not excluded:
        u = u + wd * w
        u = u * (w.norm() / u.norm())
    w.sub_(lr * u)


@pytest.mark.parametrize("name", ["lars", "lamb"])
def test_lars_and_lamb_adapt_each_layer_but_biases_and_norms(name):
    """The papers' updates written out tensor by tensor: the weight scaled by its own trust ratio, the
    bias and the scale (ndim 1) neither decayed nor scaled."""
    params = layers()
    ref = [p.detach().clone() for p in params]
    steps = grads(params, 3)
    opt = Lars(params, lr=0.5, momentum=0.9, weight_decay=0.1, trust_coefficient=0.01) if name == "lars" \
        else Lamb(params, lr=0.05, weight_decay=0.1)
    run(opt, params, steps)
    s1, s2 = [torch.zeros_like(r) for r in ref], [torch.zeros_like(r) for r in ref]
    for t, gs in enumerate(steps, 1):
        for i, (w, g) in enumerate(zip(ref, gs)):
            if name == "lars":
                lars_by_hand(w, g, s1[i], 0.5, 0.1, 0.9, 0.01, i > 0)
            else:
                lamb_by_hand(w, g, s1[i], s2[i], t, 0.05, 0.1, i > 0)
    for p, r in zip(params, ref):
        assert_close(p.detach(), r)
    assert opt.param_groups[0]["step"] == 3 and set(opt.state[params[0]]) == set(opt.keys(0.9))


def cfg_of(*overrides):
    return load_config(RECIPES / "digits.toml", ["data.workers=0", *STEADY, *overrides])


def shards_of(cfg):
    """Every PS shard of cfg, built as its process builds it (the workers' initial model)."""
    sched = schedule.from_config(cfg, 0)
    return [Shard(cfg, k, [1], "sync", 1, sched, cfg.data.batch_size, traits.images_per_update(cfg))
            for k in traits.stage_shards(cfg, 0)]


def whole_model(cfg):
    torch.manual_seed(cfg.train.seed)
    params = list(build_model(cfg.model).parameters())
    return params, build_optimizer(cfg.optim, params)


@pytest.mark.parametrize("name, sharding", [("lamb", "round-robin"), ("lars", "round-robin"),
                                            ("adamw", "balanced")])
def test_a_shard_applies_its_slice_as_the_whole_model_would(name, sharding):
    """Two PS shards step their slices; laid side by side they are the whole model's step, norms per layer
    and exclusions included. Under balanced sharding a layer is cut between the shards: adamw's update is
    elementwise; lars's and lamb's norms are the whole layer's, which no shard holds, so it is refused."""
    cfg = cfg_of(f"optim.name={name}", "cluster.num_ps=2", "strategy.name=sync", f"cluster.sharding={sharding}",
                 "cluster.nodes=2")
    shards = shards_of(cfg)
    params, opt = whole_model(cfg)
    assert any(not q.whole for q in shards[0].pieces + shards[1].pieces) == (sharding == "balanced")
    for gs in grads(params, 3):
        for p, g in zip(params, gs):
            p.grad = g
        opt.step()
        for k, shard in enumerate(shards):
            shard._apply(gather(gs, shard.layout.shards[k]), cfg.data.batch_size)
    for k, shard in enumerate(shards):
        assert_close(shard.values.detach(), gather(params, shard.layout.shards[k]), rtol=1e-6, atol=1e-7)
    assert not torch.equal(shards[0].values, gather(whole_model(cfg)[0], shards[0].layout.shards[0]))


def test_lamb_on_layers_cut_between_shards_is_refused():
    cfg = cfg_of("optim.name=lamb", "cluster.num_ps=2", "strategy.name=sync", "cluster.nodes=2")
    with pytest.raises(ConfigError, match=r"optim.name = 'lamb' scales each layer by its norms, and "
                                          r"cluster.sharding = 'balanced' cuts layers .* set cluster.sharding = "
                                          r"'round-robin'"):
        shards_of(cfg)


class Counted(torch.optim.Adam):
    """A class of one's own, as a user writes it: torch's Adam, which keeps a 0-d step per parameter."""


@pytest.mark.parametrize("name", ["adamw", "lars", "lamb", "test_optimizers:Counted"])
def test_a_shard_resumed_from_its_snapshot_goes_on_as_one_never_stopped(name):
    """The snapshot the chief takes (values, then state_keys' tensors) loaded into a fresh shard: the
    step counts (bias corrections) come back from its version."""
    cfg = cfg_of(f"optim.name={name}", "cluster.num_ps=2", "strategy.name=sync", "cluster.sharding=round-robin",
                 "cluster.nodes=2", *(["optim.args.betas=[0.8, 0.99]"] if ":" in name else []))
    straight, first = shards_of(cfg)[1], shards_of(cfg)[1]
    gs = [torch.randn(straight.values.shape) for _ in range(4)]
    for g in gs:
        straight._apply(g.clone(), cfg.data.batch_size)
    for g in gs[:2]:
        first._apply(g.clone(), cfg.data.batch_size)
    values, *state = first.state()
    assert len(state) == len(state_keys(cfg.optim)) > 0 and all(t.shape == values.shape for t in state)
    snap = {"values": values.clone(), "optimizer": dict(zip(state_keys(cfg.optim), [t.clone() for t in state])),
            "version": first.version, "images": first.images}
    resumed = shards_of(cfg)[1]
    resumed.load(snap)
    for g in gs[2:]:
        resumed._apply(g.clone(), cfg.data.batch_size)
    assert torch.equal(resumed.values, straight.values)


def test_a_class_by_import_path_is_built_with_its_args():
    cfg = cfg_of("optim.name=torch.optim:Adam", "optim.args.betas=[0.8, 0.9]", "optim.args.amsgrad=true")
    opt = build_optimizer(cfg.optim, [torch.nn.Parameter(torch.ones(2))])
    assert type(opt) is torch.optim.Adam and tuple(opt.defaults["betas"]) == (0.8, 0.9) and opt.defaults["amsgrad"]
    assert opt.defaults["lr"] == cfg.optim.lr
    assert state_keys(cfg.optim) == ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


@pytest.mark.parametrize("name, args, message", [
    ("nosuch.module:Opt", [], r"optim.name = 'nosuch.module:Opt': module nosuch.module does not import: "
                              r"ModuleNotFoundError"),
    ("torch.optim:NoSuch", [], r"optim.name = 'torch.optim:NoSuch': module torch.optim has no attribute 'NoSuch'"),
    ("torch.optim:Adam", ["optim.args.nosuch=1"], r"torch.optim:Adam\(params, lr=0.05, nosuch=1\) raised TypeError"),
    ("math:sqrt", [], r"optim.name = 'math:sqrt': math:sqrt\(params, lr=0.05\) raised TypeError"),
])
def test_a_bad_class_path_is_one_line_naming_the_key(name, args, message):
    cfg = cfg_of(f"optim.name={name}", *args)
    with pytest.raises(ConfigError, match=message) as e:
        build_optimizer(cfg.optim, [torch.nn.Parameter(torch.ones(2))])
    assert "\n" not in str(e.value)


def test_config_names_what_optim_name_and_args_take():
    with pytest.raises(ConfigError, match=r"optim.name = 'adam': not a built-in optimizer \(sgd, rmsprop-tf, "
                                          r"adamw, lars, lamb\) nor an import path"):
        cfg_of("optim.name=adam")
    with pytest.raises(ConfigError, match=r"optim.args = \{'x': 1\}: .* optim.name = 'lamb' takes none"):
        cfg_of("optim.name=lamb", "optim.args.x=1")


def test_the_loss_decays_only_where_the_optimizer_does_not():
    for name, want in [("sgd", 0.05), ("rmsprop-tf", 0.05), ("torch.optim:Adam", 0.05), ("adamw", 0.0),
                       ("lars", 0.0), ("lamb", 0.0)]:
        assert loss_decay(cfg_of(f"optim.name={name}").optim) == want, name


@pytest.mark.parametrize("name", ["adamw", "lars", "lamb"])
def test_a_checkpointed_optimizer_goes_on_as_one_never_stopped(name, tmp_path):
    """The state_dict a checkpoint holds (resume.py loads it back) carries the state and the step count
    (bias corrections), in the param group: what every strategy without a PS, and pipeline stages, resume."""
    cfg = cfg_of(f"optim.name={name}").optim
    straight, first, resumed = layers(), layers(), layers()
    steps = grads(straight, 4)
    run(build_optimizer(cfg, straight), straight, steps)
    opt = build_optimizer(cfg, first)
    run(opt, first, steps[:2])
    torch.save({"optimizer": opt.state_dict(), "params": first}, tmp_path / "ckpt.pt")
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    with torch.no_grad():
        for p, q in zip(resumed, saved["params"]):
            p.copy_(q)
    opt = build_optimizer(cfg, resumed)
    opt.load_state_dict(saved["optimizer"])
    run(opt, resumed, steps[2:])
    assert opt.param_groups[0]["step"] == 4
    assert all(torch.equal(a, b) for a, b in zip(straight, resumed))


@pytest.mark.parametrize("name, decays_in_loss", [("sgd", True), ("adamw", False), ("lamb", False)])
def test_the_built_in_loss_leaves_decay_to_decoupled_optimizers(name, decays_in_loss):
    """The built-in loop's loss (compute.Backprop) adds wd/2 |w|^2 only where the optimizer does not
    decay the weights itself, so none is decayed twice."""
    cfg = load_config(RECIPES / "digits.toml", [f"optim.name={name}", "optim.weight_decay=0.5"])
    model = torch.nn.Linear(4, 3)
    x, y = torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1])
    loss, _ = Backprop(cfg, model, build_optimizer(cfg.optim, model.parameters()))((x, y))
    plain = torch.nn.functional.cross_entropy(model(x), y)
    l2 = 0.25 * model.weight.detach().pow(2).sum()
    assert_close(loss, plain.detach() + (l2 if decays_in_loss else 0))


@pytest.mark.parametrize("name, key, reads", [("sgd", "beta1=0.8", False), ("adamw", "trust_coefficient=0.01", False),
                                              ("rmsprop-tf", "adaptive_eps=1e-6", False), ("lamb", "beta2=0.99", True),
                                              ("lars", "trust_coefficient=0.01", True), ("adamw", "momentum=0.5", False),
                                              ("sgd", "decay=0.5", False), ("lamb", "eps=0.5", False),
                                              ("rmsprop-tf", "momentum=0.5", True)])
def test_a_key_the_optimizer_does_not_read_is_refused(name, key, reads):
    """A key set for another optimizer would do nothing: refused in one line naming it."""
    sets = [f"optim.name={name}", f"optim.{key}"]
    if reads:
        load_config(RECIPES / "digits.toml", sets)
        return
    with pytest.raises(ConfigError, match=rf"optim\.{key.split('=')[0]} = .*does not read it"):
        load_config(RECIPES / "digits.toml", sets)
