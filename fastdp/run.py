"""``python -m fastdp run [options] (script.py | -m module) [args ...]``: run an unchanged script
with ``torch.nn.DataParallel`` replaced by FastDataParallel (``fastdp.install``), as
``python -m torch.distributed.run`` runs one under DDP. ``python -m fastdp.run`` is the same.

The script runs as ``python script.py args`` runs it: ``sys.argv`` is ``[script.py, args ...]``,
``sys.path[0]`` is the script's folder (its sibling modules import), ``__name__`` is
``"__main__"``; ``-m module`` runs a module as ``python -m module`` does. The options only give
defaults to the ``nn.DataParallel`` the script builds: they do not make it build one (HF Trainer
wraps only when it sees more than one CUDA device), and when the script ends without having built
one, a line on stderr says so.

examples:
  python -m fastdp run --device-ids 0,1,2,3 train.py --epochs 3
  python -m fastdp run --device-ids 0,1 --scalar-outputs mean -m my_package.train --lr 1e-3
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from typing import Any

import torch

from fastdp.install import install

_VALUED = ("--device-ids", "--launch", "--scalar-outputs")  # options followed by a value


def _device_ids(text: str) -> list[Any]:
    return [d if d == "cpu" or d.startswith("cuda") else int(d) for d in text.split(",") if d]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m fastdp run",
        description=__doc__.split("\n\nexamples:")[0],
        epilog="examples:" + __doc__.split("examples:")[1],
        usage="%(prog)s [options] (script.py | -m module) [args ...]",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--device-ids",
        type=_device_ids,
        default=None,
        help="replica devices for every nn.DataParallel the script builds without "
        "device_ids: '0,1,2,3', or 'cpu,cpu' (CPU replicas)",
    )
    p.add_argument(
        "--launch",
        choices=("auto", "threads", "inline"),
        default=None,
        help="how the replicas' forwards run (FastDataParallel's launch=)",
    )
    p.add_argument(
        "--scalar-outputs",
        choices=("stack", "mean", "sum"),
        default=None,
        help="how per-replica losses are gathered (FastDataParallel's scalar_outputs=; "
        "default stack, DataParallel's vector: right for HF Trainer)",
    )
    p.add_argument(
        "-m",
        dest="module",
        metavar="module",
        help="run a module as `python -m module` does; what follows are its arguments",
    )
    p.add_argument("script", nargs="?", help="the Python script to run (or -m module)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    return p


def _split(argv: list[str]) -> tuple[list[str], list[str]]:
    """fastdp's options, then the target and its arguments (the first ``-m`` or non-option)."""
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--":
            return argv[:i], argv[i + 1 :]
        if a == "-m" or (a.startswith("-m") and not a.startswith("--")) or not a.startswith("-"):
            return argv[:i], argv[i:]
        i += 2 if a in _VALUED else 1
    return argv, []


def parse(argv: list[str]) -> tuple[argparse.Namespace, str | None, list[str]]:
    """(fastdp's options, the module to run or None for a script, the new ``sys.argv``)."""
    p = _parser()
    ours, target = _split(argv)
    ns = p.parse_args(ours)
    if not target:
        p.error("give the script to run, or -m module")
    if target[0].startswith("-m"):
        module = target[0][2:] or (target[1] if len(target) > 1 else None)
        if not module:
            p.error("-m needs a module name")
        rest = target[1:] if target[0] != "-m" else target[2:]
        return ns, module, [module, *rest]
    return ns, None, list(target)


def _why_no_dataparallel() -> str:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return (
        "fastdp.run: no nn.DataParallel was built, so nothing ran on replicas: the script "
        "never constructed one (HF Trainer and most scripts wrap the model only when they see "
        f"more than one CUDA device and were not started by torchrun; this machine has {gpus})"
    )


def _run_script(path: str) -> None:
    # `python script.py` puts the script's folder (symlinks resolved) first on sys.path; `-m`
    # put the working directory there.
    sys.path[0] = os.path.dirname(os.path.realpath(path)) if os.path.isfile(path) else path
    runpy.run_path(path, run_name="__main__")


def main(argv: list[str] | None = None) -> None:
    ns, module, script_argv = parse(sys.argv[1:] if argv is None else argv)
    defaults = {
        k: v
        for k, v in (
            ("device_ids", ns.device_ids),
            ("launch", ns.launch),
            ("scalar_outputs", ns.scalar_outputs),
        )
        if v is not None
    }
    cls = install(**defaults).cls
    sys.argv = script_argv
    ended = False
    try:
        if module is None:
            _run_script(script_argv[0])
        else:  # sys.argv[0] becomes the module's file, as with `python -m`
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        ended = True
    except SystemExit:
        ended = True
        raise
    finally:
        if ended and cls.fastdp_built == 0:
            print(_why_no_dataparallel(), file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
