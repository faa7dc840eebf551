"""The transformers zoo: every model class in six of transformers' auto mappings, built from a tiny
config made here (no hub download), trained three AdamW steps three ways and compared.

- ``architectures()``: one ``Arch`` per (task, model type, class) of the installed
  transformers' mappings; ``ci_sample`` a fixed stratified subset of them.
- ``tiny_configs(arch)``: the model type's default config with its size fields shrunk (hidden
  sizes, layers, heads, vocab, image size, stage lists), sub-configs included; every dropout,
  drop-path, layerdrop and jitter probability set to 0 so that ``train()`` is deterministic.
- ``build(arch)``: the model (seeded) and its inputs per step (seeded, batch 5: uneven chunks);
  ``BuildError`` when the harness cannot make it (then the test skips with the cause).
- ``Reference``: DataParallel's semantics computed by hand on the plain module: inputs chunked with
  ``torch.chunk`` (each chunk its own copy, as on distinct GPUs), the module run on each chunk in
  turn with the step's first buffers (only chunk 0's buffer updates are kept, as replica 0's are),
  outputs gathered by torch's own ``gather`` with its CUDA-only ``Gather`` replaced by ``torch.cat``
  (0-dim tensors become a vector; where torch's gather raises, fastdp's documented fallback),
  unused parameters' gradients zeros.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import transformers
from torch.func import functional_call
from torch.nn.parallel import scatter_gather as torch_scatter_gather
from transformers.models.auto import configuration_auto, modeling_auto

BATCH, SEQ = 5, 7
VOCAB = 128
IMAGE, CHANNELS = 64, 3
NUM_LABELS = 3
MAX_PARAMETERS = 4_000_000

TASKS = {
    "causal_lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "masked_lm": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "seq_cls": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
    "image_cls": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
    "seq2seq": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "qa": "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES",
}


@dataclasses.dataclass(frozen=True)
class Arch:
    task: str
    model_type: str
    class_name: str

    @property
    def id(self) -> str:
        return f"{self.task}-{self.model_type}-{self.class_name}"


class BuildError(Exception):
    """The harness cannot make this model or its inputs (not a fastdp failure)."""


def architectures() -> list[Arch]:
    """Every (task, model class) of the six mappings, sorted by id."""
    out = set()
    for task, name in TASKS.items():
        for model_type, classes in getattr(modeling_auto, name).items():
            for cls in classes if isinstance(classes, (list, tuple)) else [classes]:
                out.add(Arch(task, model_type, cls))
    return sorted(out, key=lambda a: a.id)


# Always in the CI sample: caches in the outputs (GPT-2, T5), replicas writing into their input
# chunk (FSMT's decoder inputs, Canine's clamped positions), BatchNorm buffers (ResNet).
CI_PINNED = (
    "causal_lm-gpt2-GPT2LMHeadModel",
    "masked_lm-bert-BertForMaskedLM",
    "seq2seq-t5-T5ForConditionalGeneration",
    "seq2seq-fsmt-FSMTForConditionalGeneration",
    "qa-canine-CanineForQuestionAnswering",
    "image_cls-resnet-ResNetForImageClassification",
)


def ci_sample(archs: list[Arch], per_task: int) -> list[Arch]:
    """A fixed stratified sample: ``CI_PINNED``, and per task the ``per_task`` architectures
    whose id hashes lowest (crc32), so that one stays in or out of the sample whatever else a
    release adds."""
    out = [a for a in archs if a.id in CI_PINNED]
    for task in TASKS:
        mine = [a for a in archs if a.task == task]
        out += sorted(mine, key=lambda a: zlib.crc32(a.id.encode()))[:per_task]
    return sorted(set(out), key=lambda a: a.id)


# ---------------------------------------------------------------- tiny configs

HIDDEN = 32
HEADS = 4
# Integer fields set outright (a value of the default config is replaced only when it is larger).
SIZES = {
    **dict.fromkeys(
        "hidden_size d_model n_embd embed_dim embedding_size d_embed n_embed hidden_dim dim "
        "emb_dim word_embed_proj_dim projection_dim text_embed_dim vision_embed_dim "
        "encoder_hidden_size "
        "decoder_hidden_size block_size_hidden d_inner_hidden".split(),
        HIDDEN,
    ),
    **dict.fromkeys(
        "num_hidden_layers num_layers n_layer n_layers encoder_layers decoder_layers "
        "num_encoder_layers num_decoder_layers depth decoder_depth encoder_depth "
        "num_hidden_groups".split(),
        2,
    ),
    **dict.fromkeys(
        "num_attention_heads n_head n_heads encoder_attention_heads decoder_attention_heads "
        "num_heads decoder_num_attention_heads num_encoder_attention_heads "
        "num_decoder_attention_heads".split(),
        HEADS,
    ),
    **dict.fromkeys("num_key_value_heads n_kv_heads num_kv_heads multi_query_group_num".split(), 2),
    **dict.fromkeys(
        "intermediate_size ffn_dim encoder_ffn_dim decoder_ffn_dim n_inner d_ff d_inner "
        "ffn_hidden_size decoder_intermediate_size moe_intermediate_size "
        "shared_expert_intermediate_size mlp_dim intermediate_dim".split(),
        64,
    ),
    **dict.fromkeys("head_dim d_kv attention_head_size kv_channels v_head_dim".split(), 8),
    **dict.fromkeys("qk_rope_head_dim qk_nope_head_dim rotary_dim rotary_emb_dim".split(), 4),
    **dict.fromkeys("kv_lora_rank q_lora_rank".split(), 16),
    # State-space and linear-attention mixers (Mamba, Mamba2 hybrids, RWKV, gated delta nets).
    **dict.fromkeys(
        "state_size ssm_state_size d_state mamba_d_state linear_key_head_dim "
        "linear_value_head_dim".split(),
        8,
    ),
    **dict.fromkeys(
        "mamba_n_heads mamba_num_heads linear_num_key_heads linear_num_value_heads".split(), 4
    ),
    **dict.fromkeys("mamba_d_head mamba_head_dim".split(), 8),
    **dict.fromkeys("mamba_d_ssm time_step_rank attention_hidden_size".split(), 32),
    **dict.fromkeys("chunk_size mamba_chunk_size".split(), 8),
    **dict.fromkeys("num_experts num_local_experts n_routed_experts moe_num_experts".split(), 4),
    **dict.fromkeys("num_experts_per_tok top_k moe_topk".split(), 2),
    **dict.fromkeys("n_group topk_group num_expert_group topk_group".split(), 1),
    "hidden_size_per_layer_input": 8,
    # Perceiver's latent array.
    **dict.fromkeys("num_latents d_latents output_num_channels".split(), HIDDEN),
    "num_self_attends_per_block": 2,
    **dict.fromkeys("num_self_attention_heads num_cross_attention_heads".split(), 2),
    **dict.fromkeys(
        "max_position_embeddings n_positions max_seq_len max_sequence_length n_ctx "
        "max_source_positions max_target_positions".split(),
        64,
    ),
    "window_size": 4,
    "image_size": IMAGE,
    "img_size": IMAGE,
    "num_channels": CHANNELS,
}
# Width and depth multipliers of convolutional nets (MobileNet, EfficientNet), lowered only.
MULTIPLIERS = {
    "depth_multiplier": 0.25,
    "width_multiplier": 0.25,
    "width_coefficient": 0.25,
    "depth_coefficient": 0.5,
}
TOKEN_IDS = (
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
    "decoder_start_token_id",
    "sep_token_id",
)
VOCABS = ("vocab_size", "n_vocab", "src_vocab_size", "tgt_vocab_size", "text_vocab_size")
# Per-stage lists of hierarchical vision models: (field, value of stage i).
STAGE_LISTS = {
    "depths": lambda i: 1,
    "num_hidden_layers": lambda i: 1,
    "hidden_sizes": lambda i: 16 * (i + 1),
    "embed_dims": lambda i: 16 * (i + 1),
    "embed_dim": lambda i: 16 * (i + 1),
    "embedding_sizes": lambda i: 16 * (i + 1),
    "dims": lambda i: 16 * (i + 1),
    "num_heads": lambda i: 1 if i == 0 else 2,
    "num_attention_heads": lambda i: 1 if i == 0 else 2,
    "heads": lambda i: 1 if i == 0 else 2,
    "stage_num_heads": lambda i: 1 if i == 0 else 2,
}


def _is_config(v: Any) -> bool:
    return isinstance(v, transformers.PretrainedConfig)


def _stochastic(key: str) -> bool:
    k = key.lower()
    return any(w in k for w in ("drop", "jitter", "noise_std")) and not k.endswith("_id")


def _set(config: transformers.PretrainedConfig, key: str, value: Any) -> None:
    """``setattr``, leaving a field the config refuses to set (a derived property) as it is."""
    try:
        setattr(config, key, value)
    except (AttributeError, NotImplementedError, TypeError, ValueError):
        pass


def _layer_types(config: transformers.PretrainedConfig) -> None:
    """Per-layer type lists (hybrid attention/SSM/sliding stacks) keep one layer of each type, in
    order of first use, and the layer count follows: two layers would drop a type."""
    layers = getattr(config, "num_hidden_layers", None)
    if not isinstance(layers, int) or layers < 2:
        return
    for key, value in list(vars(config).items()):
        if isinstance(value, list) and len(value) == layers and value:
            if all(isinstance(v, str) for v in value) and len(set(value)) > 1:
                kept = list(dict.fromkeys(value))
                _set(config, key, kept)
                _set(config, "num_hidden_layers", len(kept))


def shrink(config: transformers.PretrainedConfig) -> transformers.PretrainedConfig:
    """Shrink ``config`` and its sub-configs in place (see the module docstring); returns it."""
    layers = getattr(config, "num_hidden_layers", None)
    for key, value in list(vars(config).items()):
        if key.startswith("_") or key in ("id2label", "label2id"):
            continue
        if _is_config(value):
            shrink(value)
        elif isinstance(value, dict) and value and all(_is_config(v) for v in value.values()):
            for v in value.values():
                shrink(v)
        elif isinstance(value, float) and _stochastic(key):
            _set(config, key, 0.0)
        elif isinstance(value, float) and key in MULTIPLIERS and value > MULTIPLIERS[key]:
            _set(config, key, MULTIPLIERS[key])
        elif isinstance(value, bool):
            continue
        elif isinstance(value, int) and (key in VOCABS or "vocab_size" in key):
            _set(config, key, min(value, VOCAB))
        elif isinstance(value, int) and key in SIZES and value > SIZES[key]:
            _set(config, key, SIZES[key])
        elif isinstance(value, (list, tuple)) and key in STAGE_LISTS and value:
            if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
                _set(config, key, type(value)(STAGE_LISTS[key](i) for i in range(len(value))))
    if isinstance(layers, int) and layers != getattr(config, "num_hidden_layers", layers):
        _set(config, "num_hidden_layers", layers)
        _layer_types(config)
        if config.num_hidden_layers == layers:
            _set(config, "num_hidden_layers", SIZES["num_hidden_layers"])
    for key in TOKEN_IDS:
        v = getattr(config, key, None)
        if isinstance(v, int) and v >= VOCAB:
            _set(config, key, VOCAB - 1 - TOKEN_IDS.index(key))
    return config


def rebuild(config: transformers.PretrainedConfig) -> transformers.PretrainedConfig:
    """``config`` made again from its shrunk init fields, so that the fields its ``__init__``
    derives (a head dim from rope dims, layer types from the layer count) follow; as it is where
    the class refuses them."""
    if not dataclasses.is_dataclass(config):
        return config
    kwargs = {}
    for f in dataclasses.fields(config):
        try:
            v = getattr(config, f.name)
        except Exception:  # noqa: BLE001 - absent, or a per-layer field with no global value
            continue
        if f.init:
            kwargs[f.name] = rebuild(v) if _is_config(v) else v
    try:
        return type(config)(**kwargs)
    except Exception:  # noqa: BLE001 - keep the shrunk object
        return config


def tiny_configs(arch: Arch) -> list[transformers.PretrainedConfig]:
    """The default config of ``arch.model_type`` shrunk, rebuilt from its fields and as shrunk
    (``build`` takes the first that works); classification heads get 3 labels."""
    out = []
    for remake in (True, False):
        config = shrink(configuration_auto.CONFIG_MAPPING[arch.model_type]())
        config = rebuild(config) if remake else config
        if arch.task in ("seq_cls", "image_cls"):
            config.num_labels = NUM_LABELS
        if getattr(config, "pad_token_id", None) is None and arch.task == "seq_cls":
            config.pad_token_id = 0
        if getattr(config, "decoder_start_token_id", None) is None and arch.task == "seq2seq":
            config.decoder_start_token_id = getattr(config, "pad_token_id", None) or 0
        out.append(config)
    return out


# ---------------------------------------------------------------- inputs


def _get(config: Any, names: tuple[str, ...], default: Any) -> Any:
    """The first of ``names`` that ``config`` (or its vision/text sub-config) has."""
    for c in (config, getattr(config, "vision_config", None), getattr(config, "text_config", None)):
        for n in names:
            v = getattr(c, n, None) if c is not None else None
            if v is not None:
                return v
    return default


def make_inputs(arch: Arch, config: Any, step: int) -> dict[str, torch.Tensor]:
    """The step's keyword inputs (seeded by architecture and step), batch ``BATCH``."""
    g = torch.Generator().manual_seed(zlib.crc32(arch.id.encode()) + step)
    if arch.task == "image_cls":
        size = _get(config, ("image_size", "img_size"), IMAGE)
        size = size if isinstance(size, int) else size[0]
        channels = _get(config, ("num_channels", "in_channels"), CHANNELS)
        return {
            "pixel_values": torch.randn(BATCH, channels, size, size, generator=g),
            "labels": torch.randint(0, NUM_LABELS, (BATCH,), generator=g),
        }
    top = min(_get(config, VOCABS, VOCAB), VOCAB) - len(TOKEN_IDS)  # clear of moved special ids
    ids = torch.randint(3, top, (BATCH, SEQ), generator=g)
    eos = getattr(config, "eos_token_id", None)
    if arch.task == "seq_cls" and isinstance(eos, int):
        ids[:, -1] = eos  # encoder-decoder classifiers pool the last <eos>
    kw = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if arch.task in ("causal_lm", "masked_lm"):
        kw["labels"] = ids.clone()
    elif arch.task == "seq2seq":
        kw["labels"] = torch.randint(3, top, (BATCH, SEQ), generator=g)
    elif arch.task == "seq_cls":
        kw["labels"] = torch.randint(0, NUM_LABELS, (BATCH,), generator=g)
    elif arch.task == "qa":
        kw["start_positions"] = torch.randint(0, SEQ, (BATCH,), generator=g)
        kw["end_positions"] = torch.randint(0, SEQ, (BATCH,), generator=g)
    return kw


