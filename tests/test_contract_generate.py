"""``FastDataParallel.generate`` and ``call_method``: each replica runs its own method on its rows,
and the result equals the module's method on each ``torch.chunk`` chunk, gathered (sequences
right-padded with the pad token, per-step tuples with zeros, ``beam_indices`` with -1 and shifted
to the gathered rows). Real transformers models from tiny configs: a decoder-only LM (Llama) and
an encoder-decoder (T5); left-padded prompts with their attention mask; one chunk's rows forced
to EOS after two tokens while the others run to ``max_new_tokens``."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from fastdp import FastDataParallel

transformers = pytest.importorskip("transformers")

PAD, EOS, BOS, MARK = 0, 1, 2, 3
VOCAB, PROMPT, NEW = 64, 5, 6
BATCH = 5  # uneven chunks: 3 + 2 on two replicas, 2 + 2 + 1 on three
MARKED = 3  # rows 0-2: every row of the first chunk (of 2 or 3) stops after two tokens


class ForceEOS(transformers.LogitsProcessor):
    """Rows whose token at ``col`` is ``MARK`` emit EOS once they are ``after`` tokens long."""

    def __init__(self, col: int, after: int) -> None:
        self.col, self.after = col, after

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[1] < self.after:
            return scores
        rows = input_ids[:, self.col] == MARK
        scores = scores.clone()
        scores[rows] = -float("inf")
        scores[rows, EOS] = 0.0
        return scores


class StopRows(transformers.StoppingCriteria):
    """Rows whose token at ``col`` is ``MARK`` are done once they are ``after`` tokens long."""

    def __init__(self, col: int, after: int) -> None:
        self.col, self.after = col, after

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        return (input_ids[:, self.col] == MARK) & (input_ids.shape[1] >= self.after)


def _llama() -> nn.Module:
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=PAD,
        bos_token_id=BOS,
        eos_token_id=EOS,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def _t5() -> nn.Module:
    cfg = transformers.T5Config(
        vocab_size=VOCAB,
        d_model=32,
        d_kv=16,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=2,
        dropout_rate=0.0,
        pad_token_id=PAD,
        eos_token_id=EOS,
        decoder_start_token_id=PAD,
    )
    torch.manual_seed(0)
    return transformers.T5ForConditionalGeneration(cfg).eval()


MODELS = {"llama": _llama, "t5": _t5}


@pytest.fixture(scope="module")
def built() -> dict[str, nn.Module]:
    return {name: make() for name, make in MODELS.items()}


def _inputs(kind: str) -> dict:
    """Left-padded prompts (rows 1.. lose one more leading token each), the marked rows, and
    the processor that ends them early; T5 marks the rows in its decoder prompt."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(MARK + 1, VOCAB, (BATCH, PROMPT), generator=g)
    mask = torch.ones(BATCH, PROMPT, dtype=torch.long)
    for r in range(BATCH):
        ids[r, : r % 3], mask[r, : r % 3] = PAD, 0
    kw = {"input_ids": ids, "attention_mask": mask}
    if kind == "llama":
        ids[:MARKED, -1] = MARK
        force = ForceEOS(PROMPT - 1, PROMPT + 2)
    else:
        dec = torch.full((BATCH, 2), PAD)
        dec[:, 1] = torch.randint(MARK + 1, VOCAB, (BATCH,), generator=g)
        dec[:MARKED, 1] = MARK
        kw["decoder_input_ids"], force = dec, ForceEOS(1, 4)
    return {**kw, "logits_processor": [force], "suppress_tokens": [EOS], "max_new_tokens": NEW}


def _chunks(kwargs: dict, n: int) -> list[dict]:
    """``kwargs`` per chunk: tensors ``torch.chunk``-ed along dim 0, everything else as is."""
    k = min(len(v.chunk(n)) for v in kwargs.values() if isinstance(v, torch.Tensor))
    return [
        {key: v.chunk(n)[i] if isinstance(v, torch.Tensor) else v for key, v in kwargs.items()}
        for i in range(k)
    ]


def _pad(t: torch.Tensor, length: int, value: int) -> torch.Tensor:
    return torch.cat([t, t.new_full((t.shape[0], length - t.shape[1]), value)], 1)


