"""scaletrain: data-parallel CNN training across GPUs and nodes, and the study of how it scales."""

__version__ = "0.1.0"
