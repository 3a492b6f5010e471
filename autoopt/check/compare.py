"""Is the optimized module the same function as the original? Compare them on the example
inputs and on fresh random inputs of the same shapes and dtypes, within each dtype's tolerance.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from autoopt.errors import wrapped_error
from autoopt.observe import memory_profile

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Tolerance:
    """``|actual - expected| <= atol * scale + rtol * |expected|`` elementwise, where ``scale``
    is ``max(1, max |expected|)`` so that large-valued outputs are not held to an absolute
    error meant for values near one."""

    rtol: float
    atol: float


# Passes reorder float arithmetic (folding, fusion), so fp32 gets more room than bit-exactness;
# the half types keep what their 10- and 7-bit mantissas allow.
TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float64: Tolerance(rtol=1e-7, atol=1e-9),
    torch.float32: Tolerance(rtol=1e-4, atol=1e-5),
    torch.float16: Tolerance(rtol=1e-3, atol=1e-3),
    torch.bfloat16: Tolerance(rtol=1.6e-2, atol=1e-2),
}
_EXACT = Tolerance(rtol=0.0, atol=0.0)

# On a GPU, fp32 convolutions run in TF32 by default (cuDNN), and matmuls do where the user
# allows it: fp16's 10-bit mantissa. There a pass that changes a convolution's weights
# (BatchNorm folding) or the batch a kernel sees (microbatches) moves fp32 results by what
# TF32 allows, so CUDA fp32 outputs are held to fp16's tolerance while TF32 is on.
TF32 = Tolerance(rtol=1e-3, atol=1e-3)  # fp16's


def tf32_enabled() -> bool:
    """Whether PyTorch may run fp32 convolutions or matmuls in TF32 on a CUDA device."""
    return (bool(torch.backends.cudnn.allow_tf32)
            or torch.get_float32_matmul_precision() != "highest")


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of a comparison.

    Args:
        ok: every compared value was within tolerance and the structures matched.
        max_abs_error: largest absolute difference seen over all floating outputs.
        max_rel_error: largest ``|a - b| / max(|b|, tiny)`` seen, for the report.
        inputs_checked: how many input sets were compared (example + random).
        detail: for a failure, where it was (``output[0]['logits']``) and by how much.
        note: what the comparison could not cover, such as random input sets discarded
            because eager itself rejected them (``random input sets discarded: eager raised
            IndexError on them``).
    """

    ok: bool
    max_abs_error: float = 0.0
    max_rel_error: float = 0.0
    inputs_checked: int = 0
    detail: str = ""
    note: str = ""

    def __str__(self) -> str:
        note = f" ({self.note})" if self.note else ""
        if self.ok:
            return (f"matched on {self.inputs_checked} input set(s), max abs error "
                    f"{self.max_abs_error:.3g}{note}")
        return f"MISMATCH: {self.detail}{note}"


