"""Microbenchmarks of fastdp: ``python -m fastdp.bench`` (see ``bench/README.md``)."""
