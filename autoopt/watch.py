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

``ModuleWatch`` keeps a snapshot of all three and answers, cheaply enough to ask on every call
(tens of microseconds for a few hundred tensors), whether it still holds.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Callable
from typing import Any

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
        slots: list[tuple[dict[str, Any], Callable[[dict[str, Any]], Any], tuple[Any, ...]]] = []
        tensors: dict[int, torch.Tensor] = {}
        for m in self.module.modules():
            for table in (m._parameters, m._buffers):
                names = [name for name, t in table.items() if t is not None]
                if not names:
                    continue
                # One getter per table, compared by identity in C: a call pays ~0.3 µs a
                # table instead of a Python step per tensor.
                slots.append((table, operator.itemgetter(*names, names[0]),
                              tuple(table[name] for name in names) + (table[names[0]],)))
                for name in names:
                    tensors.setdefault(id(table[name]), table[name])
        self._slots = slots
        self.assignments = 0
        self._register()
        # Inference tensors have no version counter and cannot be written outside
        # inference mode; the rest can.
        self.tensors = [t for t in tensors.values() if not t.is_inference()]
        self._fingerprint: tuple[list[int], list[torch.Tensor]] | None = None

    def _register(self) -> None:
        for m in self.module.modules():
            _owners[m] = weakref.ref(self)
        self._registered = True

    def __getstate__(self) -> dict[str, Any]:
        # A copy (pickle, deepcopy) registers its own modules on first use: while it is being
        # rebuilt its modules are not whole yet.
        return {**self.__dict__, "_registered": False}

    def replaced(self) -> bool:
        """Whether any parameter or buffer slot now holds another tensor than at the snapshot
        (``assign=True`` loads, attribute assignment, ``functional_call``)."""
        for table, get, saved in self._slots:
            try:
                now = get(table)
            except KeyError:  # deleted
                return True
            if not all(map(operator.is_, now, saved)):
                return True
        return False

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
        """Remember where these tensors' memory is (default: all the module's) and a few of
        their elements."""
        tensors = self.tensors if tensors is None else tensors
        views = self._sample_views(tensors)
        self._fingerprint = (tensors, self._pointers(tensors), views, self._read(views))

    def rewritten(self) -> set[int]:
        """The ids of the tensors whose memory was swapped (``p.data = other``) or written
        without a version bump (``p.data.mul_(0.5)``) since ``take_fingerprint``. Sampled: a
        write that misses every sampled element is seen only through the version counter."""
        if self._fingerprint is None:
            return set()
        tensors, pointers, views, samples = self._fingerprint
        now = self._pointers(tensors)
        if now != pointers:  # before reading the views, which still see the old memory
            return {id(t) for t, a, b in zip(tensors, now, pointers, strict=True) if a != b}
        changed: set[int] = set()
        for (owners, group), current, saved in zip(views, self._read(views), samples,
                                                   strict=True):
            if torch.equal(current, saved):
                continue
            start = 0
            for owner, view in zip(owners, group, strict=True):
                end = start + view.numel()
                if not torch.equal(current[start:end], saved[start:end]):
                    changed.add(owner)
                start = end
        return changed

    @staticmethod
    def _pointers(tensors: list[torch.Tensor]) -> list[int]:
        return list(map(torch.Tensor.data_ptr, tensors))

    @staticmethod
    def _sample_views(tensors: list[torch.Tensor]) -> list[tuple[list[int], list[torch.Tensor]]]:
        """Views of a few elements spread over each tensor's memory, grouped by dtype with
        the id of the tensor each came from (made once: a view per tensor per call would cost
        more than a small model's forward)."""
        groups: dict[torch.dtype, tuple[list[int], list[torch.Tensor]]] = {}
        for t in tensors:
            if t.is_meta or t.numel() == 0 or t.layout != torch.strided:
                continue
            span = t.untyped_storage().nbytes() // t.element_size() - t.storage_offset()
            count = min(_SAMPLES, span)
            if count <= 0:
                continue
            step = max(1, span // count)
            view = torch.as_strided(t.detach(), (count,), (step,), t.storage_offset())
            owners, group = groups.setdefault(t.dtype, ([], []))
            owners.append(id(t))
            group.append(view)
        return list(groups.values())

    @staticmethod
    def _read(views: list[tuple[list[int], list[torch.Tensor]]]) -> list[torch.Tensor]:
        """The sampled elements, one concatenation per dtype, read as integers so that NaN
        weights compare equal to themselves."""
        out = []
        for _, group in views:
            flat = torch.cat(group)
            bits = _SAME_WIDTH_INT.get(flat.dtype)
            out.append(flat.view(bits) if bits is not None else flat)
        return out

    # --- Python attributes -------------------------------------------------------------------

    def refresh_attributes(self) -> None:
        getters: list[tuple[dict[str, Any], Callable[[dict[str, Any]], Any], Any]] = []
        seen: set[int] = set()

        def watch(namespace: dict[str, Any], keys: list[str]) -> None:
            if keys:
                get = operator.itemgetter(*keys)
                getters.append((namespace, get, get(namespace)))

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
        self._getters = getters

    def attributes_changed(self) -> bool:
        """Whether a watched plain value was re-assigned or deleted since the snapshot."""
        for namespace, get, saved in self._getters:
            try:
                now = get(namespace)
            except KeyError:
                return True
            if now is not saved and now != saved:
                return True
        return False


_SAME_WIDTH_INT = {torch.float32: torch.int32, torch.float64: torch.int64,
                   torch.float16: torch.int16, torch.bfloat16: torch.int16}