def build(arch: Arch) -> tuple[torch.nn.Module, Callable[[int], dict[str, torch.Tensor]]]:
    """The model in train mode (seeded) and its inputs per step; ``BuildError`` when the harness
    cannot make them or the plain module cannot take a step on them deterministically."""
    try:
        configs = tiny_configs(arch)
    except Exception as e:  # noqa: BLE001 - the config class refuses the harness's shrinking
        raise BuildError(f"config: {type(e).__name__}: {_first_line(e)}") from e
    errors = []
    for config in configs:
        try:
            return _build(arch, config)
        except BuildError as e:
            errors.append(e)
    raise errors[0]


def _first_line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else ""


def _build(arch: Arch, config: Any) -> tuple[torch.nn.Module, Callable]:
    try:
        torch.manual_seed(0)
        model = getattr(transformers, arch.class_name)(config)
        model.train()
        size = sum(p.numel() for p in model.parameters())
        if size > MAX_PARAMETERS:
            raise ValueError(f"{size} parameters after shrinking: a size field the harness misses")

        def inputs(step: int) -> dict[str, torch.Tensor]:
            return make_inputs(arch, config, step)

        probe = copy.deepcopy(model)
        outs = []
        for seed in (1, 2):
            torch.manual_seed(seed)
            out = probe(**inputs(0))
            outs.append(flatten(out))
        objective(out).backward()
    except Exception as e:  # noqa: BLE001 - any cause is recorded in the skip reason
        raise BuildError(f"{type(e).__name__}: {_first_line(e)}") from e
    mismatch = first_mismatch(outs[0], outs[1], exact=True)
    if mismatch:
        raise BuildError(f"not deterministic in train mode with dropout 0: {mismatch}")
    return model, inputs


