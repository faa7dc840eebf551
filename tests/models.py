"""Real architectures built from torch.nn, used across the suite (seeded, small), and the
repository's root."""

import os

import torch
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository


class LSTMHead(nn.Module):
    """LSTM over batch-first sequences; returns per-step outputs (batch on dim 0)."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(6, 8, num_layers=2, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        out, _ = self.lstm(x)
        return self.head(out)


def mlp():
    return nn.Sequential(
        nn.Linear(12, 32), nn.GELU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 5)
    )


def cnn_bn():
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, stride=2),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
    )


def transformer():
    return nn.TransformerEncoderLayer(
        d_model=16, nhead=4, dim_feedforward=32, dropout=0.0, batch_first=True
    )


# name -> (factory, input factory for a batch of b, whether BatchNorm makes outputs chunk-dependent)
ARCHS = {
    "mlp": (mlp, lambda b: torch.randn(b, 12), False),
    "cnn_bn": (cnn_bn, lambda b: torch.randn(b, 3, 10, 10), True),
    "lstm": (LSTMHead, lambda b: torch.randn(b, 5, 6), False),
    "transformer": (transformer, lambda b: torch.randn(b, 7, 16), False),
}


class ScaledMLP(nn.Module):
    """Linear, ReLU (with dropout: ReLU, Dropout), Linear, times a plain attribute ``scale``."""

    def __init__(self, dropout=False):
        super().__init__()
        self.lin1, self.act, self.lin2 = nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 4)
        if dropout:
            self.act = nn.Sequential(nn.ReLU(), nn.Dropout(0.5))
        self.scale = 1.0

    def forward(self, x):
        return self.lin2(self.act(self.lin1(x))) * self.scale


def linear_stack(layers: int, width: int = 32) -> nn.Sequential:
    """``layers`` square Linears (seeded): the bucket and reduce tests size their buckets by it."""
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def build(name, seed=0):
    torch.manual_seed(seed)
    factory, make_input, has_bn = ARCHS[name]
    return factory(), make_input, has_bn
