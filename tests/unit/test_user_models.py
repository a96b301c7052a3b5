"""Your own network by import path (model.name = "package.module:factory", torchvision:NAME,
timm:NAME): the config's forms, every error as one line before any process starts, pretrained
weights, and the performance model's gradient size. The networks are in tests/user_models.py;
tests/ is on sys.path under pytest, so this process imports them."""

import importlib
import importlib.util
import os
import re
import subprocess
import sys
import tomllib

import pytest
import torch
from safetensors.torch import save_file

import user_models
from scaletrain.cli import main
from scaletrain.config import ConfigError, ModelConfig, build_config, dump_toml, load_config
from scaletrain.errors import ModelError, ModelNameError, PretrainedError
from scaletrain.models import build_model, check_network, final_layer, load_pretrained
from scaletrain.models.factory import extra_command, torch_index, torchvision_for
from scaletrain.perfmodel.profile import Profile, dump_profile, load_profile
from scaletrain.perfmodel.setup import check_workload, param_numels

from conftest import RECIPES

PLAIN = "user_models:plain"


def train_args(tmp_path, *sets):
    args = ["train", "--recipe", str(RECIPES / "digits.toml"), "--run-dir", str(tmp_path / "r"), "--quiet"]
    for s in ["data.workers=0", "train.steps=2", *sets]:
        args += ["--set", s]
    return args


@pytest.mark.parametrize("sets, pattern", [
    (["model.name=no_such_package.nets:vgg"], r"model\.name = 'no_such_package\.nets:vgg': module no_such_package\.nets "
     r"does not import: ModuleNotFoundError: No module named 'no_such_package' \(it must be importable"),
    (["model.name=user_models:vgg"], r"model\.name = 'user_models:vgg': module user_models has no attribute 'vgg'"),
    (["model.name=user_models:raises"], r"model\.name = 'user_models:raises': user_models:raises\(num_classes=10\) "
     r"raised ValueError: no network for 10 classes today"),
    (["model.name=user_models:plain", "model.args.depth=11"], r"model\.name = 'user_models:plain': "
     r"user_models:plain\(num_classes=10, depth=11\) raised TypeError: .*unexpected keyword argument 'depth'"),
    (["model.name=user_models:not_a_module"], r"model\.name = 'user_models:not_a_module': "
     r"user_models:not_a_module\(num_classes=10\) returned a list, not a torch\.nn\.Module"),
    (["model.name=user_models:instance"], r"model\.name = 'user_models:instance': user_models:instance is a "
     r"Sequential, not a factory"),
    (["model.name=user_models:wrong_output"], r"model\.name = 'user_models:wrong_output': the network's output for "
     r"a batch of 2 images of 3x16x16 \(data\.image_size = 16\) has shape \(2, 11\); training needs \(2, 10\)"),
    (["model.name=user_models:fixed_size", "data.image_size=8"], r"model\.name = 'user_models:fixed_size': the "
     r"network's forward of a batch of 2 images of 3x8x8 \(data\.image_size = 8\) raised RuntimeError: mat1 and "
     r"mat2 shapes cannot be multiplied"),
    (["model.name=user_models:lazy"], r"model\.name = 'user_models:lazy': user_models:lazy\(num_classes=10\) has "
     r"a lazy module, 2 \(LazyLinear\), whose parameters take their shape at its first forward; .* give its sizes"),
    # a distributed job: found by the launcher, before it starts a process
    (["model.name=user_models:wrong_output", "cluster.nodes=2", "cluster.num_ps=1", "strategy.name=sync"],
     r"model\.name = 'user_models:wrong_output': the network's output .* has shape \(2, 11\)"),
], ids=["no-module", "no-attribute", "raises", "bad-args", "not-a-module", "an-instance", "output-shape",
        "forward-raises", "lazy", "distributed"])