def compare(expected: Any, actual: Any, tolerances: Mapping[torch.dtype, Tolerance] | None = None,
            path: str = "output") -> VerifyResult:
    """Compare two output structures leaf by leaf.

    Containers are walked (tuples, lists, dicts including ``ModelOutput``, dataclasses, and plain
    objects such as KV caches through their attributes); tensors are compared with the
    tolerance of their dtype, other leaves with ``==``.
    """
    tols = TOLERANCES if tolerances is None else {**TOLERANCES, **tolerances}
    # A user's fp32 tolerance holds on every device.
    cuda_fp32 = (TF32 if torch.float32 not in (tolerances or {}) and tf32_enabled()
                 else tols[torch.float32])
    expected_leaves = dict(_leaves(expected, path))
    actual_leaves = dict(_leaves(actual, path))
    if expected_leaves.keys() != actual_leaves.keys():
        missing = sorted(expected_leaves.keys() - actual_leaves.keys())[:3]
        extra = sorted(actual_leaves.keys() - expected_leaves.keys())[:3]
        return VerifyResult(False, detail=f"output structure differs: missing {missing}, "
                                          f"unexpected {extra}")
    # Gradients sum many products in an order the rewrite may change, and a gradient that is
    # zero in exact arithmetic (a key projection's bias under softmax) is rounding noise at
    # the scale of the others: they are held to ten times the tolerance, each at its own
    # scale but at least a tenth of the largest gradient's. (At the largest one's scale
    # itself, a small weight's gradient could be wrong entirely and pass: zeroing a BERT
    # query weight's gradient, 0.008 next to embedding gradients of 100, did.)
    grads = [v for k, v in expected_leaves.items() if _is_gradient(k)
             and isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel()]
    grad_scale = GRAD_SCALE_FLOOR * max([1.0, *(float(v.detach().abs().nan_to_num(0, 0, 0).max())
                                                for v in grads)])
    max_abs = max_rel = 0.0
    for key, exp in expected_leaves.items():
        act = actual_leaves[key]
        if isinstance(exp, torch.Tensor) != isinstance(act, torch.Tensor):
            kinds = f"{type(exp).__name__} vs {type(act).__name__}"
            return VerifyResult(False, detail=f"{key}: {kinds}")
        if not isinstance(exp, torch.Tensor):
            if not _equal_values(exp, act):
                return VerifyResult(False, detail=f"{key}: {exp!r} != {act!r}")
            continue
        is_grad = _is_gradient(key)
        failure, abs_err, rel_err = _compare_tensors(
            key, exp, act, tols, cuda_fp32, factor=GRAD_FACTOR if is_grad else 1.0,
            scale_floor=grad_scale if is_grad else 1.0)
        max_abs, max_rel = max(max_abs, abs_err), max(max_rel, rel_err)
        if failure:
            return VerifyResult(False, max_abs, max_rel, detail=failure)
    return VerifyResult(True, max_abs, max_rel)


def _compare_tensors(key: str, exp: torch.Tensor, act: torch.Tensor,
                     tols: Mapping[torch.dtype, Tolerance], cuda_fp32: Tolerance,
                     factor: float = 1.0, scale_floor: float = 1.0,
                     ) -> tuple[str, float, float]:
    if exp.shape != act.shape:
        return f"{key}: shape {tuple(act.shape)} != expected {tuple(exp.shape)}", 0.0, 0.0
    if exp.dtype != act.dtype:
        return f"{key}: dtype {act.dtype} != expected {exp.dtype}", 0.0, 0.0
    if exp.numel() == 0:
        return "", 0.0, 0.0
    e, a = exp.detach().cpu(), act.detach().cpu()
    if not (e.is_floating_point() or e.is_complex()):
        if not torch.equal(e, a):
            return f"{key}: integer/bool values differ", 0.0, 0.0
        return "", 0.0, 0.0
    cuda_fp32_leaf = exp.is_cuda and e.dtype == torch.float32
    tol = cuda_fp32 if cuda_fp32_leaf else tols.get(e.dtype, _EXACT)
    tol = Tolerance(tol.rtol * factor, tol.atol * factor) if factor != 1.0 else tol
    e, a = e.reshape(-1), a.reshape(-1)
    if e.dtype in _FAST_DTYPES:
        errors = _clear_pass(e, a, tol, scale_floor)
        if errors is not None:
            return "", *errors
    # In float64, a chunk at a time: a whole large output (LM logits, 1 x 128 x 32000) in
    # float64 with its masks and differences is several times the output's own bytes.
    chunks = range(0, e.numel(), _CHUNK)
    finite_max = -1.0
    for i in chunks:
        e64, a64 = e[i:i + _CHUNK].to(torch.float64), a[i:i + _CHUNK].to(torch.float64)
        e_nan, a_nan = torch.isnan(e64), torch.isnan(a64)
        if not torch.equal(e_nan, a_nan):
            return f"{key}: NaN in different places", math.inf, math.inf
        finite = torch.isfinite(e64) & torch.isfinite(a64)
        if bool((~finite & ~e_nan & (e64 != a64)).any()):
            return f"{key}: infinities differ", math.inf, math.inf
        if bool(finite.any()):
            finite_max = max(finite_max, float(e64[finite].abs().max()))
    if finite_max < 0:
        return "", 0.0, 0.0
    scale = max(scale_floor, finite_max)
    abs_err = rel_err = 0.0
    worst: tuple[float, float, float] | None = None  # (diff - allowed, actual, expected)
    for i in chunks:
        e64, a64 = e[i:i + _CHUNK].to(torch.float64), a[i:i + _CHUNK].to(torch.float64)
        finite = torch.isfinite(e64) & torch.isfinite(a64)
        if not bool(finite.any()):
            continue
        e64, a64 = e64[finite], a64[finite]
        diff = (a64 - e64).abs()
        allowed = tol.atol * scale + tol.rtol * e64.abs()
        abs_err = max(abs_err, float(diff.max()))
        rel_err = max(rel_err, float((diff / e64.abs().clamp_min(1e-12)).max()))
        excess = diff - allowed
        j = int(torch.argmax(excess))
        if float(excess[j]) > 0 and (worst is None or float(excess[j]) > worst[0]):
            worst = (float(excess[j]), float(a64[j]), float(e64[j]))
    if worst is not None:
        kind = f"{e.dtype}{' (TF32 on CUDA)' if cuda_fp32_leaf and tol is TF32 else ''}"
        return (f"{key}: max abs error {abs_err:.3g} exceeds the {kind} tolerance "
                f"(rtol={tol.rtol:g}, atol={tol.atol:g}x{scale:.3g}); worst element "
                f"{worst[1]:.6g} vs expected {worst[2]:.6g}"), abs_err, rel_err
    return "", abs_err, rel_err


