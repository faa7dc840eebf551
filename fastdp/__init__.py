"""fastdp: a faster, swap-in replacement for ``torch.nn.DataParallel``."""

import torch  # noqa: F401  (before the extension)

from fastdp._state_dict import unwrap
from fastdp._version import __version__
from fastdp.commands.info import info
from fastdp.criterion import ParallelCriterion
from fastdp.data_parallel import FastDataParallel, data_parallel
from fastdp.distributed import shard_batch, wrap
from fastdp.install import install, installed, uninstall
from fastdp.scatter_gather import Scattered
from fastdp.zero_optimizer import ZeroRedundancyOptimizer

__all__ = [
    "FastDataParallel",
    "data_parallel",
    "info",
    "doctor",
    "__version__",
    "Scattered",
    "ParallelCriterion",
    "unwrap",
    "wrap",
    "shard_batch",
    "install",
    "uninstall",
    "installed",
    "ZeroRedundancyOptimizer",
]


def __getattr__(name: str):
    """``fastdp.doctor``: the function of ``fastdp/commands/doctor.py``, imported on first use (a
    command, above the package in docs/how-it-works.md's layers, and its checks import the
    package)."""
    if name == "doctor":
        import importlib

        return importlib.import_module("fastdp.commands.doctor").doctor
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
