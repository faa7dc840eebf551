"""``python -m fastdp.bench``; see ``fastdp.bench.cli``."""

from fastdp.bench.cli import main

if __name__ == "__main__":
    main()
