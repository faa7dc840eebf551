"""``python -m fastdp info``: what fastdp was built with and which path each stage takes.

``fastdp.info()`` returns the same as a dict; this module is callable as that function
(``fastdp/_callable.py``).
"""

from __future__ import annotations

import argparse
import json

from fastdp._callable import callable_module
from fastdp._info import format_info, info


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fastdp info", description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print the dict as JSON")
    args = p.parse_args(argv)
    d = info()
    print(json.dumps(d, indent=1, default=str) if args.json else format_info(d))
    return 0


callable_module(__name__, info)

if __name__ == "__main__":
    main()
