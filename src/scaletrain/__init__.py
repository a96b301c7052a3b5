"""scaletrain: data-parallel CNN training across GPUs and nodes, and the study of how it scales.

`scaletrain.train`, `scaletrain.Job`, `scaletrain.Config`, `scaletrain.load_config` and
`scaletrain.build_model` are the Python API (api.py). They load on first use: `import scaletrain.config` and the command line's
light commands need no torch.
"""

import importlib

__version__ = "0.1.0"
__all__ = ["Config", "Job", "build_model", "load_config", "train"]


def __getattr__(name: str):
    if name in __all__:
        return getattr(importlib.import_module("scaletrain.api"), name)
    raise AttributeError(f"module 'scaletrain' has no attribute {name!r}")