# Elements compared at once: 2 MiB of each side in float64 (about 20 MiB of temporaries).
_CHUNK = 2**18
# Floats whose values float32 holds exactly, which ``_clear_pass`` compares in float32.
_FAST_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Of the tolerance, what float32's rounding of the difference and the allowance may not reach:
# both are within a few float32 ulps (1e-7) of their float64 values.
_MARGIN = 1 - 1e-4


def _clear_pass(e: torch.Tensor, a: torch.Tensor, tol: Tolerance, scale_floor: float,
                ) -> tuple[float, float] | None:
    """``(max abs error, max rel error)`` where every element is finite on both sides and
    within the tolerance by a margin float32's rounding cannot cross, computed in float32 by
    numpy; None otherwise, for the exact float64 comparison to judge.

    numpy, single-threaded: on a loaded machine each of torch's parallel ops can wait tens of
    ms on a descheduled thread (measured, 2 threads at load 4.5: 25-50 ms an op against 0.4
    ms on one thread), and the float64 path's thousand small ops took 7 s for the LM logits of
    1 x 128 x 32000 where this takes about 20 ms."""
    try:
        import numpy as np

        e.numpy(), a.numpy()  # views, or an error (no numpy, a tensor it cannot view)
    except (ImportError, RuntimeError, TypeError):
        return None

    def parts() -> Iterator[tuple[Any, Any]]:  # float32 views (copies of fp16, bf16 chunks)
        chunk = 4 * _CHUNK
        for i in range(0, e.numel(), chunk):
            yield e[i:i + chunk].float().numpy(), a[i:i + chunk].float().numpy()

    finite_max = max(float(np.abs(en).max()) for en, _ in parts())
    if not math.isfinite(finite_max):  # a NaN or an infinity in eager's output
        return None
    scale = max(scale_floor, finite_max)
    abs_err = rel_err = 0.0
    for en, an in parts():
        diff = np.abs(an - en)
        size = np.abs(en)
        allowed = size * np.float32(tol.rtol) + np.float32(tol.atol * scale)
        if not bool((diff <= allowed * np.float32(_MARGIN)).all()):  # NaN or inf of ``a`` too
            return None
        abs_err = max(abs_err, float(diff.max()))
        rel_err = max(rel_err, float((diff / np.maximum(size, np.float32(1e-12))).max()))
    return abs_err, rel_err


