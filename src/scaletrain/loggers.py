"""Where the chief's metrics rows go: metrics.jsonl always, and the loggers train.loggers names.

A logger is a class called with the run directory, with two methods: `row(kind, step, **values)`
for each row (kind "train" or "eval"; values as metrics.jsonl has them, its `time` included) and
`close()` at the end of the run. train.loggers names them: a built-in one by its name (LOGGERS) or
a class of yours by import path, "package.module:Class" (docs/training.md, "Loggers: add your own").

metrics.jsonl is not one of the choices: the report, the plots, the statistical model and the
launcher's restart line read it, so it is written whatever the key says ("jsonl" in the list is
allowed and changes nothing). This module imports no torch: config validation reads LOGGERS and
parse_loggers; TensorBoard's writer is imported only where a run writes events.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from .errors import ConfigError
from .imports import import_path, is_import_path, one_line

ALWAYS = "jsonl"  # metrics.jsonl: read by other parts of the project, never left out


class Logger:
    """The interface: one row at a time, then close. Subclassing it is optional: any class with
    these two methods, called with the run directory, will do."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir

    def row(self, kind: str, step: int, **values: Any) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class JsonLines(Logger):
    """RUN_DIR/metrics.jsonl, one JSON object a row, appended (a resumed run goes on in the same file)."""

    def __init__(self, run_dir: Path) -> None:
        super().__init__(run_dir)
        self.fh = open(run_dir / "metrics.jsonl", "a", buffering=1)  # line-buffered: a crash keeps rows

    def row(self, kind: str, step: int, **values: Any) -> None:
        self.fh.write(json.dumps({"kind": kind, "step": step, **values}) + "\n")

    def close(self) -> None:
        self.fh.close()


class TensorBoard(Logger):
    """RUN_DIR/tb/: each numeric value of a row as the scalar KIND/NAME at its step; the clock's
    readings (epoch, wall, time) are left out, being axes rather than curves."""

    SKIP = ("epoch", "wall", "time")

    def __init__(self, run_dir: Path) -> None:
        super().__init__(run_dir)
        from torch.utils.tensorboard import SummaryWriter  # heavy (tensorboard): only the chief writes events
        self.tb = SummaryWriter(log_dir=str(run_dir / "tb"))

    def row(self, kind: str, step: int, **values: Any) -> None:
        for k, v in values.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in self.SKIP:
                self.tb.add_scalar(f"{kind}/{k}", v, step)

    def close(self) -> None:
        self.tb.close()


# The built-in loggers by name: the one table a name is looked up in. A logger of yours needs no
# entry here: name it by import path.
LOGGERS: dict[str, type] = {ALWAYS: JsonLines, "tensorboard": TensorBoard}


def parse_loggers(value) -> list[str]:
    """train.loggers as given (a list, or one name) -> the names; ValueError saying what is allowed.
    An import path is checked for its form only: config validation runs no user code."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"expected a list of logger names ({', '.join(LOGGERS)}) or import paths "
                         "package.module:Class")
    for v in value:
        if v not in LOGGERS and not is_import_path(v):
            raise ValueError(f"{v!r} is not a logger; choose from {', '.join(LOGGERS)}, or a class of yours "
                             "as package.module:Class")
    return list(dict.fromkeys(value))  # in order, once each


def make_logger(name: str, run_dir: Path):
    """The logger train.loggers' `name` stands for, made for run_dir; ConfigError naming the key and
    the path when a class of yours does not import or fails to start."""
    if name in LOGGERS:
        return LOGGERS[name](run_dir)
    cls = import_path("train.loggers", name)
    try:
        return cls(run_dir)
    except Exception as e:  # noqa: BLE001 - whatever a user's class raises, named in one line
        raise ConfigError(f"train.loggers = {name!r}: {name}(run_dir) failed: {one_line(e)}") from None


class Loggers:
    """The run's loggers, metrics.jsonl first, each given the same row with the same `time`."""

    def __init__(self, run_dir: Path, names: list[str]) -> None:
        self.all: list = []
        try:
            for name in [ALWAYS, *(n for n in names if n != ALWAYS)]:
                self.all.append(make_logger(name, run_dir))
        except BaseException:
            self.close()  # those made so far: no file left open by a refused one
            raise

    def row(self, kind: str, step: int, **values: Any) -> None:
        values = {"time": time.time(), **values}
        for logger in self.all:
            logger.row(kind, step, **values)

    def close(self) -> None:
        for logger in self.all:
            logger.close()
