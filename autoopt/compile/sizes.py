"""Which input dimensions a new graph keeps dynamic when ``dynamic=`` was left to autoopt.

``torch.compile``'s rule: a dimension is captured static until a second size is seen there,
then dynamic. Here a dimension stays dynamic once any earlier graph of the module made it so:
each new graph frees every dimension that differs from, or was free in, an earlier graph of
the same inputs. Judged against the last graph alone, a loop whose batch and length both vary
froze the length again when the batch changed (``[?, 30]``) and the batch when the length
did (``[3, ?]``): a graph per call until ``max_specializations`` ran out.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from autoopt.compile.guards import InputSignature, TensorSpec


def varying_sizes(new: InputSignature, earlier: Iterable[InputSignature],
                  ) -> dict[int, dict[int, Any]]:
    """The dimensions to export dynamic for a call of signature ``new`` (input leaf, in
    ``signature_of``'s order -> dimension -> ``Dim.AUTO``): those that differ from, or are
    free in, any of the ``earlier`` graphs' signatures that agree with ``new`` in all else
    (structure, dtypes, devices, ranks, non-tensor values, the modes past the grad mode).
    Empty where no earlier graph takes these inputs at other sizes."""
    varying: dict[int, dict[int, Any]] = {}
    for old in earlier:
        if old.tree != new.tree or old.modes[2:] != new.modes[2:]:
            continue
        for leaf, dims in size_changes(old.leaves, new.leaves).items():
            varying.setdefault(leaf, {}).update(dims)
    return varying


def size_changes(old: tuple[Any, ...], new: tuple[Any, ...]) -> dict[int, dict[int, Any]]:
    """The dimensions whose sizes differ between two signatures' leaves that agree in all
    else, a dimension free in ``old`` (None) counting as differing; empty where they do not
    agree."""
    changes: dict[int, dict[int, Any]] = {}
    for i, (a, b) in enumerate(zip(old, new, strict=True)):
        if not isinstance(a, TensorSpec) or not isinstance(b, TensorSpec):
            if isinstance(a, TensorSpec) or isinstance(b, TensorSpec) or not _same(a, b):
                return {}
            continue
        if (a.dtype, a.device, len(a.shape)) != (b.dtype, b.device, len(b.shape)):
            return {}
        dims = {d: torch.export.Dim.AUTO
                for d, (x, y) in enumerate(zip(a.shape, b.shape, strict=True)) if x != y}
        if dims:
            changes[i] = dims
    return changes


def _same(a: Any, b: Any) -> bool:
    try:
        return a is b or (type(a) is type(b) and bool(a == b))
    except Exception:  # noqa: BLE001 - incomparable values count as different
        return False
