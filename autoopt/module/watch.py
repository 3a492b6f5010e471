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

Slots, attributes and train/eval flags are all values in a few hundred dicts (each module's
``__dict__``, ``_parameters``, ``_buffers``, ``_modules``; a config's ``__dict__``). After a
model's run has evicted the caches, walking them costs several times what it does warm (one
cache miss after another through every dict and tensor object), so ``tags`` reads instead
each dict's version tag (PEP 509: CPython gives a dict a new, process-wide unique tag on every
change) in one gather, a cache line per dict; only when a tag moved is the walk needed.
"""

from __future__ import annotations

import functools
import itertools
import operator
import sys
import sysconfig
import types
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch import nn

from autoopt.check.state import HOOK_TABLES
from autoopt.cost_model.isolation import MODULE_INTERNALS

# Parameters and buffers assigned to a watched module (``module.weight = Parameter(...)``,
# ``register_buffer``, ``load_state_dict(assign=True)``) are counted on its watch.
# ``torch.func.functional_call`` swaps tensors into the slots without assigning, for one call:
# a replaced slot with no assignment since the snapshot is such a temporary swap.
# Both sides weak: a watch holds its module, so a strong value would keep the key alive and
# every optimized module (its graphs, its copies of the weights) for the life of the process.
_owners: weakref.WeakKeyDictionary[nn.Module, weakref.ref[ModuleWatch]] = \
    weakref.WeakKeyDictionary()


def _count_assignment(module: nn.Module, name: str, value: Any) -> None:
    if torch.compiler.is_compiling():
        # Dynamo traces global hooks into the user's own compiled forward: reading
        # ``_owners`` there guarded on its entries by position, and once the weak dict
        # changed, building those guards raised IndexError (transformers' static-cache
        # recipe, after autoopt had optimized a model in the same process).
        return
    ref = _owners.get(module)
    watch = ref() if ref is not None else None
    if watch is not None:
        watch.assignments += 1


torch.nn.modules.module.register_module_parameter_registration_hook(_count_assignment)
torch.nn.modules.module.register_module_buffer_registration_hook(_count_assignment)
# A submodule assigned (``model.fc = nn.Linear(...)``) brings tensors no graph holds.
torch.nn.modules.module.register_module_module_registration_hook(_count_assignment)

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


def _names(namespace: dict[str, Any]) -> frozenset[str]:
    return frozenset(k for k in namespace if k not in MODULE_INTERNALS)


def _instance_function(value: Any) -> bool:
    """A function stored on the instance (``m.forward = MethodType(f, m)``): compared by
    identity, as the graph ran the one that was there."""
    return isinstance(value, types.FunctionType | types.MethodType | functools.partial)


class ModuleWatch:
    """A snapshot of a module's tensors (identity, version, sampled contents) and of the plain
    Python values its submodules (and objects they hold, such as a ``config``) carry."""

    # (module's __dict__, key, settings object) as at the snapshot; empty in a watch pickled
    # before it was kept.
    _holders: list[tuple[dict[str, Any], str, Any]] = []

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
            if m._modules:  # a submodule replaced holds tensors no graph saw
                tables.append(m._modules)
        # Every slot's value, in order: read again on each call by one ``map`` and compared
        # by identity in C, no Python step per table or tensor.
        self._slots = (tables, list(_values(tables)))
        self._tag_reader = None  # the dicts to tag are found again on the next ``tags``
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
        return {**self.__dict__, "_registered": False, "_fingerprint": None,
                "_tag_reader": None}

    def tags(self) -> object | None:
        """A token equal to an earlier one only if no dict that ``replaced``,
        ``attributes_changed`` and the train/eval flags read changed in between (nor was
        either snapshot refreshed): then they answer as they did after the earlier token was
        read. None where this Python keeps no dict version tags.

        Read the token before the checks it stands for: a change made after it was read
        moves the next token."""
        if not _TAGS_TRACK_CHANGES:
            return None
        reader = self._tag_reader
        if reader is None:
            reader = self._tag_reader = _Tags(self._tagged_dicts())
        return reader, reader.read()

    def _tagged_dicts(self) -> list[dict[str, Any]]:
        dicts: dict[int, dict[str, Any]] = {}
        # The slot tables of the snapshot too: those of a module since detached are still
        # what ``replaced`` compares.
        for m in self.module.modules():
            for d in (vars(m), m._parameters, m._buffers, m._modules, *_hook_tables(m)):
                dicts.setdefault(id(d), d)
        for d in itertools.chain(self._slots[0], self._getters[0], _global_hook_tables()):
            dicts.setdefault(id(d), d)
        return list(dicts.values())

    def replaced(self) -> bool:
        """Whether any parameter or buffer slot now holds another tensor than at the snapshot
        (``assign=True`` loads, attribute assignment, ``functional_call``), or was deleted
        or added, or a submodule was replaced, added or deleted."""
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
        # Which settings object each module holds: one replaced whole (``model.config =
        # other``) is read by the graph no more, though the old one's values are unchanged.
        holders: list[tuple[dict[str, Any], str, Any]] = []

        def watch(namespace: dict[str, Any], keys: list[str]) -> None:
            if keys:
                namespaces.append(namespace)
                getters.append(operator.itemgetter(*keys))

        # Which names each namespace holds: one added after capture (a value the forward
        # reads with ``getattr(self, name, default)``, a ``forward`` patched on the instance
        # by a wrapper) is a change too.
        names: list[tuple[dict[str, Any], frozenset[str]]] = []
        for m in self.module.modules():
            keys = []
            names.append((m.__dict__, _names(m.__dict__)))
            for key, value in vars(m).items():
                if key in MODULE_INTERNALS or key.startswith("__"):
                    continue
                if _is_scalar(value) or _instance_function(value):
                    keys.append(key)
                elif (hasattr(value, "__dict__") and not isinstance(value, (nn.Module, type))
                      and not callable(value)):
                    # An object the module reads settings from (a transformers config).
                    holders.append((m.__dict__, key, value))
                    if id(value) not in seen:
                        seen.add(id(value))
                        names.append((vars(value), _names(vars(value))))
                        watch(vars(value), [k for k, v in vars(value).items()
                                            if not k.startswith("__") and _is_scalar(v)])
            watch(m.__dict__, keys)
        self._getters = (namespaces, getters, list(map(_CALL, getters, namespaces)))
        self._holders = holders
        self._names = names
        self._tag_reader = None

    def attributes_changed(self) -> bool:
        """Whether a watched plain value was re-assigned or deleted since the snapshot, or a
        settings object replaced by another."""
        namespaces, getters, saved = self._getters
        if any(d.get(key) is not value for d, key, value in self._holders):
            return True
        if any(_names(d) != saved for d, saved in self._names):
            return True
        try:
            # One getter per namespace, all called by one ``map``; list and tuple equality
            # compare identity first, then values (plain values only, so ``==`` is safe: a
            # new float of the same value is no change).
            return list(map(_CALL, getters, namespaces)) != saved
        except KeyError:
            return True


class _Fingerprint:
    """Version counters, memory addresses and a few sampled elements of some tensors.

    The samples of CPU tensors are read in one gather: a numpy array laid over the address
    range the tensors span, indexed at the sampled elements' offsets (one C call where
    ``torch.cat`` of a view per tensor cost 0.5 µs a tensor). Only addresses inside the
    tensors' storages are read, and only after every tensor's ``data_ptr`` is found where it
    was, so each storage is still the memory it was (the storages are held, so memory that a
    ``p.data = other`` freed is not reused at the same address while this lives). Tensors
    elsewhere (CUDA) or of a tensor subclass are sampled through torch views.
    """

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors
        self.counters = _counters(tensors)
        self.pointers = _pointers(tensors)
        self.clean = True  # set by the owner: whether every graph matched these values
        # (tensor index, absolute addresses of the sampled elements, element size)
        raw: list[tuple[int, list[int], int]] = []
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
                raw.append((i, [start + (k * step) * size for k in range(count)], size))
                self._storages.append(t.untyped_storage())
            else:
                groups.setdefault((t.device, t.dtype), []).append((i, torch.as_strided(
                    t.detach(), (count,), (step,), t.storage_offset())))
        self._raw = _Gather(raw) if raw else None
        self._groups = list(groups.values())
        self.raw = self._raw.read() if self._raw is not None else b""
        self.samples = [_read(group) for group in self._groups]

    def holds(self) -> bool:
        # Versions and addresses before reading any memory.
        if not self.clean or _counters(self.tensors) != self.counters:
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
    """Elements at absolute addresses, read by one numpy ``take`` per word size and alignment
    (a word per element: cold, the index of a byte per sample cost as much as the samples)."""

    def __init__(self, where: list[tuple[int, list[int], int]]) -> None:
        words: dict[tuple[int, int], tuple[list[int], list[int]]] = {}
        for owner, addresses, size in where:
            word = min(size & -size, 8)  # the widest word that tiles the element
            for address in addresses:
                for a in range(address, address + size, word):
                    where_, owners = words.setdefault((word, a % word), ([], []))
                    where_.append(a)
                    owners.append(owner)
        self._parts = [_part(word, a, o) for (word, _), (a, o) in words.items()]

    def read(self) -> bytes:
        return b"".join([memory.take(index).tobytes() for memory, index, _ in self._parts])

    def differing(self, saved: bytes, skip: set[int]) -> set[int]:
        changed: set[int] = set()
        start = 0
        for memory, index, owner in self._parts:
            end = start + index.size * memory.itemsize
            keep = ~np.isin(owner, list(skip)) if skip else slice(None)
            now = memory.take(index[keep])
            old = np.frombuffer(saved[start:end], memory.dtype)[keep]
            changed |= set(owner[keep][now != old].tolist())
            start = end
        return changed


def _part(word: int, addresses: list[int], owners: list[int],
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Words of ``word`` bytes, every address the same modulo ``word``: an array of them from
    the lowest address to the highest (numpy touches only the words indexed), the indices,
    and whose each is."""
    memory, index = _span(word, np.array(addresses, np.int64))
    return memory, index, np.array(owners, np.int64)


