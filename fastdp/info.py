"""``python -m fastdp.info``: the same as ``python -m fastdp info`` (``fastdp/commands/info.py``).

Imported, the name is the function: this module puts ``fastdp.info`` in its own place in
``sys.modules``, so ``import fastdp.info`` binds the function, as ``import fastdp`` does.
"""

import sys

from fastdp.commands.info import info, main

if __name__ == "__main__":
    sys.exit(main())
sys.modules[__name__] = info
