"""A call split into microbatches and their outputs merged back along the batch dimension,
with the check, at build time, that every output can be merged that way."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from autoopt.errors import ConfigError, InputError


def split_microbatches(flat: Sequence[Any], microbatches: int) -> list[list[Any]]:
    """Split every tensor whose first dimension is the batch into ``microbatches`` equal
    chunks; other values go to every microbatch as they are."""
    if microbatches == 1:
        return [list(flat)]
    tensors = [x for x in flat if isinstance(x, torch.Tensor) and x.dim() > 0]
    if not tensors:
        raise InputError(f"no input tensor has a batch dimension to split into {microbatches} "
                         f"microbatches; use microbatches=1.")
    batch = tensors[0].shape[0]
    if batch % microbatches:
        raise InputError(f"the batch ({batch}) does not split into {microbatches} equal "
                         f"microbatches; use a batch that is a multiple of {microbatches}.")
    out: list[list[Any]] = [[] for _ in range(microbatches)]
    for x in flat:
        parts = (x.chunk(microbatches) if isinstance(x, torch.Tensor) and x.dim() > 0
                 and x.shape[0] == batch else [x] * microbatches)
        for m in range(microbatches):
            out[m].append(parts[m])
    return out


def check_mergeable_outputs(inputs: Sequence[Any], outputs: Sequence[Any], microbatches: int,
                            out_spec: pytree.TreeSpec | None = None) -> None:
    """Refuse outputs that concatenating microbatches along dim 0 would get wrong.

    ``inputs`` and ``outputs`` are one microbatch's flat values (or their ``meta["val"]``). A
    tensor output whose first dimension is not the microbatch's batch (``h.mean(0)``, a
    0-dim loss) was reduced over the batch: each microbatch computed it over its own part,
    and neither concatenating nor taking one of them gives the whole batch's value.

    Raises:
        ConfigError: naming the output, its shape and what to do.
    """
    if microbatches == 1:
        return
    batch = next((x.shape[0] for x in inputs if isinstance(x, torch.Tensor) and x.dim() > 0),
                 None)
    if batch is None:  # inputs without traced values: nothing to tell the batch by
        return
    for i, value in enumerate(outputs):
        if not isinstance(value, torch.Tensor) or (value.dim() > 0 and value.shape[0] == batch):
            continue
        shape = tuple(value.shape)
        got = ("the first microbatch's value instead of the whole batch's" if value.dim() == 0
               else f"shape {(shape[0] * microbatches, *shape[1:])} instead of {shape}")
        raise ConfigError(
            f"{_output_name(i, len(outputs), out_spec)} has shape {shape}, which does not start "
            f"with the microbatch's batch size ({batch}): it is reduced over the batch, so "
            f"each of the {microbatches} microbatches computes it over its own part, and "
            f"merging them would give {got}. Return per-example values and reduce after the "
            f"pipeline, or use microbatches=1.")


def _output_name(i: int, count: int, out_spec: pytree.TreeSpec | None) -> str:
    """``Output ['pooled']`` from the output's structure where it has keys, else ``output i``."""
    if out_spec is not None:
        try:
            paths, _ = pytree.tree_flatten_with_path(pytree.tree_unflatten(range(count),
                                                                           out_spec))
            key = pytree.keystr(paths[i][0])
            return f"Output {key}" if key else "The output"
        except Exception:  # noqa: BLE001 - a structure without key paths: use the index
            pass
    return f"Output {i}"


def merge_microbatches(outputs: Sequence[Sequence[Any]]) -> list[Any]:
    """Concatenate each output tensor's microbatches along the batch dimension."""
    merged = []
    for parts in zip(*outputs, strict=True):
        first = parts[0]
        if isinstance(first, torch.Tensor) and first.dim() > 0:
            merged.append(torch.cat(parts) if len(parts) > 1 else first)
        else:
            merged.append(first)
    return merged
