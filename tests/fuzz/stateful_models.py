"""Small models for the stateful fuzzer (``test_fuzz_stateful.py``), one per family of state a
user's actions can reach: BatchNorm statistics, residual convolutions, attention and
LayerNorm, a Python attribute and a counter buffer read in ``forward``, tied weights.

Each ``Family`` builds its model and makes inputs for a (batch, size) pair; sizes are few, so
a run of the state machine reuses captured graphs as often as it makes new ones.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn


class MLPBatchNorm(nn.Module):
    """(B, 8) -> (B, 4): linear, BatchNorm1d (folded in eval), ReLU, linear (packed)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


class ResidualCNN(nn.Module):
    """(B, 3, S, S) -> (B, 3): conv-BN-ReLU, a residual conv-BN block, pooling, a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv = nn.Conv2d(8, 8, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn1(self.stem(x)))  # (B, 8, S, S)
        h = torch.relu(self.bn2(self.conv(h)) + h)
        return self.head(h.mean(dim=(2, 3)))  # (B, 3)


class TinyBlock(nn.Module):
    """(B, T, 16) -> (B, T, 16): a pre-norm transformer block with hand-written attention
    (softmax(q kᵀ · s) v, two heads, Q/K/V as sibling linears) and GPT-2's tanh GELU."""

    def __init__(self, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def _split(self, t: torch.Tensor) -> torch.Tensor:
        b, n, d = t.shape
        return t.view(b, n, self.heads, d // self.heads).transpose(1, 2)  # (B, H, T, D/H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        h = self.ln1(x)
        q, k, v = self._split(self.q(h)), self._split(self.k(h)), self._split(self.v(h))
        scores = q @ k.transpose(-2, -1) * (1.0 / math.sqrt(d // self.heads))
        a = (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(b, n, d)
        x = x + self.proj(a)
        u = self.up(self.ln2(x))
        g = 0.5 * u * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (u + 0.044715 * u.pow(3))))
        return x + self.down(g)


class ScaledCounter(nn.Module):
    """(B, 6) -> tuple: a Python float ``scale`` read in forward, and a ``calls`` buffer counted
    up in train mode that the output depends on (a graph that drops the count is wrong)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.out = nn.Linear(6, 2)
        self.scale = 1.5
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.training:
            self.calls.add_(1)
        h = torch.tanh(self.fc(x)) * self.scale + 0.01 * self.calls
        return self.out(h), h.sum(dim=-1)


class TiedEmbedding(nn.Module):
    """(B, T) integer ids -> (B, T, 20) logits: an embedding, a linear, and a head that shares
    the embedding's weight."""

    def __init__(self, vocab: int = 20, dim: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.emb(ids))))


MakeInput = Callable[[int, int, torch.dtype, torch.Generator], torch.Tensor]


@dataclass(frozen=True)
class Family:
    """A model family for the state machine.

    Args:
        name: shown in hypothesis's output.
        build: a fresh model, in train mode, float32.
        make_input: ``(batch, size, dtype, generator) -> input``; ``dtype`` is the model's
            float dtype, or for integer inputs the index dtype.
        batches: batch sizes calls draw from (BatchNorm1d in train mode needs 2 or more).
        sizes: the other varying dimension (sequence length, spatial size).
        index_dtypes: for integer inputs, the dtypes the model accepts; () for float inputs.
        attribute: a float attribute ``forward`` reads, which the machine may change.
    """

    name: str
    build: Callable[[], nn.Module]
    make_input: MakeInput
    batches: tuple[int, ...]
    sizes: tuple[int, ...]
    index_dtypes: tuple[torch.dtype, ...] = ()
    attribute: str | None = None

    def __repr__(self) -> str:
        return self.name


def _randn(*shape: int) -> MakeInput:
    return lambda b, s, dtype, g: torch.randn(b, *shape, generator=g).to(dtype)


FAMILIES = {
    "mlp_bn": Family("mlp_bn", MLPBatchNorm, _randn(8), (2, 3, 5), (0,)),
    "cnn_residual": Family(
        "cnn_residual", ResidualCNN,
        lambda b, s, dtype, g: torch.randn(b, 3, s, s, generator=g).to(dtype), (1, 2, 3), (4, 6)),
    "transformer": Family(
        "transformer", TinyBlock,
        lambda b, s, dtype, g: torch.randn(b, s, 16, generator=g).to(dtype), (1, 2), (3, 5)),
    "scaled_counter": Family("scaled_counter", ScaledCounter, _randn(6), (1, 3, 4), (0,),
                             attribute="scale"),
    "tied_embedding": Family(
        "tied_embedding", TiedEmbedding,
        lambda b, s, dtype, g: torch.randint(0, 20, (b, s), generator=g, dtype=dtype),
        (1, 3), (2, 4), index_dtypes=(torch.int64, torch.int32)),
}
