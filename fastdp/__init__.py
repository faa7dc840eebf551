"""fastdp: a faster, swap-in replacement for ``torch.nn.DataParallel``."""

import torch  # noqa: F401  (before the extension)

from fastdp._version import __version__

__all__ = ["__version__"]