def test_a_network_that_cannot_be_built_is_one_line_before_any_process(tmp_path, capsys, sets, pattern):
    assert main(train_args(tmp_path, *sets)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(pattern, err[0]), err
    assert not (tmp_path / "r").exists()  # no run directory, no process log


@pytest.mark.parametrize("package", ["torchvision", "timm"])
def test_a_missing_optional_package_names_its_install_command(tmp_path, capsys, package):
    """Real, not mocked: neither is installed here (torchvision has no CPU build on these machines,
    and timm needs it)."""
    try:
        importlib.import_module(package)
    except Exception:  # noqa: BLE001 - missing, or installed but broken: either is "does not import"
        pass
    else:
        pytest.skip(f"{package} imports here")
    assert main(train_args(tmp_path, f"model.name={package}:resnet18")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"scaletrain: error: model.name = '{package}:resnet18' needs "), err
    # the command keeps the torch there (its own version pinned) and takes the torchvision made for it;
    # `pip install 'scaletrain[torchvision]'` would replace that torch by PyPI's newest
    v = torch.__version__
    assert err[0].endswith(f"keeping that torch: {extra_command([package], v)}"), err
    assert f"'torch=={v}'" in err[0] and f"'torchvision=={torchvision_for(v)}.*'" in err[0]
    assert "scaletrain[" not in err[0]
    if importlib.util.find_spec(package) is None:
        assert "which is not installed" in err[0], err


def test_the_torchvision_of_a_torch_release():
    assert torchvision_for("2.13.0+cpu") == "0.28" and torchvision_for("2.4.1") == "0.19"
    assert torchvision_for("2.0.1") == "0.15" and torchvision_for("2.5.0a0+872d972e41.nv24.08") == "0.20"
    assert torchvision_for("3.0.0") is None and torchvision_for("1.13.1") is None
    assert torch_index("2.13.0+cpu") == "https://download.pytorch.org/whl/cpu"
    assert torch_index("2.5.1+cu124") == "https://download.pytorch.org/whl/cu124"
    assert torch_index("2.11.0") is None and torch_index("2.5.0a0+872d972e41.nv24.08") is None
    assert extra_command(["torchvision"], "2.5.1+cu124") == (
        "pip install 'torchvision==0.20.*' 'torch==2.5.1+cu124' --extra-index-url https://download.pytorch.org/whl/cu124")
    assert extra_command(["timm"], "2.11.0", replace_torchvision=True) == (
        "pip uninstall -y torchvision && pip install timm 'torchvision==0.26.*' 'torch==2.11.0'")
    # make install-into-env EXTRAS=... runs it with the environment's own pip
    assert extra_command(["torchvision"], "2.11.0", pip="/opt/py/bin/python -m pip") == (
        "/opt/py/bin/python -m pip install 'torchvision==0.26.*' 'torch==2.11.0'")


@pytest.fixture(scope="module")
def wrong_torchvision(tmp_path_factory):
    """A real torchvision built for another torch than this one: PyPI's wheel of the matching release
    (built for PyPI's CUDA torch) beside this CPU build, as a pip install under a constraint leaves it."""
    if not torch.__version__.endswith("+cpu") or importlib.util.find_spec("torchvision") is not None:
        pytest.skip("needs a CPU build of torch without torchvision")
    site = tmp_path_factory.mktemp("site")
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--only-binary=:all:",
                        "--target", str(site), f"torchvision=={torchvision_for(torch.__version__)}.*"],
                       capture_output=True, text=True, timeout=300)
    if r.returncode:
        pytest.skip(f"no torchvision wheel to be had: {r.stderr.strip()[-300:]}")
    return site


def test_a_torchvision_built_for_another_torch_is_told_apart_with_its_fix(tmp_path, wrong_torchvision):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(wrong_torchvision), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-m", "scaletrain.cli", *train_args(tmp_path, "model.name=torchvision:resnet18")],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1, r.stderr
    v = torch.__version__
    assert "needs torchvision, which is installed but does not import against torch " + v in err[0], err
    assert "operator torchvision::nms does not exist" in err[0]
    assert err[0].endswith(f"keeping that torch: pip uninstall -y torchvision && {extra_command(['torchvision'], v)}")


