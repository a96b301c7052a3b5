"""train.loggers: a logger of one's own, named by import path, gets the rows metrics.jsonl gets;
a name or path that is not a logger is one line naming the key."""

import json

import pytest

from scaletrain.api import train
from scaletrain.config import ConfigError


class Capture:
    """A user's logger: each row it is given, as JSON, in a file of its own in the run directory."""

    def __init__(self, run_dir):
        self.fh = open(run_dir / "captured.jsonl", "w")

    def row(self, kind, step, **values):
        self.fh.write(json.dumps({"kind": kind, "step": step, **values}) + "\n")

    def close(self):
        self.fh.close()


def rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_logger_by_import_path_gets_the_rows_of_metrics_jsonl(tmp_path, digits_cfg):
    cfg = digits_cfg("train.steps=4", "train.log_every=1", "train.eval_every=2", "train.warmup_log_steps=0",
                     "train.loggers=['test_loggers:Capture']")
    train(cfg, run_dir=tmp_path / "run", progress=False)
    written = rows(tmp_path / "run" / "metrics.jsonl")
    assert [r["kind"] for r in written].count("eval") == 2 and len(written) == 6
    assert rows(tmp_path / "run" / "captured.jsonl") == written
    assert not (tmp_path / "run" / "tb").exists()  # tensorboard was not asked for


@pytest.mark.parametrize("path, says", [
    ("no_such_module_here:Logger", "module no_such_module_here does not import"),
    ("test_loggers:Nothing", "module test_loggers has no attribute 'Nothing'"),
    ("test_loggers:Capture.row", "test_loggers:Capture.row(run_dir) failed: TypeError"),
])
def test_a_bad_logger_path_is_one_line_naming_the_key(tmp_path, digits_cfg, path, says):
    cfg = digits_cfg("train.steps=1", f"train.loggers=['{path}']")
    with pytest.raises(ConfigError) as e:
        train(cfg, run_dir=tmp_path / "run", progress=False)
    assert str(e.value).startswith(f"train.loggers = '{path}': ") and says in str(e.value), e.value
    assert "\n" not in str(e.value)


def test_a_name_that_is_not_a_logger_is_refused_with_the_config(digits_cfg):
    with pytest.raises(ConfigError, match=r"^train\.loggers = \['wandb'\]: 'wandb' is not a logger; choose from "
                                          r"jsonl, tensorboard"):
        digits_cfg("train.loggers=['wandb']")
    assert digits_cfg("train.loggers=[]").train.loggers == []  # metrics.jsonl alone, which is always written