def _span(word: int, where: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The memory from the lowest address in ``where`` to the highest as ``word``-byte
    unsigned words (numpy touches only those indexed), and each address's index in it."""
    base = int(where.min())
    typestr = np.dtype(f"u{word}").str
    memory = np.asarray(_Memory(base, int(where.max() - base) // word + 1, typestr))
    return memory, (where - base) // word


class _Memory:
    """Addresses ``base`` to ``base + size`` as numpy's array interface (read only), as bytes
    or as ``size`` items of ``typestr``."""

    def __init__(self, base: int, size: int, typestr: str = "|u1") -> None:
        self.__array_interface__ = {"data": (base, True), "shape": (size,), "typestr": typestr,
                                    "version": 3}


# PyDictObject: the object header, ``ma_used``, ``ma_version_tag`` (Include/cpython/dictobject.h).
_USED_OFFSET = object.__basicsize__
_TAG_OFFSET = _USED_OFFSET + 8


class _Tags:
    """The version tags of some dicts, read by one gather of a word each. The dicts are held,
    so each address stays that dict's."""

    def __init__(self, dicts: list[dict[str, Any]]) -> None:
        self._dicts = dicts
        self._words = _words(id(d) + _TAG_OFFSET for d in dicts)

    def read(self) -> bytes:
        return self._words().tobytes()


def _words(addresses: Iterator[int]) -> Callable[[], np.ndarray]:
    """A reader of the 8-byte words at these (8-byte aligned) addresses, one numpy ``take``."""
    where = np.fromiter(addresses, np.int64)
    if np.any((where - where.min()) % 8):
        raise ValueError("unaligned words")
    memory, index = _span(8, where)
    return lambda: memory.take(index)


def _tags_track_changes() -> bool:
    """Whether this Python gives a dict a new version tag on every change the checks must see.

    CPython 3.10 to 3.12 with the GIL: PEP 509 tags, where an object's attribute store, once
    its ``__dict__`` exists, goes through the dict. (3.13 stores it in the object's inline
    values, 3.14 dropped the tags: there the checks walk the dicts on every call.) The layout
    and each kind of change are tried here, so an interpreter that differs is found out."""
    if (sys.implementation.name != "cpython" or not (3, 10) <= sys.version_info[:2] <= (3, 12)
            or sysconfig.get_config_var("Py_GIL_DISABLED") or _TAG_OFFSET % 8):
        return False
    probe, plain = nn.Linear(2, 2), _Plain()
    dicts = [vars(probe), probe._parameters, probe._buffers, probe._modules, vars(plain),
             {}, dict.fromkeys(range(40))]
    used = _words(id(d) + _USED_OFFSET for d in dicts)()
    if used.tolist() != [len(d) for d in dicts]:
        return False
    tags = _Tags(dicts)

    def moves(change: Callable[[], Any]) -> bool:
        before = tags.read()
        change()
        return tags.read() != before

    hooks = _Tags(_hook_tables(probe))  # OrderedDicts: a dict's layout, its tags
    before = hooks.read()
    handle = probe.register_forward_hook(lambda *_: None)
    registered = hooks.read()
    handle.remove()
    if not before != registered != hooks.read():
        return False
    parameter = nn.Parameter(torch.zeros(2))
    changes: list[Callable[[], Any]] = [
        lambda: setattr(probe, "scale", 0.5), lambda: object.__setattr__(probe, "scale", 2.0),
        lambda: delattr(probe, "scale"), probe.eval, lambda: setattr(probe, "bias", parameter),
        lambda: probe._parameters.__setitem__("bias", nn.Parameter(torch.zeros(2))),
        lambda: probe._parameters.pop("bias"), lambda: probe.register_buffer("b", parameter),
        lambda: probe._buffers.update(b=torch.ones(1)), probe._buffers.popitem,
        lambda: probe._buffers.setdefault("c", None), probe._buffers.clear,
        lambda: probe._modules.__setitem__("sub", nn.ReLU()),
        lambda: probe._modules.__delitem__("sub"), lambda: dicts[5].__ior__({1: 2}),
        lambda: delattr(plain, "scale")]
    return (all(map(moves, changes))
            and all(_stores_move(tags, target) for target in (probe, plain, probe, plain)))


def _hook_tables(module: nn.Module) -> list[dict[Any, Any]]:
    """The module's forward and backward hook tables: a hook registered after capture is one
    the graphs do not run (``OptimizedModule._check_hooks``)."""
    return [t for t in (getattr(module, n, None) for n in HOOK_TABLES) if isinstance(t, dict)]


def _global_hook_tables() -> list[dict[Any, Any]]:
    from torch.nn.modules import module as module_impl

    tables = (getattr(module_impl, f"_global{n}", None) for n in HOOK_TABLES)
    return [t for t in tables if isinstance(t, dict)]


class _Plain:
    """An object modules read settings from (a config), its ``__dict__`` made by ``vars``."""

    def __init__(self) -> None:
        self.scale = 1.0


def _stores_move(tags: _Tags, target: Any) -> bool:
    """Attribute stores from one line of bytecode, run until the interpreter specializes it."""
    before = tags.read()
    for value in range(64):
        target.scale = value + 0.5
        now = tags.read()
        if now == before:
            return False
        before = now
    return True


_TAGS_TRACK_CHANGES = _tags_track_changes()


def _values(tables: list[dict[str, Any]]) -> Iterator[Any]:
    return itertools.chain.from_iterable(map(dict.values, tables))


def _pointers(tensors: list[torch.Tensor]) -> list[int]:
    return list(map(torch.Tensor.data_ptr, tensors))


def _counters(tensors: list[torch.Tensor]) -> bytes:
    """Every tensor's version counter, then its ``data_ptr``, as one array of words: compared
    with the saved one in one contiguous read, where a list held a Python int per tensor (each
    a cache miss once a model's run has evicted them)."""
    return np.fromiter(itertools.chain(map(_VERSION, tensors), map(torch.Tensor.data_ptr, tensors)),
                       np.uint64, 2 * len(tensors)).tobytes()


def _read(group: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
    """A group's sampled elements in one tensor (a copy), read as integers so that NaN
    weights compare equal to themselves."""
    flat = torch.cat([view for _, view in group])
    bits = _SAME_WIDTH_INT.get(flat.dtype)
    return flat.view(bits) if bits is not None else flat


_SAME_WIDTH_INT = {torch.float32: torch.int32, torch.float64: torch.int64,
                   torch.float16: torch.int16, torch.bfloat16: torch.int16}