# ---------------------------------------------------------------- outputs


def _is_cache(v: Any) -> bool:
    return type(v).__module__.startswith("transformers.cache_utils")


def flatten(obj: Any, path: str = "out", caches: bool = True) -> list[tuple[str, Any]]:
    """(path, leaf) pairs in a fixed order: tensors and plain values, containers by their type and
    items, caches (and their layers) by their type and every attribute; other objects by type."""
    if isinstance(obj, torch.Tensor):
        return [(path, obj)]
    if obj is None or isinstance(obj, (int, float, str, bool)):
        return [(path, obj)]
    if isinstance(obj, dict):
        items = [(f"{path}.{k}", v) for k, v in obj.items()]
        return [(f"{path}:{type(obj).__name__}", None)] + [
            leaf for p, v in items for leaf in flatten(v, p, caches)
        ]
    if isinstance(obj, (list, tuple)):
        head = [(f"{path}:{type(obj).__name__}", None)]
        items = [(f"{path}[{i}]", v) for i, v in enumerate(obj)]
        return head + [leaf for p, v in items for leaf in flatten(v, p, caches)]
    if _is_cache(obj):  # a cache and its layers: every attribute (keys, values, states, ...)
        head = [(f"{path}:{type(obj).__name__}", None)]
        items = [(f"{path}.{k}", v) for k, v in sorted(vars(obj).items())] if caches else []
        return head + [leaf for p, v in items for leaf in flatten(v, p, caches)]
    if isinstance(obj, (torch.dtype, torch.device)):
        return [(path, str(obj))]
    return [(f"{path}:{type(obj).__name__}", None)]


