"""Is the optimized module the same function as the original? Compare them on the example
inputs and on fresh random inputs of the same shapes and dtypes (``inputs``), within each dtype's
tolerance, with gradients where they flow.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from autoopt.check.inputs import InputSets, leaves
from autoopt.errors import first_line, wrapped_error
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
    expected_leaves = dict(leaves(expected, path))
    actual_leaves = dict(leaves(actual, path))
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


def _finiteleaves(value: Any) -> set[str]:
    """The paths of the floating tensors in ``value`` with only finite elements."""
    return {path for path, leaf in leaves(value, "output") if isinstance(leaf, torch.Tensor)
            and leaf.is_floating_point() and bool(torch.isfinite(leaf.detach()).all())}



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
                                f"{type(exc).__name__}: {first_line(exc)}", note())
        if i == 0:
            finite = _finiteleaves(expected)
        elif finite and not finite <= _finiteleaves(expected):
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
    outs = [v for _, v in leaves(outputs, "output") if isinstance(v, torch.Tensor)
            and v.requires_grad and (v.is_floating_point() or v.is_complex())]
    named = [(p, v) for p, v in leaves(inputs, "input") if isinstance(v, torch.Tensor)
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
