"""What a captured graph assumes about the module beyond its inputs, checked on every call.

A whole graph (export, symbolic_trace) bakes in more than the input signature:

- **which tensors** are the parameters and buffers: an export graph holds its own references,
  so ``load_state_dict(assign=True)``, ``module.weight = Parameter(...)`` or
  ``torch.func.functional_call`` (which swaps tensors in for one call) are invisible to it;
- **their values**, for inference graphs whose folded, merged or packed constants are copies:
  in-place writes bump version counters, but writes through ``.data`` (old EMA and init code)
  and ``p.data = other`` do not, so a sampled fingerprint of each tensor's memory is kept too;
- **Python attributes** read while tracing (``self.scale``, ``config.output_attentions``):
  the graph replays the value it saw.

``ModuleWatch`` keeps a snapshot of all three and answers, cheaply enough to ask on every call,
whether it still holds: each check is a few calls that loop in C over every slot, attribute or
tensor (``map`` over getters, one gather for the sampled memory), tens of nanoseconds an item
where a Python step per table and a ``torch.cat`` of a view per tensor cost ten times that
(docs/benchmarks.md: mobilenet_v3_large's 312 tensors, before and after).
"""

from __future__ import annotations

import itertools
import operator
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch import nn

from .cost_model.isolation import _MODULE_INTERNALS

# Parameters and buffers assigned to a watched module (``module.weight = Parameter(...)``,
# ``register_buffer``, ``load_state_dict(assign=True)``) are counted on its watch.
# ``torch.func.functional_call`` swaps tensors into the slots without assigning, for one call:
# a replaced slot with no assignment since the snapshot is such a temporary swap.
# Both sides weak: a watch holds its module, so a strong value would keep the key alive and
# every optimized module (its graphs, its copies of the weights) for the life of the process.
_owners: weakref.WeakKeyDictionary[nn.Module, weakref.ref[ModuleWatch]] = \
    weakref.WeakKeyDictionary()


def _count_assignment(module: nn.Module, name: str, value: Any) -> None:
    ref = _owners.get(module)
    watch = ref() if ref is not None else None
    if watch is not None:
        watch.assignments += 1


torch.nn.modules.module.register_module_parameter_registration_hook(_count_assignment)
torch.nn.modules.module.register_module_buffer_registration_hook(_count_assignment)

_SCALARS = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device)
_SAMPLES = 8  # elements of each tensor's memory in the fingerprint
_VERSION = operator.attrgetter("_version")
# ``getter(namespace)`` for each pair, looped in C (``operator.call`` is Python 3.11+).
_CALL: Callable[..., Any] = getattr(operator, "call", lambda f, x: f(x))


def _is_scalar(value: Any) -> bool:
    if isinstance(value, _SCALARS):
        return True
    return isinstance(value, tuple) and len(value) <= 8 and all(
        isinstance(v, _SCALARS) for v in value)