def objective(out: Any) -> torch.Tensor:
    """What each step backpropagates: the (per-chunk) loss summed, plus a small term from every
    other floating output that requires grad but caches (compared as outputs), so that
    gathering's backward is exercised."""
    total = None
    for path, leaf in flatten(out, caches=False):
        if not (isinstance(leaf, torch.Tensor) and leaf.requires_grad and leaf.is_floating_point()):
            continue
        term = leaf.float().sum() if path == "out.loss" else 1e-3 * leaf.float().mean()
        total = term if total is None else total + term
    if total is None:
        raise BuildError("no output requires grad")
    return total


def first_mismatch(got: list, want: list, exact: bool, rtol: float = 0.0, atol: float = 0.0):
    """The first leaf that differs (a message), or None. ``exact``: bit for bit (NaNs equal)."""
    gp, wp = [p for p, _ in got], [p for p, _ in want]
    if gp != wp:
        i = next((i for i, (a, b) in enumerate(zip(gp, wp)) if a != b), min(len(gp), len(wp)))
        at = [p[i] if i < len(p) else "(end)" for p in (gp, wp)]
        return f"structure differs at leaf {i}: {at[0]} vs {at[1]}"
    for (path, g), (_, w) in zip(got, want):
        if isinstance(w, torch.Tensor) != isinstance(g, torch.Tensor):
            return f"{path}: {type(g).__name__} vs {type(w).__name__}"
        if not isinstance(w, torch.Tensor):
            if g != w:
                return f"{path}: {g!r} vs {w!r}"
            continue
        if g.shape != w.shape or g.dtype != w.dtype:
            return f"{path}: {g.dtype}{list(g.shape)} vs {w.dtype}{list(w.shape)}"
        g, w = g.detach(), w.detach()
        if exact or not w.is_floating_point():
            if not _eq_nan(g, w):
                return f"{path}: not bit-identical, max abs diff {_maxdiff(g, w)}"
            continue
        try:
            torch.testing.assert_close(g, w, rtol=rtol, atol=atol * _scale(w), equal_nan=True)
        except AssertionError as e:
            return f"{path}: {str(e).strip().splitlines()[-2:]}"
    return None


