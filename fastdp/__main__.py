"""``python -m fastdp COMMAND [args]``: the command line (``fastdp/commands/__init__.py``)."""

import sys

from fastdp.commands import main

sys.exit(main())
