"""Data sources are a table: a built-in source is one row in recipe_values.SOURCES (what its keys
must say) and one in data/build.py's SOURCES (how it is made and checked), nothing else."""

import torch

from scaletrain import recipe_values
from scaletrain.config import load_config
from scaletrain.data import build
from scaletrain.data.sources import TensorDataset

from conftest import RECIPES


def test_both_tables_name_the_same_sources():
    assert set(recipe_values.SOURCES) == set(build.SOURCES)


def test_a_source_added_by_its_two_rows_is_accepted_checked_and_built(monkeypatch):
    def make(cfg, run_dir=None, check=True):
        images = torch.zeros(8, cfg.data.image_size, cfg.data.image_size, 3, dtype=torch.uint8)
        data = TensorDataset(images, torch.arange(8) % 2, ((0.5,) * 3, (0.25,) * 3))
        return data, data, ["a", "b"]

    checked = []
    monkeypatch.setitem(recipe_values.SOURCES, "tiny", "")
    monkeypatch.setitem(build.SOURCES, "tiny", build.Source(make, lambda cfg, run_dir: checked.append(cfg.data.name)))
    cfg = load_config(RECIPES / "digits.toml", ["data.name=tiny", "model.num_classes=2"])
    build.check_data(cfg)
    train, test, classes = build.build_datasets(cfg)
    assert checked == ["tiny"] and len(train) == 8 and classes == ["a", "b"]
