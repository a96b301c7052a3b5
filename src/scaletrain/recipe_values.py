"""The values a recipe's keys accept beyond their type: data.augment's names, data.name's
sources, model.name's networks, and the parsers that turn what a recipe writes into them (each
raises ValueError saying what is allowed; config.py adds the key). Torch-free, as config is."""

from __future__ import annotations

from .imports import is_import_path


# data.augment's names, in the order they are applied (data/augment.py says what each does).
AUGMENTATIONS = ("resized-crop", "crop", "flip", "rotation", "lens", "vignetting", "color")


def parse_augment(value) -> list[str]:
    """data.augment as given (a list, false, or a string such as "crop+flip" or "none") -> the
    names, in the order of AUGMENTATIONS; ValueError naming what is not known."""
    if value is False or value is None:
        return []
    if isinstance(value, str):
        value = [] if value.strip() in ("", "none") else value.replace("+", ",").split(",")
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"expected a list of names from {', '.join(AUGMENTATIONS)}, or false")
    names = [v.strip() for v in value]
    unknown = [n for n in names if n not in AUGMENTATIONS]
    if unknown:
        raise ValueError(f"{unknown[0]!r} is not an augmentation; choose from {', '.join(AUGMENTATIONS)}")
    return [n for n in AUGMENTATIONS if n in names]


# data.name's built-in sources, one row each: what its data.root must name ("" for a source that reads
# no files of its own). data/build.py's SOURCES makes and checks each; those two rows are the whole of a
# source's registration. Any other name is a user's factory, package.module:factory (data/user.py).
SOURCES = {"digits": "", "synthetic": "", "imagefolder": "directory root/CLASS/*.jpg", "manifest": "CSV manifest",
           "shards": "directory written by scaletrain pack"}
DATA_SOURCES = tuple(SOURCES)


def parse_data_name(value):
    """data.name as given -> itself, when it is a built-in source or has the form package.module:factory;
    ValueError naming what is allowed. Not imported here: config validation runs no user code."""
    if isinstance(value, str) and value not in SOURCES and not is_import_path(value):
        raise ValueError(f"not a dataset; choose one of {', '.join(SOURCES)}, or a factory of your own "
                         "as package.module:factory")
    return value


def parse_lines(value) -> list[str]:
    """cluster.setup as given (a list of strings, or one string) -> the lines."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and "\n" not in v for v in value):
        raise ValueError("expected a list of shell lines (strings without a newline)")
    return [v.strip() for v in value if v.strip()]


# model.name's built-in networks (models/resnet.py); any other name is an import path (models/factory.py).
MODELS = ("resnet8", "resnet20", "resnet18", "resnet50")
# model.name's prefixes that name a network of an optional package, each installed by the extra of its name.
MODEL_EXTRAS = ("torchvision", "timm")


def parse_model_name(value):
    """model.name as given -> itself, when it is a built-in network or an import path of the form
    package.module:factory, torchvision:NAME or timm:NAME; ValueError saying the forms otherwise.
    Only the form is checked here (no import: config loads no torch); models/factory.py builds it."""
    if not isinstance(value, str) or value in MODELS:
        return value  # not a string: the type check says so
    prefix, colon, attr = value.partition(":")
    if colon and (prefix in MODEL_EXTRAS and attr and not any(c.isspace() for c in attr)
                  or is_import_path(value)):
        return value
    raise ValueError(f"not a built-in network ({', '.join(MODELS)}) nor an import path "
                     "package.module:factory, torchvision:NAME or timm:NAME")
