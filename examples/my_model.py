"""The model the command-line examples name as ``my_model.py:Net`` (see cli.py).

A tiny text classifier: token ids in, two logits out. Random weights, nothing downloaded.
"""

import torch
from torch import nn


class Net(nn.Module):
    def __init__(self, vocab: int = 100, width: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 2)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        h = self.norm(h + self.mlp(h))
        return self.head(h.mean(dim=1))


if __name__ == "__main__":
    print(Net().eval()(torch.randint(0, 100, (2, 128))).shape)