def _equal_values(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - values that cannot be compared are treated as different
        return a is b


_MAX_DEPTH = 8


def _leaves(obj: Any, path: str, depth: int = 0) -> Iterator[tuple[str, Any]]:
    """Yield ``(path, leaf)`` for every tensor or plain value inside ``obj``."""
    if depth > _MAX_DEPTH:
        yield path, obj
    elif isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, Mapping):
        for k in obj:
            yield from _leaves(obj[k], f"{path}[{k!r}]", depth + 1)
    elif isinstance(obj, (list, tuple)):
        for i, item in enumerate(obj):
            yield from _leaves(item, f"{path}[{i}]", depth + 1)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for name in attribute_names(obj):
            yield from _leaves(getattr(obj, name), f"{path}.{name}", depth + 1)
    elif obj is None or isinstance(obj, (bool, int, float, complex, str, bytes, torch.dtype,
                                         torch.device, torch.Size)):
        yield path, obj
    elif hasattr(obj, "__dict__") and not callable(obj):
        # Objects that carry tensors in attributes, such as transformers' KV caches.
        for name in attribute_names(obj):
            yield from _leaves(getattr(obj, name), f"{path}.{name}", depth + 1)
    else:
        yield path, type(obj).__name__


def attribute_names(obj: Any) -> list[str]:
    """The attributes of an object that holds values, in the order its leaves are walked: a
    dataclass's fields, else its instance attributes sorted by name. ``capture.objects`` takes
    objects apart in this order, and ONNX output names follow it, so there is one order."""
    state = getattr(obj, "__dict__", None)
    if dataclasses.is_dataclass(obj):
        return [f.name for f in dataclasses.fields(obj) if state is None or f.name in state]
    return sorted(k for k in vars(obj) if not k.startswith("__"))


def fresh_like(value: Any, generator: torch.Generator, empty_row: bool = False) -> Any:
    """A random value of the same type, shape and dtype as ``value``, drawn to look like it.

    Floating tensors get the example's mean and spread (a float 0/1 mask stays a 0/1 mask,
    with some positions masked); an integer 0/1 mask (at least two dimensions, some ones)
    gets another 0/1 pattern with some zeros; other integer tensors (token ids, class
    indices) stay within the example's range so they index the same tables; booleans (masks)
    and non-tensor values are kept, since changing them can change what the model means.
    Parameters are kept as they are. ``empty_row``: a 0/1 mask with a batch of two or more
    gets its first row all zeros (an empty text padded into a batch).
    """
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(fresh_like(v, generator, empty_row) for v in value)
    if isinstance(value, dict):
        return type(value)((k, fresh_like(v, generator, empty_row)) for k, v in value.items())
    if not isinstance(value, torch.Tensor) or isinstance(value, torch.nn.Parameter):
        return value
    if value.numel() == 0 or value.dtype == torch.bool:
        return value.clone()
    if value.is_floating_point():
        finite = value.detach()[torch.isfinite(value.detach())].to(torch.float64)
        if finite.numel() == 0:
            return value.clone()
        if bool(((finite == 0) | (finite == 1)).all()):
            # A float 0/1 mask (attention_mask as floats): noise would turn it into weights
            # the model never sees. Draw another 0/1 pattern instead, with some zeros even
            # where the example had none, so that padded inputs are verified too.
            p = min(max(float(finite.mean()), 0.25), 0.75)
            draw = _mask_draw(value, p, generator, empty_row)
            return draw.to(dtype=value.dtype, device=value.device).requires_grad_(
                value.requires_grad)
        mean = float(finite.mean())
        std = float(finite.std()) if finite.numel() > 1 else 1.0
        std = std if std > 0 else max(abs(mean), 1.0)
        noise = torch.randn(value.shape, generator=generator, dtype=torch.float64)
        out = (noise * std + mean).to(dtype=value.dtype, device=value.device)
        # Keep a non-negative input non-negative (variances, lengths, probabilities).
        if float(finite.min()) >= 0:
            out = out.abs()
        return out.requires_grad_(value.requires_grad)
    if value.is_complex():
        return value.clone()
    if value.dim() >= 2 and bool((value == 1).any()) and bool(((value == 0) | (value == 1)).all()):
        # An integer 0/1 mask (a tokenizer's attention_mask): all ones in the example, the
        # range below would keep it all ones, and padded positions (where ONNX Runtime's
        # attention gave other values than eager's) were never verified. Another 0/1
        # pattern, with some zeros, as for a float mask.
        p = min(max(float(value.double().mean()), 0.25), 0.75)
        draw = _mask_draw(value, p, generator, empty_row)
        return draw.to(dtype=value.dtype, device=value.device)
    # Within the example's observed [min, max], both ends included (randint's end is
    # exclusive): an index table the example fits, the fresh values fit too.
    low, high = int(value.min()), int(value.max())
    if high < torch.iinfo(torch.int64).max:
        out = torch.randint(low, high + 1, value.shape, generator=generator, dtype=torch.int64)
    else:  # high + 1 does not fit: leave out the one top value rather than overflow
        out = torch.randint(low, high, value.shape, generator=generator, dtype=torch.int64)
    return out.to(dtype=value.dtype, device=value.device)


