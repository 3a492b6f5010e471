"""Copies of example inputs whose 0/1 masks mask positions: a graph measured in reduced
precision on all-ones masks never meets what padding brings (``finfo.min`` scores, fully masked
rows), so the precision pass measures these copies too."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def masked_variants(inputs: Sequence[Any]) -> list[tuple[Any, ...]]:
    """Copies of ``inputs`` in which every input that looks like a 0/1 mask masks positions.

    Example masks are usually all ones (nothing padded), so a graph measured on them alone
    never meets what padding brings: ``finfo.min`` scores, fully masked rows. In the first copy
    the second half of each row (the last dimension) is masked and, where there are several
    rows, the last row entirely; where a mask has a single row, a second copy masks all of it.
    The masked value is the example's rarer one (0 in an all-ones mask, ``True`` in an
    all-``False`` padding mask); an integer mask only ever gets zeros, which index any table.

        mask  1 1 1 1      copy 1:  1 1 0 0      copy 2 (single-row masks):  0 0 0 0
              1 1 1 1               0 0 0 0
    """
    masked = {i: off for i, value in enumerate(inputs)
              if (off := _masked_value(value)) is not None}
    if not masked:
        return []
    single_row = any(inputs[i].numel() == inputs[i].shape[-1] for i in masked)
    patterns = [_padded] + ([_everything] if single_row else [])
    variants = []
    with torch.no_grad():
        for pattern in patterns:
            variant = list(inputs)
            for i, off in masked.items():
                value = inputs[i].clone(memory_format=torch.contiguous_format)
                rows = value.view(-1, value.shape[-1])
                rows.masked_fill_(pattern(*rows.shape).to(value.device), off)
                variant[i] = value
            variants.append(tuple(variant))
    return variants


def _masked_value(value: Any) -> bool | int | None:
    """The value that masks a position of ``value``, if ``value`` looks like a 0/1 mask."""
    if not (isinstance(value, torch.Tensor) and value.dim() >= 1 and value.numel() >= 2
            and not value.is_complex()):
        return None
    if value.dtype != torch.bool and not bool(((value == 0) | (value == 1)).all()):
        return None
    ones = int(torch.count_nonzero(value))
    off = 0 if ones >= value.numel() - ones else 1
    if value.dtype == torch.bool:
        return bool(off)
    return None if off and not value.is_floating_point() else off


def _padded(rows: int, width: int) -> torch.Tensor:
    pattern = torch.zeros(rows, width, dtype=torch.bool)
    pattern[:, (width + 1) // 2:] = True
    if rows > 1:
        pattern[-1] = True
    return pattern


def _everything(rows: int, width: int) -> torch.Tensor:
    return torch.ones(rows, width, dtype=torch.bool)