class ModuleWatch:
    """A snapshot of a module's tensors (identity, version, sampled contents) and of the plain
    Python values its submodules (and objects they hold, such as a ``config``) carry."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.shared: list[torch.Tensor] = []  # tensors on the user's memory (module.py)
        self.refresh_tensors()
        self.refresh_attributes()

    # --- tensors -----------------------------------------------------------------------------

    def refresh_tensors(self) -> None:
        tables: list[dict[str, Any]] = []
        tensors: dict[int, torch.Tensor] = {}
        for m in self.module.modules():
            for table in (m._parameters, m._buffers):
                if any(t is not None for t in table.values()):
                    tables.append(table)
                    for t in table.values():
                        if t is not None:
                            tensors.setdefault(id(t), t)
        # Every slot's value, in order: read again on each call by one ``map`` and compared
        # by identity in C, no Python step per table or tensor.
        self._slots = (tables, list(_values(tables)))
        self.assignments = 0
        self._register()
        # Inference tensors have no version counter and cannot be written outside
        # inference mode; the rest can.
        self.tensors = [t for t in tensors.values() if not t.is_inference()]
        self._fingerprint: _Fingerprint | None = None

    def _register(self) -> None:
        for m in self.module.modules():
            _owners[m] = weakref.ref(self)
        self._registered = True

    def __getstate__(self) -> dict[str, Any]:
        # A copy (pickle, deepcopy) registers its own modules on first use: while it is being
        # rebuilt its modules are not whole yet.
        # The fingerprint reads memory by address: a copy watches its own tensors, and its
        # module captures again anyway (``OptimizedModule.__getstate__``).
        return {**self.__dict__, "_registered": False, "_fingerprint": None}

    def replaced(self) -> bool:
        """Whether any parameter or buffer slot now holds another tensor than at the snapshot
        (``assign=True`` loads, attribute assignment, ``functional_call``), or was deleted
        or added."""
        tables, saved = self._slots
        now = list(_values(tables))
        return len(now) != len(saved) or not all(map(operator.is_, now, saved))

    def reassigned(self) -> bool:
        """Whether a parameter or buffer was assigned to the module since the snapshot: a
        replaced slot is then the module's new state, not a swap for one call."""
        if not self._registered:
            self._register()
        return self.assignments > 0

    def stamp(self, tensors: list[torch.Tensor] | None = None) -> int:
        """Grows with every in-place write to these tensors (default: all the module's):
        version counters only grow."""
        return sum(map(_VERSION, self.tensors if tensors is None else tensors))

    def take_fingerprint(self, tensors: list[torch.Tensor] | None = None) -> None:
        """Remember these tensors' version counters (default: all the module's), where their
        memory is and a few of their elements."""
        self._fingerprint = _Fingerprint(self.tensors if tensors is None else tensors)

    def fingerprint_clean(self, clean: bool) -> None:
        """Whether every graph matched the tensors when the fingerprint was taken; if not,
        ``unchanged`` is False until the next fingerprint."""
        if self._fingerprint is not None:
            self._fingerprint.clean = clean

    def unchanged(self) -> bool:
        """Whether no fingerprinted tensor was written (in place, through ``.data``) or given
        other memory since ``take_fingerprint``: the per-call check, one ``map`` per signal.
        Sampled: a ``.data`` write that misses every sampled element is not seen."""
        fingerprint = self._fingerprint
        return fingerprint is None or fingerprint.holds()

    def rewritten(self) -> set[int]:
        """The ids of the tensors whose memory was swapped (``p.data = other``) or written
        without a version bump (``p.data.mul_(0.5)``) since ``take_fingerprint``. Sampled: a
        write that misses every sampled element is seen only through the version counter."""
        return set() if self._fingerprint is None else self._fingerprint.rewritten()

    # --- Python attributes -------------------------------------------------------------------

    def refresh_attributes(self) -> None:
        namespaces: list[dict[str, Any]] = []
        getters: list[Callable[[dict[str, Any]], Any]] = []
        seen: set[int] = set()

        def watch(namespace: dict[str, Any], keys: list[str]) -> None:
            if keys:
                namespaces.append(namespace)
                getters.append(operator.itemgetter(*keys))

        for m in self.module.modules():
            keys = []
            for key, value in vars(m).items():
                if key in _MODULE_INTERNALS or key.startswith("__"):
                    continue
                if _is_scalar(value):
                    keys.append(key)
                elif (hasattr(value, "__dict__") and not isinstance(value, (nn.Module, type))
                      and not callable(value) and id(value) not in seen):
                    # An object the module reads settings from (a transformers config).
                    seen.add(id(value))
                    watch(vars(value), [k for k, v in vars(value).items()
                                        if not k.startswith("__") and _is_scalar(v)])
            watch(m.__dict__, keys)
        self._getters = (namespaces, getters, list(map(_CALL, getters, namespaces)))

    def attributes_changed(self) -> bool:
        """Whether a watched plain value was re-assigned or deleted since the snapshot."""
        namespaces, getters, saved = self._getters
        try:
            # One getter per namespace, all called by one ``map``; list and tuple equality
            # compare identity first, then values (plain values only, so ``==`` is safe: a
            # new float of the same value is no change).
            return list(map(_CALL, getters, namespaces)) != saved
        except KeyError:
            return True