def _mask_draw(value: torch.Tensor, p: float, generator: torch.Generator,
               empty_row: bool) -> torch.Tensor:
    """A 0/1 pattern of ``value``'s shape with ones at rate ``p``; with ``empty_row``, row 0
    of a batch of two or more is all zeros: every kernel of torch's attention gives such a
    row zeros, and ONNX Runtime's translation of it did not (other values, unverified)."""
    draw = torch.rand(value.shape, generator=generator, dtype=torch.float64) < p
    if empty_row and value.dim() >= 2 and value.shape[0] >= 2:
        draw[0] = False
    return draw


# Not 0: a user who seeded 0 to make the example inputs would get the same "fresh" ones.
VERIFY_SEED = 20_241_130


# Replacement draws per random input set on which eager itself raised or went non-finite.
_REDRAWS = 3


class InputSets(list):
    """The example input set followed by random ones, as ``input_sets`` makes them; it can draw
    more of the same kind (``check_all`` replaces a random set eager rejects) and remembers
    what was discarded, so every comparison on the same object sees the same sets."""

    def __init__(self, sets: list[tuple[tuple[Any, ...], dict[str, Any]]],
                 draw: Callable[[], tuple[tuple[Any, ...], dict[str, Any]]] | None = None,
                 ) -> None:
        super().__init__(sets)
        self.draw = draw
        self.redraws_left = _REDRAWS * max(len(sets) - 1, 0)
        # Sets taken out, kept alive: callers memoize eager's results by the sets' ids.
        self.discarded: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
        self.reasons: dict[str, int] = {}  # why, counted

    def note(self) -> str:
        if not self.reasons:
            return ""
        why = "; ".join(f"{reason} ({n})" if n > 1 else reason
                        for reason, n in self.reasons.items())
        kept = f"verified on {len(self)} set(s)" + (" (the example alone)" if len(self) == 1
                                                   else "")
        return f"random input sets discarded: {why}; {kept}"


def input_sets(args: tuple[Any, ...], kwargs: Mapping[str, Any], n_random: int,
               seed: int = VERIFY_SEED) -> InputSets:
    """The example inputs followed by ``n_random`` fresh sets of the same shapes and dtypes.

    The first fresh set's 0/1 masks have a row with every position masked (see
    ``fresh_like``); the others' and later draws' do not, so that a model whose eager output
    for such a row is not finite is still verified on padded inputs.

    The result can draw further sets from the same generator: ``check_all`` replaces a fresh
    set on which eager raises (an index out of range) or gives non-finite values where the
    example did not; such a set says nothing about the optimized version."""
    generator = torch.Generator().manual_seed(seed)
    args, kwargs = tuple(args), dict(kwargs)

    def draw(empty_row: bool = False) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return (tuple(fresh_like(a, generator, empty_row) for a in args),
                {k: fresh_like(v, generator, empty_row) for k, v in kwargs.items()})

    return InputSets([(args, kwargs)] + [draw(empty_row=i == 0) for i in range(n_random)],
                     draw)


class ReferenceFailed(Exception):
    """Eager, the reference of a comparison, raised on an input set (the original exception
    is the ``__cause__``). ``check_all`` discards a random set on which this happens."""


@contextlib.contextmanager
def reference_run() -> Iterator[None]:
    """Wrap the reference (eager) half of a ``check_all`` ``run_pair``: an exception raised
    inside becomes ``ReferenceFailed``, so that ``check_all`` can tell eager rejecting a random
    input set (discarded) from the optimized version raising (a failed comparison)."""
    try:
        yield
    except Exception as exc:
        if wrapped_error(exc) is not None:
            raise
        raise ReferenceFailed(f"{type(exc).__name__}: {exc}") from exc


