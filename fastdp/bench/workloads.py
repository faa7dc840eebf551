"""Benchmark workloads from ``torch.nn`` only, and their inputs. The profiles ``tiny``, ``quick``,
``cpu`` and ``gpu`` change widths, spatial sizes, sequence lengths and batch sizes, never layer
counts or block structure."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Workload:
    """A model factory plus an input factory; ``inputs(batch, device)`` returns positional args."""

    name: str
    build: Callable[[], nn.Module]
    inputs: Callable[[int, torch.device | str], tuple]
    batch: int
    layers: int | None = None
    input_kind: str = "tensor"


def mlp(layers: int, width: int = 32) -> nn.Sequential:
    """A stack of ``Linear(width, width)``; orthogonal weights and zero biases keep activations and
    gradients at unit scale through 1000 layers (no denormals, meaningful tolerances)."""
    seq = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    with torch.no_grad():
        for lin in seq:
            nn.init.orthogonal_(lin.weight)
            lin.bias.zero_()
    return seq


class Bottleneck(nn.Module):
    """ResNet-50's bottleneck block (1x1, 3x3, 1x1 convolutions with BatchNorm, expansion 4)."""

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = width * 4
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + (x if self.down is None else self.down(x)))


def resnet50_shaped(base: int = 64, classes: int = 100) -> nn.Sequential:
    """ResNet-50's structure (stem, bottlenecks [3, 4, 6, 3], pooling, classifier) with the stage
    widths ``base, 2*base, 4*base, 8*base`` (``base=64`` is ResNet-50 itself)."""
    layers: list[nn.Module] = [
        nn.Conv2d(3, base, 7, stride=2, padding=3, bias=False),
        nn.BatchNorm2d(base),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(3, stride=2, padding=1),
    ]
    cin = base
    for i, blocks in enumerate((3, 4, 6, 3)):
        width = base * 2**i
        for j in range(blocks):
            layers.append(Bottleneck(cin, width, 2 if (j == 0 and i > 0) else 1))
            cin = width * 4
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes)]
    return nn.Sequential(*layers)


class LSTMNet(nn.Module):
    """A 2-layer batch-first LSTM with a linear head; returns only the per-step outputs (the hidden
    state's batch dimension is 1, which DataParallel would gather along the wrong axis)."""

    def __init__(self, features: int, hidden: int, layers: int = 2) -> None:
        super().__init__()
        self.lstm = nn.LSTM(features, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(x)[0])


class DictMLP(nn.Module):
    """Takes a dict of 16 tensors: one ``Linear`` per key, summed, then an MLP trunk."""

    def __init__(self, keys: int = 16, width: int = 32, trunk: int = 10) -> None:
        super().__init__()
        self.keys = [f"x{i:02d}" for i in range(keys)]
        self.embed = nn.ModuleDict({k: nn.Linear(width, width) for k in self.keys})
        self.trunk = mlp(trunk, width)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.trunk(sum(self.embed[k](batch[k]) for k in self.keys))


def _randn(*shape: int) -> Callable[[int, torch.device | str], tuple]:
    return lambda b, dev: (torch.randn(b, *shape, device=dev),)


def _dict16(width: int) -> Callable[[int, torch.device | str], tuple]:
    return lambda b, dev: ({f"x{i:02d}": torch.randn(b, width, device=dev) for i in range(16)},)


# Per profile: wide8 (width, batch), the MLPs' batch, CNN (base width, image side, batch),
# transformer (d_model, heads, feed-forward, sequence, batch), LSTM (hidden, sequence, batch).
_SIZES = {
    "tiny": ((64, 32), 8, (4, 16, 4), (16, 2, 32, 8, 4), (16, 8, 4)),
    "quick": ((256, 128), 16, (8, 16, 8), (32, 4, 64, 16, 8), (32, 16, 8)),
    "cpu": ((1024, 512), 64, (16, 32, 8), (64, 4, 256, 32, 16), (64, 32, 16)),
    "gpu": ((4096, 4096), 1024, (64, 128, 64), (512, 8, 2048, 128, 64), (512, 128, 64)),
}


def catalogue(profile: str) -> dict[str, Workload]:
    """Every workload at the sizes of ``profile``, by name (bench/README.md, *Workloads*)."""
    (width, wide_b), mlp_b, (base, side, cnn_b), tf, (hid, lseq, lstm_b) = _SIZES[profile]
    d, heads, ff, seq, tf_b = tf

    def transformer() -> nn.Module:
        layer = nn.TransformerEncoderLayer(d, heads, ff, dropout=0.0, batch_first=True)
        return nn.TransformerEncoder(layer, 12, enable_nested_tensor=False)

    out = [Workload(f"mlp{n}", lambda n=n: mlp(n), _randn(32), mlp_b, n) for n in (10, 100, 1000)]
    out += [
        Workload("resnet50", lambda: resnet50_shaped(base), _randn(3, side, side), cnn_b, 53),
        Workload("transformer12", transformer, _randn(seq, d), tf_b, 12),
        Workload("lstm", lambda: LSTMNet(32, hid), _randn(lseq, 32), lstm_b, 2),
        Workload("mlp10-dict16", DictMLP, _dict16(32), mlp_b, 26, "dict16"),
        Workload("wide8", lambda: mlp(8, width), _randn(width), wide_b, 8),
    ]
    return {w.name: w for w in out}


def build(w: Workload, device: torch.device | str, seed: int = 0) -> nn.Module:
    """The workload's model in training mode on ``device``, with deterministic weights."""
    torch.manual_seed(seed)
    return w.build().to(device).train()


def make_inputs(w: Workload, device: torch.device | str, batch: int | None = None) -> tuple:
    """Deterministic inputs (seed 1, the caller's CPU random state kept)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        return w.inputs(batch or w.batch, device)


def map_tensors(obj, fn):
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple):
        return tuple(map_tensors(o, fn) for o in obj)
    if isinstance(obj, list):
        return [map_tensors(o, fn) for o in obj]
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    return obj


def tensors_of(obj) -> list[torch.Tensor]:
    """The tensors of a nested output, in a deterministic order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in tensors_of(o)]
    if isinstance(obj, dict):
        return [t for k in obj for t in tensors_of(obj[k])]
    return []


def loss_of(out) -> torch.Tensor:
    """Mean of squares over every output tensor: gradients reach every parameter."""
    return sum(t.float().square().mean() for t in tensors_of(out))