def _eq_nan(g: torch.Tensor, w: torch.Tensor) -> bool:
    return bool(((g == w) | (g.isnan() & w.isnan())).all())


def _maxdiff(g: torch.Tensor, w: torch.Tensor) -> float:
    return (g.double() - w.double()).abs().nan_to_num(0.0).max().item() if g.numel() else 0.0


def _scale(w: torch.Tensor) -> float:
    """Tolerances are relative to the tensor's largest magnitude (at least 1)."""
    return max(1.0, w.detach().abs().nan_to_num(0.0).max().item()) if w.numel() else 1.0


# ---------------------------------------------------------------- DataParallel's semantics


class _CatGather:
    """torch's ``Gather`` on the CPU: ``comm.gather`` is ``torch.cat``; 0-dim parts a vector."""

    @staticmethod
    def apply(target_device: Any, dim: int, *parts: torch.Tensor) -> torch.Tensor:
        if dim == 0 and all(t.dim() == 0 for t in parts):
            parts = tuple(t.view(1) for t in parts)
        return torch.cat(parts, dim)


@contextlib.contextmanager
def cpu_gather() -> Iterator[None]:
    """``torch.nn.parallel.scatter_gather.gather`` runnable on CPU tensors, for the reference."""
    orig = torch_scatter_gather.Gather
    torch_scatter_gather.Gather = _CatGather
    try:
        yield
    finally:
        torch_scatter_gather.Gather = orig