def _finite_leaves(value: Any) -> set[str]:
    """The paths of the floating tensors in ``value`` with only finite elements."""
    return {path for path, leaf in _leaves(value, "output") if isinstance(leaf, torch.Tensor)
            and leaf.is_floating_point() and bool(torch.isfinite(leaf.detach()).all())}


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0][:200] if lines else ""


def check_all(run_pair: Callable[[tuple[Any, ...], dict[str, Any]], tuple[Any, Any]],
              sets: list[tuple[tuple[Any, ...], dict[str, Any]]],
              tolerances: Mapping[torch.dtype, Tolerance] | None = None) -> VerifyResult:
    """Run ``run_pair(args, kwargs) -> (expected, actual)`` on every input set and compare.

    ``sets[0]`` is the example. A later (random) set on which eager raises (``run_pair`` ran
    it under ``reference_run``) or gives non-finite values where the example's were finite is
    taken out of ``sets`` and, for ``input_sets``' result, replaced by a fresh draw (a few
    tries); the result's ``note`` says what was discarded, and with no usable random set left
    the example alone is compared. An exception of the optimized version (anything else
    ``run_pair`` raises) is a failed comparison, not an error: the caller rolls back.
    """
    max_abs = max_rel = 0.0
    finite: set[str] | None = None
    redraw = sets.draw if isinstance(sets, InputSets) else None
    reasons: dict[str, int] = sets.reasons if isinstance(sets, InputSets) else {}

    def discard(i: int, reason: str) -> None:
        reasons[reason] = reasons.get(reason, 0) + 1
        removed = sets[i]
        if isinstance(sets, InputSets):
            sets.discarded.append(removed)
            if redraw is not None and sets.redraws_left > 0:
                sets.redraws_left -= 1
                sets[i] = redraw()
                return
        del sets[i]

    def note() -> str:
        if isinstance(sets, InputSets):
            return sets.note()
        if not reasons:
            return ""
        return "random input sets discarded: " + "; ".join(reasons)

    i = 0
    while i < len(sets):
        args, kwargs = sets[i]
        which = "example inputs" if i == 0 else f"random input set {i}"
        try:
            expected, actual = run_pair(args, kwargs)
        except ReferenceFailed as exc:
            cause = exc.__cause__ if exc.__cause__ is not None else exc
            if i == 0:
                raise cause from None  # eager rejects the user's own example: not ours to hide
            discard(i, f"eager raised {type(cause).__name__} on them")
            continue
        except Exception as exc:  # noqa: BLE001 - the optimized version raising is a mismatch
            if wrapped_error(exc) is not None:
                raise
            return VerifyResult(False, max_abs, max_rel, i + 1,
                                f"on the {which}: the optimized version raised "
                                f"{type(exc).__name__}: {_first_line(exc)}", note())
        if i == 0:
            finite = _finite_leaves(expected)
        elif finite and not finite <= _finite_leaves(expected):
            discard(i, "eager gave non-finite values on them where the example gave finite ones")
            continue
        result = compare(expected, actual, tolerances)
        del expected, actual
        memory_profile.trim()  # the run's outputs and activations, freed mid-heap
        max_abs, max_rel = max(max_abs, result.max_abs_error), max(max_rel, result.max_rel_error)
        if not result.ok:
            return VerifyResult(False, max_abs, max_rel, i + 1, f"on the {which}: {result.detail}",
                                note())
        i += 1
    return VerifyResult(True, max_abs, max_rel, len(sets), note=note())