def _zeros_like_steps(steps: tuple, like: tuple, per_row: int, rows: int) -> tuple:
    def z(x):
        if isinstance(x, tuple):
            return tuple(z(y) for y in x)
        return x.new_zeros((rows * (x.shape[0] // per_row), *x.shape[1:]))

    return tuple(steps) + tuple(z(like[s]) for s in range(len(steps), len(like)))


def expected(outs: list, rows: list[int], beams: int = 1, pad: int = PAD):
    """Each chunk's ``generate`` output, padded and concatenated as one batch's."""
    if isinstance(outs[0], torch.Tensor):
        longest = max(o.shape[1] for o in outs)
        return torch.cat([_pad(o, longest, pad) for o in outs])
    got = {}
    for key in outs[0].keys():
        vals = [o[key] for o in outs]
        if key == "cache":
            continue
        if key == "sequences":
            longest = max(v.shape[1] for v in vals)
            got[key] = torch.cat([_pad(v, longest, pad) for v in vals])
        elif key == "beam_indices":
            longest, offsets = max(v.shape[1] for v in vals), [0]
            for n in rows[:-1]:
                offsets.append(offsets[-1] + n * beams)
            padded = [_pad(v, longest, -1) for v in vals]
            got[key] = torch.cat([torch.where(v >= 0, v + o, v) for v, o in zip(padded, offsets)])
        elif isinstance(vals[0], tuple) and key not in ("encoder_hidden_states",):
            r = max(range(len(vals)), key=lambda i: len(vals[i]))
            steps = [_zeros_like_steps(v, vals[r], rows[r], n) for v, n in zip(vals, rows)]
            got[key] = tuple(
                tuple(map(torch.cat, zip(*s))) if isinstance(s[0], tuple) else torch.cat(s)
                for s in zip(*steps)
            )
        elif isinstance(vals[0], tuple):
            got[key] = tuple(torch.cat(s) for s in zip(*vals))
        else:
            got[key] = torch.cat(vals)
    return got


def _reference(module: nn.Module, kwargs: dict, n: int, beams: int = 1, pad: int = PAD):
    chunks = _chunks(kwargs, n)
    outs = [module.generate(**c) for c in chunks]
    return expected(outs, [c["input_ids"].shape[0] for c in chunks], beams, pad), outs


def _assert_same(got, want, outs) -> None:
    if isinstance(want, torch.Tensor):
        assert torch.equal(got, want)
        return
    assert type(got) is type(outs[0])
    assert torch.equal(got.sequences, want["sequences"])
    for key, value in want.items():
        assert_close(got[key], value, msg=key)
    if "cache" in outs[0]:
        assert len(got.cache) == len(outs)


@pytest.fixture(scope="module")
def references(built) -> dict:
    """(kind, beams, replicas) -> the call's keywords and its reference (made once: the
    launch and storage variants of a case share it)."""
    cache: dict = {}

    def get(kind: str, beams: int, replicas: int) -> tuple:
        if (kind, beams, replicas) not in cache:
            kw = dict(_inputs(kind), num_beams=beams, return_dict_in_generate=True)
            kw.update(output_scores=True, output_logits=True, output_hidden_states=True)
            if beams > 1:
                kw["early_stopping"] = True
            cache[kind, beams, replicas] = (kw, *_reference(built[kind], kw, replicas, beams))
        return cache[kind, beams, replicas]

    return get


# each model greedy and with beams, on 2 and 3 replicas (six of the eight, to keep the time)
CASES = [
    pytest.param(kind, beams, n, id=f"{kind}-{'greedy' if beams == 1 else 'beams2'}-{n}")
    for kind, beams, n in [
        ("llama", 1, 2),
        ("llama", 1, 3),
        ("llama", 2, 3),
        ("t5", 1, 2),
        ("t5", 2, 2),
        ("t5", 2, 3),
    ]
]


@pytest.mark.parametrize("kind, beams, replicas", CASES)
def test_generate_equals_each_chunks_generate_padded(
    built, references, kind, beams, replicas, launch, storage
):
    kw, want, outs = references(kind, beams, replicas)
    if beams == 1:  # the first chunk stopped early: its sequences are padded
        assert outs[0].sequences.shape[1] < outs[-1].sequences.shape[1]
    fdp = FastDataParallel(built[kind], device_ids=["cpu"] * replicas)
    _assert_same(fdp.generate(**kw), want, outs)


def test_generate_positional_prompt_on_fresh_and_persistent_replicas(built, replica_builds):
    """``persistent=False`` runs DataParallel's algorithm (fresh replicas every call);
    persistent replicas are built once and serve every later call."""
    module = built["llama"]
    kw = _inputs("llama")
    want, _ = _reference(module, kw, 2)
    ids = kw.pop("input_ids")
    for persistent in (False, True):
        fdp = FastDataParallel(module, device_ids=["cpu"] * 2, persistent=persistent)
        for _ in range(2):
            assert torch.equal(fdp.generate(ids, **kw), want)
    assert len(replica_builds) == 1


def test_pad_token_falls_back_to_eos_then_asks_for_one(built):
    module = copy.deepcopy(built["llama"])
    kw = _inputs("llama")
    module.generation_config.pad_token_id = None
    want, _ = _reference(module, kw, 2, pad=EOS)
    fdp = FastDataParallel(module, device_ids=["cpu"] * 2)
    assert torch.equal(fdp.generate(**kw), want)

    stop_first = StopRows(col=PROMPT - 1, after=PROMPT + 2)  # no EOS: the chunk ends, unpadded
    kw = dict(_inputs("llama"), logits_processor=[], stopping_criteria=[stop_first])
    module.generation_config.eos_token_id = None
    del kw["suppress_tokens"]
    with pytest.raises(ValueError, match="no pad_token_id .nor eos_token_id."):
        fdp.generate(**kw)
    want, outs = _reference(module, dict(kw, pad_token_id=7), 2, pad=7)
    assert outs[0].shape[1] < outs[1].shape[1]
    assert torch.equal(fdp.generate(**kw, pad_token_id=7), want)


def test_generate_sees_the_model_edited_between_calls(built):
    module = copy.deepcopy(built["llama"])
    kw = _inputs("llama")
    fdp = FastDataParallel(module, device_ids=["cpu"] * 2)
    for edit in (None, "scale", "replace"):
        if edit == "scale":
            with torch.no_grad():
                module.lm_head.weight.mul_(-1)
        elif edit == "replace":
            module.lm_head.weight = nn.Parameter(module.lm_head.weight.detach().flip(0))
        want, _ = _reference(module, kw, 2)
        assert torch.equal(fdp.generate(**kw), want), edit


class Cfg:
    """An object every replica receives whole (not a tensor, list, tuple or dict)."""

    def __init__(self, offset: float) -> None:
        self.offset = offset


class Scorer(nn.Module):
    """A module whose method, not its forward, is the call: tensors, keywords and an object."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise AssertionError("call_method runs the method, never forward")

    def score(self, x, mask=None, *, scale: float, cfg: Cfg) -> dict:
        self.calls = getattr(self, "calls", 0) + 1  # a write a call leaves: undone after it
        out = self.lin(x) * scale + cfg.offset
        if self.training:
            out = out * 2
        if mask is not None:
            out = out * mask[:, None]
        return {"out": out, "calls": torch.full((x.shape[0],), float(self.calls))}

    def twice(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * 2

    def outer(self, x: torch.Tensor) -> torch.Tensor:
        return self.again(x)  # a plain attribute: the wrapper, called from inside a replica


def _score_ref(module: Scorer, x, mask, n: int, **kw) -> dict:
    """``score`` on each chunk, each on a fresh copy (as each replica starts as built)."""
    outs = [copy.deepcopy(module).score(a, b, **kw) for a, b in zip(x.chunk(n), mask.chunk(n))]
    return {k: torch.cat([o[k] for o in outs]) for k in outs[0]}


@pytest.mark.parametrize("replicas", [2, 3])
def test_call_method_takes_tensors_keywords_and_objects(replicas, launch, storage):
    torch.manual_seed(0)
    module = Scorer()
    x, mask = torch.randn(7, 4, requires_grad=True), torch.rand(7)
    kw = {"scale": 0.5, "cfg": Cfg(1.5)}
    ref = copy.deepcopy(module)
    want = _score_ref(module, x, mask, replicas, **kw)
    fdp = FastDataParallel(module, device_ids=["cpu"] * replicas)
    for _ in range(2):  # every call starts from the replicas as built (calls == 1)
        got = fdp.call_method("score", x, mask=mask, **kw)
        assert_close(got, want)
    assert not hasattr(module, "calls")
    got["out"].sum().backward()  # gradients reach the originals, as forward's do
    for a, b in zip(x.chunk(replicas), mask.chunk(replicas)):
        ref.score(a, b, **kw)["out"].sum().backward()
    for p, q in zip(module.parameters(), ref.parameters()):
        assert_close(p.grad, q.grad)


def test_call_method_sees_the_model_edited_between_calls(storage):
    torch.manual_seed(0)
    module = Scorer()
    x, mask, kw = torch.randn(6, 4), torch.ones(6), {"scale": 1.0, "cfg": Cfg(0.0)}
    fdp = FastDataParallel(module, device_ids=["cpu"] * 2)
    for edit in ("none", "eval", "in-place", "replace", "train"):
        if edit == "eval":
            module.eval()
        elif edit == "in-place":
            with torch.no_grad():
                module.lin.weight.add_(1.0)
        elif edit == "replace":
            module.lin.weight = nn.Parameter(torch.full((3, 4), 0.25))
        elif edit == "train":
            module.train()
        with torch.no_grad():
            got = fdp.call_method("score", x, mask, **kw)
            assert_close(got, _score_ref(module, x, mask, 2, **kw), msg=edit)


def test_a_method_calling_the_wrapper_again_runs_on_fresh_replicas():
    torch.manual_seed(0)
    module = Scorer()
    kw = {"scale": 2.0, "cfg": Cfg(0.0)}
    fdp = FastDataParallel(module, device_ids=["cpu"] * 2)
    module.again = lambda x: fdp.call_method("score", x, **kw)["out"]
    x = torch.randn(8, 4)
    with torch.no_grad():
        want = _score_ref(module, x, torch.ones(8), 4, **kw)["out"]
        assert_close(fdp.call_method("outer", x), want)


def test_inference_mode_leaves_no_autograd_state(built):
    module = copy.deepcopy(built["llama"])
    kw = _inputs("llama")
    want, _ = _reference(module, kw, 2)
    fdp = FastDataParallel(module, device_ids=["cpu"] * 2)
    with torch.inference_mode():
        got = fdp.generate(**kw)
    assert torch.equal(got, want)
    assert all(p.grad is None and not p.is_inference() for p in module.parameters())
    ids, mask = kw["input_ids"], torch.ones_like(kw["input_ids"])
    fdp(input_ids=ids, attention_mask=mask).logits.sum().backward()
    ref = copy.deepcopy(built["llama"])
    for a, b in zip(ids.chunk(2), mask.chunk(2)):
        ref(input_ids=a, attention_mask=b).logits.sum().backward()
    for (name, p), q in zip(module.named_parameters(), ref.parameters()):
        assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_errors_name_the_module_and_the_inputs(built):
    with pytest.raises(AttributeError, match="'Linear' object has no attribute 'generate'"):
        FastDataParallel(nn.Linear(2, 2), device_ids=["cpu"] * 2).generate(torch.ones(2, 2))
    with pytest.raises(AttributeError, match="'Scorer' object has no attribute 'encode'"):
        FastDataParallel(Scorer(), device_ids=["cpu"] * 2).call_method("encode", torch.ones(2, 4))
    fdp = FastDataParallel(built["llama"], device_ids=["cpu"] * 2)
    kw = _inputs("llama")
    mixed = r"kwargs\['input_ids'\] \(5 rows\), kwargs\['attention_mask'\] \(4 rows\)"
    with pytest.raises(ValueError, match=mixed):
        fdp.generate(**dict(kw, attention_mask=kw["attention_mask"][:4]))
    with pytest.raises(ValueError, match="streamer"):
        fdp.generate(**kw, streamer=object())


@pytest.mark.parametrize("rows", [1, 2])
def test_fewer_rows_than_replicas_use_fewer_replicas(built, rows):
    module = built["llama"]
    kw = {k: v[:rows] if isinstance(v, torch.Tensor) else v for k, v in _inputs("llama").items()}
    want, _ = _reference(module, kw, 3)
    assert torch.equal(FastDataParallel(module, device_ids=["cpu"] * 3).generate(**kw), want)


def test_auto_measures_each_method_apart():
    """``launch="auto"`` keeps one measurement per method: a method's cost is not forward's."""
    torch.manual_seed(0)
    module = Scorer()
    fdp = FastDataParallel(module, device_ids=["cpu"] * 2, launch="auto")
    x = torch.randn(4, 4)
    with torch.no_grad():  # the same inputs, two methods: two records
        assert_close(fdp.call_method("twice", x), module.lin(x) * 2)
        assert_close(fdp.call_method("lin", x), module.lin(x))  # a submodule is called too
    assert [r["method"] for r in fdp.launch_report()] == ["twice", "lin"]


def test_generate_takes_uneven_chunk_sizes(built):
    """``chunk_sizes=`` splits generate's batch as forward's: beam indices shift by each
    replica's own rows."""
    module = built["llama"]
    kw = dict(_inputs("llama"), num_beams=2, return_dict_in_generate=True, output_scores=True)
    chunks = [
        {k: v[a:b] if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
        for a, b in ((0, 1), (1, BATCH))
    ]
    outs = [module.generate(**c) for c in chunks]
    want = expected(outs, [1, BATCH - 1], beams=2)
    fdp = FastDataParallel(module, device_ids=["cpu"] * 2, chunk_sizes=[1, BATCH - 1])
    _assert_same(fdp.generate(**kw), want, outs)
