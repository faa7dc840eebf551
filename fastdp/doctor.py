"""``python -m fastdp.doctor [--json FILE] [-k TEXT]``: prove this machine's fastdp paths.

The first thing to run on a new machine; see ``fastdp/_doctor.py`` (``fastdp.doctor()`` returns
the same report as a dict).
"""

import sys

from fastdp._doctor import main

if __name__ == "__main__":
    sys.exit(main())
