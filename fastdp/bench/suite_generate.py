"""The ``generate`` suite: greedy generation with ``FastDataParallel.generate`` on n replicas
against one module on the whole batch (``bare``) and against the chunks one after another
(``floor``), in generated tokens per second; a tiny Llama built from a config (nothing
downloaded). CPU replicas, and the GPUs present (``[0] * n`` on one GPU, every GPU on several).
Modes and fields in bench/README.md, *Suites*.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch

import fastdp
from fastdp.bench import modes, timing
from fastdp.bench.runner import Settings, Task, guarded, record_launch, time_into

# profile -> (batch, prompt tokens, new tokens, hidden size, layers)
SIZES = {
    "tiny": (4, 8, 4, 32, 2),
    "quick": (8, 16, 8, 64, 2),
    "cpu": (16, 32, 16, 128, 4),
    "gpu": (64, 64, 32, 512, 8),
}
VOCAB = 256
WRAPPERS = {  # mode -> FastDataParallel keywords
    "fastdp": {},
    "fastdp_threads": {"launch": "threads"},
    "fastdp_inline": {"launch": "inline"},
    "dp_algo": {"persistent": False, "launch": "threads"},  # DataParallel's threads
}
REFERENCES = {"vs_floor": "floor", "vs_bare": "bare"}


def generate_tasks(s: Settings) -> list[Task]:
    counts = [n for n in s.replicas if n > 1] or [2]
    runs = [("cpu", ["cpu"] * n) for n in counts]
    if torch.cuda.is_available():
        gpus = torch.cuda.device_count()
        runs += [("cuda", list(range(gpus)) if gpus > 1 else [0] * n) for n in counts]
    return [
        Task("generate", f"llama {kind} x{len(ids)}", lambda r=(kind, ids): _run(s, *r))
        for kind, ids in runs
    ]


def _model(s: Settings, device: str) -> torch.nn.Module:
    import transformers

    _, _, _, hidden, layers = SIZES.get(s.profile, SIZES["cpu"])
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=None,  # every row generates max_new_tokens: tokens counted exactly
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval().to(device)


def _run(s: Settings, kind: str, ids: list) -> list[dict]:
    batch, prompt, new, hidden, layers = SIZES.get(s.profile, SIZES["cpu"])
    dev = "cpu" if kind == "cpu" else "cuda:0"
    names = [str(torch.device(i) if kind == "cpu" else torch.device("cuda", i)) for i in ids]
    base = {
        "suite": "generate",
        "workload": f"llama{layers}x{hidden}",
        "input": f"{batch}x{prompt}+{new}",
        "replicas": len(ids),
        "step": "greedy generate",
        "tokens": batch * new,
        "status": "ok",
    }
    recs = {
        m: {**base, "mode": m, "devices": None if m == "bare" else names}
        for m in ("bare", "floor", *WRAPPERS)
    }
    if importlib.util.find_spec("transformers") is None:
        for r in recs.values():
            r.update(status="unsupported", error="needs transformers (pip install transformers)")
        return list(recs.values())
    model = _model(s, dev)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(2, VOCAB, (batch, prompt), generator=g).to(dev)
    kw = {"attention_mask": torch.ones_like(x), "max_new_tokens": new, "do_sample": False}
    chunks = x.chunk(len(ids))
    masks = kw["attention_mask"].chunk(len(ids))

    def bare() -> torch.Tensor:
        return model.generate(x, **kw)

    def floor() -> list[torch.Tensor]:
        return [model.generate(c, **dict(kw, attention_mask=m)) for c, m in zip(chunks, masks)]

    steps: dict[str, Callable[[], object]] = {"bare": bare, "floor": floor}
    calls: dict[str, fastdp.FastDataParallel] = {}
    want = torch.cat([t.to(dev) for t in floor()])
    for m, options in WRAPPERS.items():

        def setup(r: dict, m: str = m, options: dict = options) -> None:
            fdp = calls[m] = fastdp.FastDataParallel(model, device_ids=ids, **options)
            exact = bool(torch.equal(fdp.generate(x, **kw), want))
            r["check"] = {"ok": exact, "equal_to_chunks": exact}
            if not exact:
                r.update(status="check_failed", error="sequences differ from the chunks'")
            steps[m] = lambda: fdp.generate(x, **kw)
            modes.settle(fdp, steps[m])  # auto's trial calls, untimed

        guarded(recs[m], setup)
    time_into(s, steps, recs, timing.cuda_sync(names))
    record_launch(recs, calls)
    _figures(recs, batch * new)
    return list(recs.values())


def _figures(recs: dict[str, dict], tokens: int) -> None:
    """Tokens per second, and each mode's time over the floor's and the bare module's."""

    def med(m: str) -> float | None:
        return (recs[m].get("time_ms") or {}).get("median_ms")

    for m, r in recs.items():
        if med(m):
            r["tokens_per_s"] = tokens / (med(m) / 1e3)
        if med(m):
            rat = {k: med(m) / med(ref) for k, ref in REFERENCES.items() if ref != m and med(ref)}
            r["ratios"] = rat