def test_the_core_imports_neither_optional_package():
    """Where they are installed too: only a name that asks for one imports it."""
    out = subprocess.run([sys.executable, "-c", "import scaletrain.cli, scaletrain.models.factory, sys; "
                          "print(' '.join(sys.modules))"], capture_output=True, text=True, check=True)
    assert not {"torchvision", "timm"} & set(out.stdout.split())


@pytest.mark.parametrize("sets, pattern", [
    ([f"model.name={PLAIN}", "model.norm=group"], r"model\.norm = 'group': shapes the built-in ResNets only; "
     r"model\.name = 'user_models:plain' is your own network"),
    ([f"model.name={PLAIN}", "model.width=32"], r"model\.width = 32: shapes the built-in ResNets only"),
    (["model.name=resnet8", "model.args.width=4"], r"model\.args = \{'width': 4\}: the keyword arguments of an "
     r"import-path model\.name's factory; model\.name = 'resnet8' is built-in"),
    (["model.name=resnet9"], r"model\.name = 'resnet9': not a built-in network \(resnet8, resnet20, resnet18, "
     r"resnet50\) nor an import path package\.module:factory, torchvision:NAME or timm:NAME"),
    (["model.name=user_models:"], r"model\.name = 'user_models:': not a built-in network"),
    (["model.name=my nets:vgg"], r"model\.name = 'my nets:vgg': not a built-in network"),
    (["model.args=3"], r"model\.args = 3: expected dict"),
])
def test_model_keys_of_the_other_kind_of_network_are_errors(sets, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(RECIPES / "digits.toml", sets)


def test_model_args_from_a_table_and_from_set(tmp_path):
    recipe = tmp_path / "mine.toml"
    recipe.write_text(f'[model]\nname = "{PLAIN}"\nnum_classes = 10\n\n[model.args]\nwidth = 4\n\n'
                      '[data]\nimage_size = 16\n')
    cfg = load_config(recipe)
    assert cfg.model.args == {"width": 4}
    # --set adds or replaces one key of the table, keeping the others
    assert load_config(recipe, ["model.args.depth=2"]).model.args == {"width": 4, "depth": 2}
    assert load_config(recipe, ["model.args.width=6"]).model.args == {"width": 6}
    assert load_config(recipe, ["model.args={}"]).model.args == {}
    # the resolved config.toml writes it back as a [model.args] table; replace() takes a dict
    assert "[model.args]\nwidth = 4" in dump_toml(cfg)
    assert build_config(tomllib.loads(dump_toml(cfg))) == cfg
    assert cfg.replace(**{"model.args": {"width": 2, "a b": [1, 2]}}).model.args == {"width": 2, "a b": [1, 2]}
    with pytest.raises(ConfigError, match=r"key must be SECTION\.KEY .* \(or .*model\.args\.NAME.*\)"):
        load_config(recipe, ["model.num_classes.x=2"])


def test_keys_shows_the_import_path_forms(capsys):
    assert main(["keys"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert "package.module:factory" in lines["model.name"] and "torchvision:NAME" in lines["model.name"]
    assert "timm:NAME" in lines["model.name"] and "pip" not in lines["model.name"]
    assert "[model.args]" in lines["model.args"] and "--set model.args.KEY=VALUE" in lines["model.args"]


def test_factory_gets_num_classes_and_args():
    net = build_model(ModelConfig(name=PLAIN, num_classes=7, args={"width": 4}))
    assert net[0].out_channels == 4 and net[-1].out_features == 7
    check_network(load_config(RECIPES / "digits.toml", [f"model.name={PLAIN}", "model.args.width=4"]))
    before = torch.random.get_rng_state()
    check_network(load_config(RECIPES / "digits.toml", ["model.name=user_models:batchnorm"]))
    assert torch.equal(torch.random.get_rng_state(), before)  # the caller's random state, untouched


def test_init_from_round_trip(tmp_path):
    """A user network's weights, saved under the names its state_dict has, load back exactly."""
    torch.manual_seed(1)
    src = build_model(ModelConfig(name="user_models:batchnorm", num_classes=10))
    src.features[1].running_mean.add_(1.0)  # a buffer too
    save_file(src.state_dict(), str(tmp_path / "w.safetensors"))
    torch.save({"model": src.state_dict()}, tmp_path / "w.pt")
    for f in ("w.safetensors", "w.pt"):
        torch.manual_seed(2)
        dst = build_model(ModelConfig(name="user_models:batchnorm", num_classes=10, init_from=str(tmp_path / f)))
        assert dst.state_dict().keys() == src.state_dict().keys()
        assert all(torch.equal(a, b) for a, b in zip(dst.state_dict().values(), src.state_dict().values()))


def test_only_the_final_layers_class_dimension_is_reinitialised(tmp_path):
    """The rule: the final layer is the module of the model's last parameter; its tensors may differ
    from the file's in their first dimension only, which must be model.num_classes."""
    assert final_layer(user_models.plain(10)) == "10" and final_layer(user_models.batchnorm(10)) == "classifier"
    torch.manual_seed(0)
    src = user_models.batchnorm(10).state_dict()
    save_file(src, str(tmp_path / "ten.safetensors"))
    dst = user_models.batchnorm(7)
    head = dst.classifier.weight.clone()
    assert load_pretrained(dst, tmp_path / "ten.safetensors", 7) == ["classifier.weight", "classifier.bias"]
    assert torch.equal(dst.features[0].weight, src["features.0.weight"]) and torch.equal(dst.classifier.weight, head)
    # the final layer's input side differs too (another width): not a class count, an error
    with pytest.raises(PretrainedError, match=r"tensor 'features\.0\.weight' has shape \(8, 3, 3, 3\)"):
        load_pretrained(user_models.batchnorm(7, width=4), tmp_path / "ten.safetensors", 7)
    wide = dict(src, **{"classifier.weight": torch.zeros(10, 32)})
    save_file(wide, str(tmp_path / "wide.safetensors"))
    with pytest.raises(PretrainedError, match=r"tensor 'classifier\.weight' has shape \(10, 32\) .* needs \(7, 16\) "
                                              r"\(only the final layer's class dimension may differ\)"):
        load_pretrained(user_models.batchnorm(7), tmp_path / "wide.safetensors", 7)
    # a first dimension that is not model.num_classes is no class dimension
    with pytest.raises(PretrainedError, match=r"tensor 'classifier\.weight'"):
        load_pretrained(user_models.batchnorm(7), tmp_path / "ten.safetensors", 5)
    # an earlier layer of another class-like size is never re-initialised
    bad = dict(src, **{"features.0.weight": torch.zeros(3, 3, 3, 3)})
    save_file(bad, str(tmp_path / "bad.safetensors"))
    with pytest.raises(PretrainedError, match=r"tensor 'features\.0\.weight'"):
        load_pretrained(user_models.batchnorm(10), tmp_path / "bad.safetensors", 10)


def test_gradient_size_is_the_user_networks():
    """perfmodel's param_numels builds what the job builds, on the meta device where it can."""
    for name, args in ((PLAIN, {"width": 4}), ("user_models:batchnorm", {}), ("user_models:reads_values", {})):
        cfg = ModelConfig(name=name, num_classes=10, args=args)
        assert param_numels(cfg) == [p.numel() for p in build_model(cfg).parameters()], name
    with pytest.raises(ModelNameError, match="does not import"):
        param_numels(ModelConfig(name="no_such_package:vgg", num_classes=10))


def test_a_profile_is_for_one_network_and_its_args(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text(dump_profile(Profile(model=PLAIN, model_args={"width": 4}, image_size=16, gradient_bytes=2584),
                                 {}))
    prof, _ = load_profile(path)
    assert prof.model_args == {"width": 4}
    check_workload(load_config(RECIPES / "digits.toml", [f"model.name={PLAIN}", "model.args.width=4"]), prof, path)
    with pytest.raises(ModelError, match=r"measured for user_models:plain \{'width': 4\}, 16 px; the recipe trains "
                                         r"user_models:plain, 16 px"):
        check_workload(load_config(RECIPES / "digits.toml", [f"model.name={PLAIN}"]), prof, path)
