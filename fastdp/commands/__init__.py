"""``python -m fastdp COMMAND [args]``: fastdp's command line.

commands:
  info     what was built, the accelerator, which path each stage takes (python -m fastdp info)
  doctor   prove this machine's paths against torch's, one line per check; the first command to
           run on a new machine
  run      run an unchanged script with nn.DataParallel replaced by FastDataParallel
  bench    benchmarks against nn.DataParallel and the bare module (table, JSON, plots)

`python -m fastdp COMMAND --help` describes each; `python -m fastdp.COMMAND` is the same command.
"""

from __future__ import annotations

import importlib
import sys

# Each command is a module with ``main(argv) -> int``; ``fastdp/__main__.py`` calls ``main``.
COMMANDS = {
    "info": "fastdp.commands.info",
    "doctor": "fastdp.commands.doctor",
    "run": "fastdp.run",
    "bench": "fastdp.bench.cli",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: python -m fastdp {{{','.join(COMMANDS)}}} [args ...]\n\n{__doc__}")
        return 0 if argv else 2
    if argv[0] not in COMMANDS:
        print(
            f"python -m fastdp: unknown command {argv[0]!r}; choose from {', '.join(COMMANDS)}",
            file=sys.stderr,
        )
        return 2
    rc = importlib.import_module(COMMANDS[argv[0]]).main(argv[1:])
    return rc if isinstance(rc, int) else 0
