"""Microbenchmarks of fastdp: ``python -m fastdp.bench`` (see ``bench/README.md``).

Files: ``workloads`` (torch.nn models and inputs), ``modes`` (bare / nn.DataParallel / fastdp /
fastdp without extension / DataParallel's algorithm, the step and the correctness check),
``timing`` (repeats, call counting), ``runner`` (tasks, error and OOM capture), ``suites_cpu``,
``suites_gpu``, ``report`` (ratios, table, JSON), ``headline`` (the README's tables), ``machine``
(environment), ``plots`` (the PNGs: style and every figure), ``cli`` (the command line).
"""