class _Fingerprint:
    """Version counters, memory addresses and a few sampled elements of some tensors.

    The samples of CPU tensors are read in one gather: a numpy byte array laid over the
    address range the tensors span, indexed at the sampled bytes' offsets (one C call where
    ``torch.cat`` of a view per tensor cost 0.5 µs a tensor). Only addresses inside the
    tensors' storages are read, and only after every tensor's ``data_ptr`` is found where it
    was, so each storage is still the memory it was (the storages are held, so memory that a
    ``p.data = other`` freed is not reused at the same address while this lives). Tensors
    elsewhere (CUDA) or of a tensor subclass are sampled through torch views.
    """

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors
        self.versions = list(map(_VERSION, tensors))
        self.pointers = _pointers(tensors)
        self.clean = True  # set by the owner: whether every graph matched these values
        raw: list[tuple[int, list[int]]] = []  # (tensor index, absolute byte addresses)
        # Views grouped by device and dtype: one concatenation and comparison per group (on
        # a GPU, one synchronization per group, not per tensor).
        groups: dict[tuple[torch.device, torch.dtype], list[tuple[int, torch.Tensor]]] = {}
        self._storages = []
        for i, t in enumerate(tensors):
            if t.is_meta or t.numel() == 0 or t.layout != torch.strided:
                continue
            span = t.untyped_storage().nbytes() // t.element_size() - t.storage_offset()
            count = min(_SAMPLES, span)
            if count <= 0:
                continue
            step = max(1, span // count)
            if t.device.type == "cpu" and type(t) in (torch.Tensor, nn.Parameter):
                size, start = t.element_size(), t.data_ptr()
                raw.append((i, [start + (k * step) * size + b for k in range(count)
                                for b in range(size)]))
                self._storages.append(t.untyped_storage())
            else:
                groups.setdefault((t.device, t.dtype), []).append((i, torch.as_strided(
                    t.detach(), (count,), (step,), t.storage_offset())))
        self._raw = _Gather(raw) if raw else None
        self._groups = list(groups.values())
        self.raw = self._raw.read() if self._raw is not None else b""
        self.samples = [_read(group) for group in self._groups]

    def holds(self) -> bool:
        if not self.clean or list(map(_VERSION, self.tensors)) != self.versions:
            return False
        if _pointers(self.tensors) != self.pointers:  # before reading any memory
            return False
        if self._raw is not None and self._raw.read() != self.raw:
            return False
        return all(torch.equal(_read(group), saved)
                   for group, saved in zip(self._groups, self.samples, strict=True))

    def rewritten(self) -> set[int]:
        now = _pointers(self.tensors)
        moved = {i for i, (a, b) in enumerate(zip(now, self.pointers, strict=True)) if a != b}
        changed = set(moved)
        if self._raw is not None:  # only memory still where it was is read
            changed |= self._raw.differing(self.raw, skip=moved)
        for group, saved in zip(self._groups, self.samples, strict=True):
            current, start = _read(group), 0
            for i, view in group:
                end = start + view.numel()
                if i not in moved and not torch.equal(current[start:end], saved[start:end]):
                    changed.add(i)
                start = end
        return {id(self.tensors[i]) for i in changed}


class _Gather:
    """Bytes at absolute addresses, read by one numpy ``take``."""

    def __init__(self, where: list[tuple[int, list[int]]]) -> None:
        addresses = np.fromiter(itertools.chain.from_iterable(a for _, a in where), np.int64)
        base = int(addresses.min())
        # A byte array from the lowest sampled address to the highest; numpy touches only
        # the bytes indexed.
        self._memory = np.asarray(_Memory(base, int(addresses.max()) - base + 1))
        self._offsets = addresses - base
        self._owner = np.repeat([i for i, _ in where], [len(a) for _, a in where])

    def read(self) -> bytes:
        return self._memory.take(self._offsets).tobytes()

    def differing(self, saved: bytes, skip: set[int]) -> set[int]:
        keep = ~np.isin(self._owner, list(skip)) if skip else slice(None)
        now = self._memory.take(self._offsets[keep])
        old = np.frombuffer(saved, np.uint8)[keep]
        return set(self._owner[keep][now != old].tolist())


class _Memory:
    """Addresses ``base`` to ``base + size`` as numpy's array interface (read only)."""

    def __init__(self, base: int, size: int) -> None:
        self.__array_interface__ = {"data": (base, True), "shape": (size,), "typestr": "|u1",
                                    "version": 3}


def _values(tables: list[dict[str, Any]]) -> Iterator[Any]:
    return itertools.chain.from_iterable(map(dict.values, tables))


def _pointers(tensors: list[torch.Tensor]) -> list[int]:
    return list(map(torch.Tensor.data_ptr, tensors))


def _read(group: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
    """A group's sampled elements in one tensor (a copy), read as integers so that NaN
    weights compare equal to themselves."""
    flat = torch.cat([view for _, view in group])
    bits = _SAME_WIDTH_INT.get(flat.dtype)
    return flat.view(bits) if bits is not None else flat


_SAME_WIDTH_INT = {torch.float32: torch.int32, torch.float64: torch.int64,
                   torch.float16: torch.int16, torch.bfloat16: torch.int16}
