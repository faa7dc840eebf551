"""Outputs that are not tensors or containers, gathered as DataParallel gathers them
(``_gather_object`` in fastdp/scatter_gather.py).

The reference is torch's own ``gather`` (``torch.nn.parallel.scatter_gather``) with its CUDA-only
``Gather`` replaced by ``torch.cat``, applied to the per-replica outputs.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.parallel.scatter_gather as torch_sg
from torch import nn

from fastdp import FastDataParallel
from fastdp.scatter_gather import gather
from fastdp.testing import CPU2


@contextlib.contextmanager
def _cat_for_gather() -> Iterator[None]:
    orig = torch_sg.Gather.apply

    def cat(target: Any, dim: int, *parts: torch.Tensor) -> torch.Tensor:
        if dim == 0 and all(p.dim() == 0 for p in parts):
            parts = tuple(p.view(1) for p in parts)
        return torch.cat(parts, dim)

    torch_sg.Gather.apply = cat
    try:
        yield
    finally:
        torch_sg.Gather.apply = orig


def dataparallel_gather(outputs: list[Any]) -> Any:
    """What ``nn.DataParallel.gather`` returns for ``outputs`` (CPU parts)."""
    with _cat_for_gather(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch_sg.gather(outputs, "cpu")


class Rows:
    """A user class that rebuilds from an iterable of parts, as DataParallel's gather_map asks."""

    def __init__(self, parts: Any) -> None:
        self.parts = list(parts)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.parts)


class NotRebuildable:
    """Iterable, but its constructor refuses the gathered parts (DataParallel raises)."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor) -> None:
        self.a, self.b = a, b

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter((self.a, self.b))


def _parts(n: int = 2) -> list[torch.Tensor]:
    return [torch.arange(6.0).view(3, 2) + 10 * r for r in range(n)]


def test_user_iterable_is_rebuilt_from_gathered_parts():
    outs = [Rows([p, (p * 2, "tag")]) for p in _parts()]
    got = gather(outs, "cpu")
    want = dataparallel_gather(outs)
    assert type(got) is Rows
    torch.testing.assert_close(got.parts[0], want.parts[0], rtol=0, atol=0)
    torch.testing.assert_close(got.parts[1][0], want.parts[1][0], rtol=0, atol=0)


def test_object_dataparallel_cannot_rebuild_is_returned_per_replica_with_a_warning():
    outs = [NotRebuildable(p, p) for p in _parts()]
    with pytest.raises(TypeError):
        dataparallel_gather(outs)
    with pytest.warns(UserWarning, match="NotRebuildable could not be rebuilt"):
        got = gather(outs, "cpu")
    assert got == outs


@pytest.mark.parametrize("value", ["ab", 3, 2.5, b"x"], ids=["str", "int", "float", "bytes"])
def test_plain_values_are_returned_per_replica_without_warning(value):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = gather([(p, value) for p in _parts()], "cpu")
    assert got[1] == [value, value]


def test_iterators_are_not_consumed():
    gens = [iter([p]) for p in _parts()]
    got = gather(gens, "cpu")
    assert got == gens
    assert all(next(g).shape == (3, 2) for g in gens)


# ------------------------------------------------------------------------ transformers' caches


def _tiny_llama(sliding_window: int | None = None) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    kw: dict[str, Any] = {"sliding_window": None}
    if sliding_window is not None:
        kw = {"sliding_window": sliding_window, "layer_types": ["sliding_attention"] * 2}
    cfg = transformers.MistralConfig(
        vocab_size=50,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        **kw,
    )
    torch.manual_seed(0)
    return transformers.MistralForCausalLM(cfg)


def _assert_same_cache(got: Any, want: Any) -> None:
    assert type(got) is type(want)
    for a, b in zip(got, want, strict=True):
        for x, y in zip(a, b, strict=True):
            if x is None:
                assert y is None
            else:
                torch.testing.assert_close(x, y, rtol=0, atol=0)


@pytest.mark.parametrize("persistent", [True, False])
def test_dynamic_cache_is_gathered_into_one_cache(launch, storage, persistent):
    model = _tiny_llama()
    ids = torch.randint(0, 50, (5, 7))
    out = FastDataParallel(model, device_ids=CPU2, persistent=persistent)(input_ids=ids)
    want = dataparallel_gather([model(input_ids=c) for c in ids.chunk(2)])
    cache = out.past_key_values
    assert type(cache).__name__ == "DynamicCache"
    assert cache.get_seq_length() == 7
    assert cache.layers[0].keys.shape[0] == 5
    _assert_same_cache(cache, want.past_key_values)
    torch.testing.assert_close(out.logits, want.logits, rtol=0, atol=0)


def test_encoder_decoder_cache_is_gathered_into_one_cache(launch, storage):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BartConfig(
        vocab_size=50,
        d_model=16,
        encoder_layers=1,
        decoder_layers=2,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        max_position_embeddings=32,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
    )
    torch.manual_seed(0)
    model = transformers.BartForConditionalGeneration(cfg)
    ids = torch.randint(3, 50, (5, 6))
    out = FastDataParallel(model, device_ids=CPU2)(input_ids=ids, decoder_input_ids=ids)
    want = dataparallel_gather([model(input_ids=c, decoder_input_ids=c) for c in ids.chunk(2)])
    cache = out.past_key_values
    assert type(cache).__name__ == "EncoderDecoderCache"
    assert cache.self_attention_cache.layers[0].keys.shape[0] == 5
    _assert_same_cache(cache, want.past_key_values)
    torch.testing.assert_close(out.logits, want.logits, rtol=0, atol=0)


def test_sliding_window_cache_dataparallel_cannot_gather_comes_back_per_replica():
    """Each layer's window is a 0-dim tensor: gathered, it becomes a vector and the rebuild's
    ``.item()`` raises, in DataParallel and here; fastdp returns the replicas' caches."""
    model = _tiny_llama(sliding_window=4)
    ids = torch.randint(0, 50, (5, 7))
    outs = [model(input_ids=c) for c in ids.chunk(2)]
    with pytest.raises((RuntimeError, ValueError)):
        dataparallel_gather(outs)
    with pytest.warns(UserWarning, match="could not be rebuilt"):
        out = FastDataParallel(model, device_ids=CPU2)(input_ids=ids)
    caches = out.past_key_values
    assert isinstance(caches, list) and len(caches) == 2
    assert [c.layers[0].keys.shape[0] for c in caches] == [3, 2]
