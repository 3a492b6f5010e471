"""``calibration=``: the batches static int8 takes its activation ranges from.

``optimize(model, example_inputs, precision="int8", calibration=batches)`` quantizes
convolutions and matrix multiplies with activation scales fixed from ``batches`` (an iterable of
example-input tuples, single tensors, keyword dicts or ``(args, kwargs)`` pairs, or a
``DataLoader`` yielding any of them). The engines that run int8 quantize with their own
libraries (``autoopt.backends.static_int8``); this module only takes the batches in, checks
them against the example inputs and splits off the part calibration never sees.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.utils import _pytree as pytree

from autoopt.errors import ConfigError

# Batches read at most: NNCF's default subset is 300 samples, ONNX Runtime's calibrators
# take every batch given; beyond a few hundred the ranges no longer move.
MAX_BATCHES = 512
# One batch in this many is held out (the last ones), from 8 batches on: the top-1 agreement
# of a classifier is measured there, on inputs calibration did not see.
HOLD_OUT_EVERY = 8


class Calibration:
    """The calibration batches as ``(args, kwargs)`` pairs, materialized once.

    ``fit``: the batches the quantizers observe; ``held_out``: those kept from them for the
    report's agreement (none below ``HOLD_OUT_EVERY`` batches).
    """

    def __init__(self, batches: list[tuple[tuple[Any, ...], dict[str, Any]]]) -> None:
        self.batches = batches
        held = len(batches) // HOLD_OUT_EVERY
        self.fit = batches[:len(batches) - held] if held else batches
        self.held_out = batches[len(batches) - held:] if held else []

    def __len__(self) -> int:
        return len(self.batches)

    def __repr__(self) -> str:  # a config's repr names the batches, never prints them
        return f"Calibration({len(self.batches)} batches)"

    def fingerprint(self) -> str:
        """A digest of the batches' values, for records that hold for this data only."""
        digest = hashlib.sha256()
        for args, kwargs in self.batches:
            for leaf in pytree.tree_leaves((args, kwargs)):
                if isinstance(leaf, torch.Tensor):
                    digest.update(leaf.detach().cpu().contiguous().view(-1)[:4096]
                                  .numpy().tobytes())
        return digest.hexdigest()[:16]

    def like(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Calibration:
        """The same samples in batches shaped like ``(args, kwargs)``: a graph captured for
        another batch size (a later call's) calibrates on the samples cut to its size.
        Raises where the inputs differ in more than the batch dimension."""
        want = [x for x in pytree.tree_leaves((tuple(args), dict(kwargs)))
                if isinstance(x, torch.Tensor)]
        first = [x for x in pytree.tree_leaves(self.batches[0]) if isinstance(x, torch.Tensor)]
        if [tuple(x.shape) for x in want] == [tuple(x.shape) for x in first]:
            return self
        size = want[0].shape[0] if want and want[0].dim() else 0
        if not size or any(x.dim() == 0 or y.dim() == 0 or x.shape[0] != size
                           or x.shape[1:] != y.shape[1:] for x, y in zip(want, first,
                                                                         strict=True)):
            raise ConfigError(f"the calibration batches ({_describe(first)}) cannot be cut "
                              f"into this call's inputs ({_describe(want)}): they differ in "
                              f"more than the batch (first) dimension")
        _, spec = pytree.tree_flatten(self.batches[0])
        columns = list(zip(*(pytree.tree_leaves(b) for b in self.batches), strict=True))
        joined = [torch.cat(c) if isinstance(c[0], torch.Tensor) else c[0] for c in columns]
        samples = next(x.shape[0] for x in joined if isinstance(x, torch.Tensor))
        if samples < size:
            raise ConfigError(f"the calibration batches hold {samples} sample(s), fewer than "
                              f"this call's batch of {size}")
        return Calibration([
            pytree.tree_unflatten([x[start:start + size] if isinstance(x, torch.Tensor) else x
                                   for x in joined], spec)
            for start in range(0, samples - size + 1, size)])

    def check(self, args: tuple[Any, ...], kwargs: Mapping[str, Any],
              forward: Any = None) -> None:
        """Raise unless every batch has the example inputs' structure, dtypes and sizes (but
        the batch size, all batches alike): the int8 graph is the example's graph, and a
        batch it cannot take calibrates nothing. Keyword batches (a tokenizer's dicts) are
        first given the example's layout: what it passes positionally, by ``forward``'s
        parameter names."""
        want, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
        self.batches = [_laid_out(b, forward, len(args), list(kwargs)) for b in self.batches]
        self.__init__(self.batches)  # type: ignore[misc]  # fit and held_out again
        for i, (a, k) in enumerate(self.batches):
            got, got_spec = pytree.tree_flatten((a, k))
            if got_spec != spec:
                raise ConfigError(f"calibration batch {i} is not shaped like the example "
                                  f"inputs ({_describe(want)}): it holds {_describe(got)}. "
                                  f"Give each batch as the model's positional inputs (a tuple),"
                                  f" a keyword dict or an (args, kwargs) pair; a labelled "
                                  f"dataset's without the labels: (x for x, _ in loader).")
            for x, y in zip(want, got, strict=True):
                if isinstance(x, torch.Tensor) and (
                        not isinstance(y, torch.Tensor) or y.dtype != x.dtype
                        or y.shape[1:] != x.shape[1:]):
                    raise ConfigError(
                        f"calibration batch {i} holds {_describe([y])} where the example "
                        f"inputs hold {_describe([x])}: batches must match the example's "
                        f"dtypes and sizes (all but the batch size).")
            if _sizes((a, k)) != _sizes(self.batches[0]):
                raise ConfigError(f"calibration batch {i} holds {_describe(got)} where batch 0 "
                                  f"holds {_describe(pytree.tree_leaves(self.batches[0]))}: "
                                  f"give batches of one size.")
        self.like(args, kwargs)


def calibration(value: Any) -> Calibration | None:
    """``value`` (what the user passed as ``calibration=``) as a ``Calibration``."""
    if value is None or isinstance(value, Calibration):
        return value
    if isinstance(value, (torch.Tensor, str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise ConfigError(f"calibration= takes an iterable of batches (a list of input "
                          f"tuples, or a DataLoader); got {type(value).__name__}. To calibrate "
                          f"on one batch, pass [example_inputs].")
    batches = []
    for i, batch in enumerate(value):
        if i == MAX_BATCHES:
            break
        batches.append(_pair(batch))
    if not batches:
        raise ConfigError("calibration= is empty: give at least one batch (32 or more is "
                          "what post-training quantization usually takes).")
    # A DataLoader's last batch may be smaller: dropped, as drop_last=True would.
    first, last = _sizes(batches[0]), _sizes(batches[-1])
    if len(batches) > 1 and len(last) == len(first) and last != first and all(
            a[1:] == b[1:] and a[:1] > b[:1] for a, b in zip(first, last, strict=True)) \
            and all(_sizes(b) == first for b in batches[:-1]):
        batches.pop()
    return Calibration(batches)


def _pair(batch: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if isinstance(batch, torch.Tensor):
        return (batch,), {}
    if isinstance(batch, Mapping):
        return (), dict(batch)
    if isinstance(batch, (tuple, list)):
        if len(batch) == 2 and isinstance(batch[0], (tuple, list)) and isinstance(
                batch[1], Mapping):
            return tuple(batch[0]), dict(batch[1])
        return tuple(batch), {}
    raise ConfigError(f"a calibration batch is a tensor, a tuple of the model's inputs, a "
                      f"keyword dict or an (args, kwargs) pair; got {type(batch).__name__}")


def _laid_out(batch: tuple[tuple[Any, ...], dict[str, Any]], forward: Any, positional: int,
              keywords: list[str]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    a, k = batch
    if a or not positional or forward is None:
        return batch
    try:
        names = [p.name for p in inspect.signature(forward).parameters.values()
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][:positional]
    except (TypeError, ValueError):
        return batch
    if len(names) < positional or not set(names) <= set(k):
        return batch
    return tuple(k[n] for n in names), {n: k[n] for n in keywords if n in k} | {
        n: v for n, v in k.items() if n not in names and n not in keywords}


def _sizes(batch: tuple[tuple[Any, ...], dict[str, Any]]) -> list[Any]:
    return [tuple(x.shape) for x in pytree.tree_leaves(batch) if isinstance(x, torch.Tensor)]


def _describe(leaves: list[Any]) -> str:
    return ", ".join(f"{tuple(x.shape)}:{str(x.dtype).removeprefix('torch.')}"
                     if isinstance(x, torch.Tensor) else type(x).__name__ for x in leaves)
