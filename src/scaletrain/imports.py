"""Objects a recipe names by import path, "package.module:attr" (a user's network or dataset factory,
an optimizer class).

The path is checked for its form when the config is read (no import then: config validation
loads no torch and no user code), and imported where it is used; every failure is a ConfigError
of one line naming the key and the path, with the message of what went wrong.
"""

from __future__ import annotations

import importlib
import re

from .errors import ConfigError

_NAME = r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*"
FORM = re.compile(rf"{_NAME}:{_NAME}")


def is_import_path(text) -> bool:
    """Whether text has the form package.module:attr (attr may be dotted: module:Class.method)."""
    return isinstance(text, str) and FORM.fullmatch(text) is not None


def one_line(e: BaseException) -> str:
    """An exception as `Type: message`, its lines joined: an error of ours is one line."""
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def import_path(key: str, path: str, error: type[ConfigError] = ConfigError):
    """The object `path` (package.module:attr) names; `error` (a ConfigError) naming `key` and the
    path when the module does not import or has no such attribute."""
    module, _, attr = path.partition(":")
    try:
        obj = importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - whatever the module raises on import, named in one line
        raise error(f"{key} = {path!r}: module {module} does not import: {one_line(e)} "
                          "(it must be importable where the job runs, on every node: installed or on "
                          "PYTHONPATH)") from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise error(f"{key} = {path!r}: module {module} has no attribute {attr!r}") from None
    return obj


def name_or_path(names: tuple[str, ...], what: str):
    """A config key's parser (config.opt's parse) for a key that takes one of `names` or an import path:
    the value itself, or ValueError saying both forms. Only the form is checked: config imports nothing."""
    def parse(value):
        if not isinstance(value, str) or value in names or is_import_path(value):
            return value  # not a string: the type check says so
        raise ValueError(f"not {what} ({', '.join(names)}) nor an import path package.module:Class")
    return parse