def reference_gather(outputs: list) -> Any:
    """torch's ``gather`` of the per-chunk outputs wherever it succeeds; where it raises (a cache
    whose sliding-window tensors gather into a vector, say), a dict is gathered key by key and
    anything else is the per-replica list: what fastdp returns where DataParallel cannot."""
    try:
        with cpu_gather():
            return torch_scatter_gather.gather(outputs, "cpu")
    except Exception:  # noqa: BLE001 - DataParallel raises here: fastdp's documented fallback
        out = outputs[0]
        if isinstance(out, dict) and all(d.keys() == out.keys() for d in outputs):
            return type(out)((k, reference_gather([d[k] for d in outputs])) for k in out)
        return list(outputs)


class Reference:
    """DataParallel over ``n`` replicas computed on the plain module (see the module docstring)."""

    def __init__(self, module: torch.nn.Module, n: int):
        self.module, self.n = module, n

    def parameters(self):
        return self.module.parameters()

    def __call__(self, **kwargs: torch.Tensor) -> Any:
        chunks = {k: [c.clone() for c in torch.chunk(v, self.n)] for k, v in kwargs.items()}
        count = min(len(c) for c in chunks.values())
        params = dict(self.module.named_parameters(remove_duplicate=False))
        buffers = dict(self.module.named_buffers(remove_duplicate=False))
        first = {k: b.clone() for k, b in buffers.items()}
        outputs = []
        for i in range(count):
            bufs = buffers if i == 0 else {k: b.clone() for k, b in first.items()}
            kw = {k: c[i] for k, c in chunks.items()}
            outputs.append(functional_call(self.module, {**params, **bufs}, (), kw, strict=False))
        return reference_gather(outputs)

    def zero_unused_grads(self) -> None:
        """DataParallel's Broadcast materialises zero gradients for parameters no chunk used."""
        for p in self.module.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)


def snapshot_grads(module: torch.nn.Module) -> list[tuple[str, Any]]:
    return [
        (f"grad.{n}", None if p.grad is None else p.grad.detach().clone())
        for n, p in module.named_parameters()
    ]


def snapshot_params(module: torch.nn.Module) -> list[tuple[str, Any]]:
    return [(f"param.{n}", p.detach().clone()) for n, p in module.named_parameters()]


def snapshot_buffers(module: torch.nn.Module) -> list[tuple[str, Any]]:
    return [(f"buffer.{n}", b.detach().clone()) for n, b in module.named_buffers()]


@torch.no_grad()
def load_state(dst: torch.nn.Module, dst_opt, src: torch.nn.Module, src_opt) -> None:
    """``dst`` takes ``src``'s parameters and buffers in place (as an optimizer writes them) and
    ``dst_opt`` takes ``src_opt``'s state: the next step starts where the reference's does."""
    for a, b in zip(dst.parameters(), src.parameters(), strict=True):
        a.copy_(b)
    for a, b in zip(dst.buffers(), src.buffers(), strict=True):
        a.copy_(b)
    dst_opt.load_state_dict(copy.deepcopy(src_opt.state_dict()))


def selected(mode: str | None = None) -> tuple[list[Arch], tuple[int, ...]]:
    """The architectures and replica counts to run: ``FASTDP_ZOO=all`` (or ``mode="all"``) every
    class on 2 and 3 replicas; otherwise the CI sample on 2."""
    mode = mode or os.environ.get("FASTDP_ZOO", "ci")
    archs = architectures()
    if mode == "all":
        return archs, (2, 3)
    return ci_sample(archs, CI_PER_TASK), (2,)


CI_PER_TASK = 8
