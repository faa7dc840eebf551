"""fastdp: a faster, swap-in replacement for ``torch.nn.DataParallel``."""

import torch  # noqa: F401  (before the extension)

from fastdp._info import info
from fastdp._version import __version__
from fastdp.data_parallel import FastDataParallel, data_parallel

__all__ = ["FastDataParallel", "data_parallel", "info", "__version__"]
