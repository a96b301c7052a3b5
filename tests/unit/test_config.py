import subprocess
import tomllib

import pytest

from scaletrain.config import Config, ConfigError, build_config, dump_toml, field_docs, load_config

from conftest import RECIPES, scaletrain_cmd


def test_recipes_load_and_round_trip():
    for recipe in RECIPES.glob("*.toml"):
        cfg = load_config(recipe)
        assert build_config(tomllib.loads(dump_toml(cfg))) == cfg


def test_full_recipe_is_the_study_setup():
    c = load_config(RECIPES / "anp-resnet50.toml")
    assert (c.model.name, c.model.num_classes, c.data.image_size, c.data.batch_size) == ("resnet50", 1200, 224, 32)
    assert (c.optim.name, c.optim.lr, c.optim.decay, c.optim.eps, c.optim.weight_decay) == (
        "rmsprop-tf", 0.1, 0.9, 1.0, 1e-4)
    assert c.data.augment == ["resized-crop", "flip"] and c.data.name == "manifest"


def test_required_keys_exist_and_are_documented():
    docs = field_docs()
    for key in ["model.name", "model.num_classes", "model.norm", "model.init_from", "data.name", "data.root",
                "data.image_size", "data.batch_size", "data.augment", "data.on_bad_image", "optim.name",
                "optim.lr", "optim.weight_decay", "train.steps", "train.epochs", "train.seed",
                "train.deterministic", "train.eval_every", "train.checkpoint_every"]:
        assert docs[key].strip(), key


def test_overrides_are_typed():
    c = load_config(RECIPES / "digits.toml", ["train.steps=7", "data.augment=crop+flip", "optim.lr=1",
                                               "train.deterministic=true"])
    assert c.train.steps == 7 and c.data.augment == ["crop", "flip"]
    assert c.optim.lr == 1.0 and isinstance(c.optim.lr, float) and c.train.deterministic is True


@pytest.mark.parametrize("override, pattern", [
    ("model.colour=red", r"unknown key model\.colour in --set 'model.colour=red'; model keys are name, num_classes"),
    ("modle.name=resnet8", r"key must be SECTION\.KEY"),
    ("model.norm=layer", r"model\.norm = 'layer': not allowed; choose one of batch, group"),
    ("data.batch_size=0", r"data\.batch_size = 0: out of range \[1, 4096\]"),
    ("train.steps=ten", r"train\.steps = 'ten': expected int"),
    ("train.deterministic=1", r"train\.deterministic = 1: expected bool"),
    ("optim.lr=-0.1", r"optim\.lr = -0\.1: out of range"),
])
def test_bad_values_name_key_value_and_allowed(override, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(RECIPES / "digits.toml", [override])


def test_unknown_section_and_missing_recipe(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[modle]\nname = 'resnet8'\n")
    with pytest.raises(ConfigError, match=r"unknown section \[modle\]"):
        load_config(bad)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.toml")
    bad.write_text("[model\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)
    with pytest.raises(ConfigError, match=f"recipe {tmp_path} is a directory"):
        load_config(tmp_path)
    bad.write_bytes(b"\xff\xfe[model]\n")
    with pytest.raises(ConfigError, match=f"recipe {bad} cannot be read"):
        load_config(bad)


def test_relations_checked():
    with pytest.raises(ConfigError, match="data.root is empty"):
        build_config({"data": {"name": "manifest"}})
    from scaletrain.proc.env import plan_for
    from scaletrain.plan import PlanError

    with pytest.raises(PlanError, match=r"cluster.min_nodes = 1 below cluster.nodes = 3: .* not defined for "
                                        r"strategy.name = 'sync'"):
        plan_for(build_config({"cluster": {"nodes": 3, "num_ps": 1, "min_nodes": 1}, "strategy": {"name": "sync"}}))
    with pytest.raises(ConfigError, match="cluster.min_nodes = 4: above cluster.nodes = 3"):
        build_config({"cluster": {"nodes": 3, "min_nodes": 4}})
    assert build_config({"cluster": {"nodes": 3, "min_nodes": 2}}).cluster.min_nodes == 2


def test_config_is_frozen():
    with pytest.raises(Exception):
        Config().train.steps = 3  # type: ignore[misc]


@pytest.mark.parametrize("override", ["model.colour=red", "data.batch_size=-3"])
def test_cli_exits_2_with_one_line_before_work(tmp_path, override, env):
    run_dir = tmp_path / "run"
    p = subprocess.run(scaletrain_cmd("train", "--recipe", str(RECIPES / "digits.toml"), "--set", override,
                                      "--run-dir", str(run_dir)), capture_output=True, text=True, env=env)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and override.split("=")[0] in lines[0], p.stderr
    assert not run_dir.exists()  # nothing started


def test_survive_loss_is_refused_where_it_cannot_act():
    for sets, said in (({"cluster": {"nodes": 1}}, "a job of one node has no node to go on without"),
                       ({"parallel": {"stages": 2}, "cluster": {"gpus_per_node": 2}}, "parallel.stages = 2")):
        cfg = {"cluster": {"nodes": 3, "survive_loss": True}}
        for k, v in sets.items():
            cfg[k] = {**cfg.get(k, {}), **v}
        with pytest.raises(ConfigError, match=said):
            build_config(cfg)
    assert build_config({"cluster": {"nodes": 3, "survive_loss": True}}).cluster.survive_loss


def test_replacements_need_a_job_that_heals_in_place():
    for cluster, strategy in (({"nodes": 3, "replacements": 2}, "allreduce"),
                              ({"nodes": 3, "replacements": 2, "survive_loss": True, "num_ps": 1}, "sync")):
        with pytest.raises(ConfigError, match="cluster.replacements = 2: .* set cluster.survive_loss = true, with "
                                              "strategy allreduce, local-sgd, diloco$"):
            build_config({"cluster": cluster, "strategy": {"name": strategy}})
    assert build_config({"cluster": {"nodes": 3, "replacements": 2, "survive_loss": True}}).cluster.replacements == 2
    with pytest.raises(ConfigError, match="cluster.after_loss = 'keep-batch': acts where the replicas' group re-forms"):
        build_config({"cluster": {"nodes": 3, "after_loss": "keep-batch"}})
    with pytest.raises(ConfigError, match="cluster.after_loss"):
        build_config({"cluster": {"nodes": 3, "survive_loss": True, "after_loss": "bigger"}})
