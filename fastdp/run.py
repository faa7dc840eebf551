"""``python -m fastdp.run [options] script.py [args...]``: run an unchanged script with
``torch.nn.DataParallel`` replaced by FastDataParallel (``fastdp.install``), as
``python -m torch.distributed.run`` runs one under DDP.

    python -m fastdp.run --device-ids cpu,cpu train.py --epochs 3   # try a multi-GPU script
    python -m fastdp.run --device-ids 0,1,2,3 --scalar-outputs mean train.py
"""

from __future__ import annotations

import argparse
import runpy
import sys
from typing import Any

from fastdp.install import install


def _device_ids(text: str) -> list[Any]:
    return [d if d == "cpu" or d.startswith("cuda") else int(d) for d in text.split(",") if d]


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(prog="python -m fastdp.run", description=__doc__.splitlines()[0])
    p.add_argument("--device-ids", type=_device_ids, default=None,
                   help="replica devices for every nn.DataParallel the script builds without "
                        "device_ids: 'cpu,cpu' (CPU replicas) or '0,1,2,3'")
    p.add_argument("--launch", choices=("auto", "threads", "inline"), default=None)
    p.add_argument("--scalar-outputs", choices=("stack", "mean", "sum"), default=None,
                   help="how per-replica losses are gathered (see FastDataParallel)")
    p.add_argument("script", help="the Python script to run")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    ns = p.parse_args(argv)
    return ns, [ns.script, *ns.args]


def main(argv: list[str] | None = None) -> None:
    ns, script_argv = parse(sys.argv[1:] if argv is None else argv)
    defaults = {k: v for k, v in (("device_ids", ns.device_ids), ("launch", ns.launch),
                                  ("scalar_outputs", ns.scalar_outputs)) if v is not None}
    install(**defaults)
    sys.argv = script_argv
    runpy.run_path(ns.script, run_name="__main__")


if __name__ == "__main__":
    main()