def clone_inputs(args: tuple[Any, ...], kwargs: Mapping[str, Any],
                 written: Iterable[int] = (),
                 ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A private copy of every input tensor (parameters excepted), each a leaf that requires
    grad where the original did: a forward may write its inputs, and no run of autoopt's may
    write the user's. An object pytree does not know that holds tensors (transformers'
    ``DynamicCache``, a user's state object) is copied whole, its tensors so: the capture's
    runs grew the user's cache (a decode step's logits 0.59 off) and left an fx ``Proxy`` in a
    state object's attribute.

    ``written``: positions in ``args`` copied even where they hold a parameter (a Dynamo
    subgraph takes its parameters as inputs, and one that ends in ``optimizer.step()`` or
    updates a statistic kept in a parameter writes them: each measuring run applied the
    update again)."""
    def copy_tensor(x: torch.Tensor) -> torch.Tensor:
        return x if isinstance(x, torch.nn.Parameter) else _copy_tensor(x)

    def copy_leaf(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return copy_tensor(x)
        tensors = _tensors_inside(x)
        if not tensors:
            return x
        memo: dict[int, Any] = {id(t): copy_tensor(t) for t in tensors}
        try:
            return copy.deepcopy(x, memo)
        except Exception as exc:  # noqa: BLE001 - an object that cannot be copied is shared
            log.info("an input of type %s cannot be copied (%s): autoopt's runs see the "
                     "object itself", type(x).__name__, exc)
            return x

    copied_args, copied_kwargs = pytree.tree_map(copy_leaf, (tuple(args), dict(kwargs)))
    written = set(written)
    if written:
        copied_args = tuple(_copy_tensor(original) if i in written and isinstance(
            original, torch.nn.Parameter) else copied for i, (copied, original) in enumerate(
                zip(copied_args, args, strict=True)))
    return copied_args, copied_kwargs


def _copy_tensor(x: torch.Tensor) -> torch.Tensor:
    """A plain tensor copy of ``x`` (a parameter's too), a leaf requiring grad where ``x``
    does."""
    clone = x.detach().clone()
    return clone.requires_grad_() if x.requires_grad and clone.is_floating_point() else clone


def _tensors_inside(obj: Any, depth: int = 0) -> list[torch.Tensor]:
    """The tensors an object that is not a tensor holds in its attributes, lists, tuples and
    dicts (a few levels deep)."""
    if depth > 6 or obj is None or isinstance(obj, (bool, int, float, complex, str, bytes,
                                                    torch.dtype, torch.device, type)):
        return []
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple, set, frozenset)):
        children: Iterable[Any] = obj
    elif isinstance(obj, dict):
        children = obj.values()
    elif isinstance(obj, torch.nn.Module) or callable(obj) and not hasattr(obj, "__dict__"):
        return []
    elif hasattr(obj, "__dict__") or dataclasses.is_dataclass(obj):
        children = [getattr(obj, name, None) for name in attribute_names(obj)]
    else:
        return []
    return [t for child in children for t in _tensors_inside(child, depth + 1)]


GRAD_PREFIX = "grad of "  # how gradients are named among a run's compared leaves
GRAD_FACTOR = 10.0
GRAD_SCALE_FLOOR = 0.1  # of the largest gradient: the least scale a gradient is judged at


def _is_gradient(path: str) -> bool:
    return f"['{GRAD_PREFIX}" in path

# Fixed upstream gradients for the backward check: random, so that a gradient summed the wrong
# way or routed to the wrong input cannot match by symmetry.
_GRAD_SEED = 20_241_201


def gradients(outputs: Any, inputs: Any,
              parameters: Iterator[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """The gradients of the floating outputs (weighted by fixed random tensors) with respect
    to every input and parameter that requires grad, by name; None where none reaches it (a
    lost gradient shows as None against eager's tensor). ``.grad`` fields are not touched."""
    outs = [v for _, v in _leaves(outputs, "output") if isinstance(v, torch.Tensor)
            and v.requires_grad and (v.is_floating_point() or v.is_complex())]
    named = [(p, v) for p, v in _leaves(inputs, "input") if isinstance(v, torch.Tensor)
             and v.requires_grad]
    named += [(f"parameter {n}", p) for n, p in parameters if p.requires_grad]
    if not named:
        return {}
    if not outs:
        return {f"{GRAD_PREFIX}{n}": None for n, _ in named}
    generator = torch.Generator().manual_seed(_GRAD_SEED)
    weights = [torch.randn(o.shape, generator=generator, dtype=torch.float64).to(o)
               for o in outs]
    grads = torch.autograd.grad(outs, [v for _, v in named], weights, allow_unused=True)
    return {f"{GRAD_PREFIX}{n}": (g.detach().clone() if g is not None else None)
            for (n, _), g in zip(named, grads, strict=True)}
