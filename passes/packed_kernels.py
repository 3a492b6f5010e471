"""The packed linear kernels ``packed_linear`` lowers to: MKL's packed sgemm and oneDNN's linear
on a weight reordered once into its blocked layout, bound to one weight as a callable the graph
calls (``PackedLinear``); the oneDNN copies are shared by every graph of one model.

MKL's packed GEMM is fp32 only; oneDNN's runs fp32 and bf16 (AMX or AVX-512 BF16 where the CPU
has them: a bf16 decode step's linears read half of fp32's bytes). For bf16 linears FBGEMM's
fp16 GEMM (``fbgemm_fp16``: ``quantized::linear_dynamic_fp16``) is the other candidate: the
bf16 weight held in fp16, which holds every bf16 value from 2^-14 to 65504 exactly (a
smaller one to within 2^-25), the activations in fp32, the product rounded to bf16 once, as
oneDNN's. It streams a decode step's weights at ~28 GB/s where oneDNN's bf16 GEMV reads ~14
(an AMD EPYC without AMX, 1 thread, one row; llama.cpp's f16 reads ~25 there).
"""

from __future__ import annotations

import contextlib
import platform
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor

# The packed kernels, in the order ties and the unmeasured default prefer them. ``fp32_rows``,
# ``fp32_stream`` and ``bf16_stream`` are autoopt's own GEMVs (``block_kernels``) on the
# weight as it is, no copy: candidates for linears of a few rows (``ROWS_KERNEL_MAX``), a
# decode step's. The first streams 8 weight rows at once, prefetched ahead; the others one row
# after another, which the hardware prefetcher follows (faster on an AMD EPYC, where the
# software prefetch costs), the last on bf16 weights widened in registers.
KERNELS = ("mkl", "onednn", "fbgemm_fp16", "fp32_rows", "fp32_stream", "bf16_stream")
# autoopt's own GEMVs, by their op (a weight as the model holds it, nothing packed).
OWN_GEMV = {"fp32_rows": "fp32_linear", "fp32_stream": "fp32_stream_linear",
            "bf16_stream": "bf16_stream_linear"}
ROWS_KERNEL_MAX = 4
# Kernels that run on their packed copy alone (a weight a pass made is not kept beside it).
_PACKED_ONLY = ("onednn", "fbgemm_fp16")
# The largest magnitude fp16 holds: a weight beyond it is not packed for ``fbgemm_fp16``.
_FP16_MAX = 65504.0
# The dtypes some packed kernel computes in (``kernels_for``).
DTYPES = (torch.float32, torch.bfloat16)


class PackedLinear:
    """One linear's packed-GEMM call with its packed weight bound: the graph calls this object.

    ``kernel`` is ``"mkl"`` (MKL's packed sgemm) or ``"onednn"`` (oneDNN's linear on a
    weight reordered into its blocked layout). ``weight`` is in ``F.linear``'s layout
    ``(out, in)``, possibly a transposed view of the model's own tensor (no copy); for a
    weight a pass made (``derived``: a merged one), ``onednn`` keeps only its shape (a meta
    tensor), its packed copy being all it reads. Packed weights
    are opaque (no storage) and derived from the model's weights, so a deep copy of the graph
    shares them. On meta or fake tensors (shape propagation, FLOP counting) it computes the same
    thing with ``F.linear``.

    ``release()`` drops the packed copy (and a merged weight that ``source`` can concatenate
    again) while another backend is built and measured; ``restore()``, or the next call, packs
    it again from the same weights.
    """

    def __init__(self, weight: torch.Tensor, rows: int, kernel: str = "mkl",
                 derived: bool = False,
                 source: Callable[[], torch.Tensor] | None = None) -> None:
        if kernel not in KERNELS:
            raise ValueError(f"packed_linear: no kernel {kernel!r} (known: {KERNELS})")
        self.kernel = kernel
        self.__name__ = f"{kernel}_linear"  # what FX prints and names the call's global
        self.weight, self.rows, self.source, self.derived = weight, rows, source, derived
        self.packed: torch.Tensor | None = self._pack()
        if kernel in _PACKED_ONLY and derived:
            # oneDNN runs on the packed copy alone: holding a weight a pass made (a merged
            # Q/K/V weight) would keep a second copy alive (the user's own costs nothing).
            self.weight = weight.to("meta")
        self.threads = torch.get_num_threads()  # what the packing and the choice were made for
        # The cost model keys measurements by op name and argument shapes; the weight is bound
        # here, not an argument, so the name carries the kernel and the weight's shape
        # ("linear" before the bracket names the family).
        self.__qualname__ = f"linear[{kernel},{'x'.join(map(str, weight.shape))},m{rows}]"

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.device.type == "meta" or isinstance(x, FakeTensor):
            return F.linear(x, x.new_empty(self.weight.shape), bias)
        if self.packed is None:
            self.restore()
        if self.kernel == "onednn":
            # oneDNN's blocked layout does not depend on the thread count (measured: a weight
            # reordered at 1 thread runs as fast at 2 as one reordered at 2), and the kernel
            # takes any row count.
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")
        if self.kernel == "fbgemm_fp16":
            return _fp16_linear(x, self.packed, bias)
        if self.kernel in OWN_GEMV:
            return getattr(torch.ops.autoopt_blocks, OWN_GEMV[self.kernel])(x, self.packed, bias)
        threads = torch.get_num_threads()
        if threads != self.threads:
            # MKL packs for the thread count of the moment: a weight packed at 1 thread runs on
            # 1 thread only (measured: 2x slower at 2 threads than one packed at 2), so the
            # weight is packed again for the new count, once.
            self.packed, self.threads = self._pack(), threads
        # MKL checks the row count itself: at another count it runs aten.linear on ``weight``.
        return torch.ops.mkl._mkl_linear(x, self.packed, self.weight, bias, self.rows)

    def release(self) -> int:
        """Drop the packed copy, and a weight of ours that ``source`` makes again; the bytes
        dropped (none where it cannot be packed again: a pass's weight with no source)."""
        if self.packed is None or (self.weight.is_meta and self.source is None):
            return 0
        if self.kernel in OWN_GEMV:
            if self.source is None:
                return 0  # the weight itself: nothing of ours to drop
            dropped = self.weight.nbytes  # a merged weight, concatenated again on restore
            self.packed, self.weight = None, self.weight.to("meta")
            return dropped
        dropped = self.weight.nbytes
        self.packed = None
        if self.source is not None and not self.weight.is_meta:
            self.weight = self.weight.to("meta")  # a merged copy: concatenated again
            dropped *= 2
        return dropped

    def restore(self) -> None:
        """Pack the weight again (the same layout from the same values: the same results)."""
        if self.packed is not None:
            return
        if self.weight.is_meta:
            assert self.source is not None, "released without a source"
            weight = self.source()
            if self.kernel in _PACKED_ONLY:
                self.packed = self._pack(weight)
                return
            self.weight = weight
        self.packed, self.threads = self._pack(), torch.get_num_threads()

    def _pack(self, weight: torch.Tensor | None = None) -> torch.Tensor:
        weight = self.weight if weight is None else weight
        if self.kernel == "onednn":
            return _onednn_packed(weight, None if self.derived and self.source is None
                                  else _identity(self.source, weight))
        if self.kernel == "fbgemm_fp16":
            return pack_fp16(weight)
        if self.kernel in OWN_GEMV:
            return weight.contiguous()  # the weight itself (``rows_kernel_fits``)
        return torch.ops.mkl._mkl_reorder_linear_weight(weight.contiguous(), self.rows)

    def reference(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The same function in ATen, on the unpacked weight."""
        if self.packed is None:
            self.restore()
        assert self.packed is not None
        if not self.weight.is_meta:
            weight = self.weight
        elif self.kernel == "fbgemm_fp16":
            weight = torch.ops.quantized.linear_unpack_fp16(self.packed)[0].to(x.dtype)
        else:
            weight = self.packed.to_dense()
        return F.linear(x, weight, bias)

    def __deepcopy__(self, memo: dict[int, Any]) -> PackedLinear:
        return self

    def __repr__(self) -> str:
        return f"{self.__name__}(weight={tuple(self.weight.shape)}, rows={self.rows})"


# oneDNN's packed weights by what they were packed from. The layout depends on the values
# alone (no row count, no thread count), so every graph of one model (its example call, a
# decode step, a prompt step) calls one copy. An entry lives as long as some graph holds the
# copy, and that graph holds the weights it names: their addresses are not reused meanwhile.
# (A WeakValueDictionary: its entries go when a collection frees a copy, which may happen in
# the middle of any allocation, with no lock of ours to deadlock on.)
_SHARED: weakref.WeakValueDictionary[tuple[Any, ...], torch.Tensor] = \
    weakref.WeakValueDictionary()
_SAMPLES = 64


class Concatenation:
    """Makes a merged weight again from the model's weights (a ``source``), which it names."""

    def __init__(self, parts: list[torch.Tensor]) -> None:
        self.parts = parts

    def __call__(self) -> torch.Tensor:
        return torch.cat(self.parts)


def _identity(source: Callable[[], torch.Tensor] | None,
              weight: torch.Tensor) -> tuple[Any, ...] | None:
    """The model's tensors a weight is made from, each by address, layout and version; None
    where one keeps no version (made under ``inference_mode``): not shared."""
    tensors = source.parts if isinstance(source, Concatenation) else [weight]
    if any(t.is_inference() for t in tensors):
        return None
    return tuple((t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t._version)
                 for t in tensors)


def _sample(weight: torch.Tensor) -> torch.Tensor:
    # A linear's weight is contiguous or the transposed view of one (GPT-2's Conv1D): no copy.
    flat = (weight if weight.is_contiguous() else weight.t()).detach().reshape(-1)
    return flat[::max(1, flat.numel() // _SAMPLES)].clone()


def _onednn_packed(weight: torch.Tensor, key: tuple[Any, ...] | None) -> torch.Tensor:
    """``weight`` in oneDNN's blocked layout, the copy another graph holds where one packed
    the same tensors (same addresses, versions and sampled values: a write through ``.data``
    bumps no version). ``key`` None: a weight a pass made, packed on its own.

    Without the row-count hint: the layout oneDNN picks for one row streams from memory at 2/3
    the speed of its default one (GPT-2's layers at 1 thread on an AMD EPYC, weights out of
    cache: 16.5 against 10.7 ms a token), which is as fast (within 3%) from 4 to 64 rows and
    faster at 256."""
    if key is None:
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())
    sample = _sample(weight)
    packed = _SHARED.get(key)
    if packed is not None and torch.equal(packed.autoopt_sample, sample):
        return packed
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())
    packed.autoopt_sample = sample  # what it was packed from, sampled
    _SHARED[key] = packed
    return packed


def _fp16_linear(x: torch.Tensor, packed: Any, bias: torch.Tensor | None) -> torch.Tensor:
    """FBGEMM's fp16-weight GEMM on ``x`` (bf16) in fp32, the bias added in fp32, the result
    rounded to ``x``'s dtype once."""
    y = torch.ops.quantized.linear_dynamic_fp16(x.reshape(-1, x.shape[-1]).float(), packed)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])


@contextlib.contextmanager
def quantized_engine(name: str | None) -> Iterator[None]:
    """Pack for ``name``; the packed weight remembers its engine, so restore the global one."""
    previous = torch.backends.quantized.engine
    if name is not None:
        torch.backends.quantized.engine = name
    try:
        yield
    finally:
        torch.backends.quantized.engine = previous


def fbgemm_engine() -> str | None:
    """The quantized engine that runs FBGEMM's kernels in this build (x86's linears are
    FBGEMM's), or None (not an x86 build)."""
    supported = torch.backends.quantized.supported_engines
    return next((e for e in ("x86", "fbgemm") if e in supported), None)


def pack_fp16(weight: torch.Tensor) -> Any:
    """``weight`` ``(out, in)`` in fp16, packed for FBGEMM's fp16 GEMM (the bias left out)."""
    with quantized_engine(fbgemm_engine()):
        return torch.ops.quantized.linear_prepack_fp16(weight.detach().float().contiguous(),
                                                       None)


def fits_fp16(weight: torch.Tensor) -> bool:
    """Whether ``fbgemm_fp16`` can hold ``weight``: every magnitude within fp16's range."""
    if weight.is_meta or isinstance(weight, FakeTensor):
        return True
    return bool(weight.detach().abs().amax() <= _FP16_MAX) if weight.numel() else True


def kernels(device: torch.device) -> tuple[str, ...]:
    """The packed kernels this PyTorch build has for ``device``, in ``KERNELS``' order."""
    if device.type != "cpu":
        return ()
    found = {
        "mkl": torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear"),
        "onednn": (torch.backends.mkldnn.is_available()
                   and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
                   and hasattr(torch.ops.mkldnn, "_linear_pointwise")),
        "fbgemm_fp16": (fbgemm_engine() is not None
                        and hasattr(torch.ops.quantized, "linear_prepack_fp16")),
        # Built on first use: asked by ``rows_kernel_fits``, for a linear they may serve.
        **dict.fromkeys(OWN_GEMV, platform.machine().lower() in ("x86_64", "amd64")),
    }
    return tuple(k for k in KERNELS if found[k])


def kernels_for(dtype: torch.dtype) -> tuple[str, ...]:
    """The packed kernels that compute in ``dtype``: MKL's sgemm fp32 only; oneDNN's bf16 too
    where this build and CPU run oneDNN in bf16 (elsewhere oneDNN refuses it); FBGEMM's fp16
    GEMM bf16 only (its fp16 weight would round an fp32 one)."""
    if dtype == torch.float32:
        return ("mkl", "onednn", "fp32_rows", "fp32_stream")
    if dtype == torch.bfloat16:
        return (("onednn",) if torch.ops.mkldnn._is_mkldnn_bf16_supported() else ()) + (
            "fbgemm_fp16", "bf16_stream")
    return ()


def rows_kernel_fits(weight: torch.Tensor, rows: int) -> bool:
    """Whether autoopt's own GEMVs (``OWN_GEMV``) serve a linear: a few rows of activations, a
    contiguous ``(out, in)`` fp32 or bf16 weight (GPT-2's transposed ``Conv1D`` view is not: a
    copy would double its bytes), and the kernels built on this machine (AVX-512, a compiler:
    see ``block_kernels.unavailable``). ``kernels_for`` says which of them takes the dtype."""
    from . import block_kernels

    return (rows <= ROWS_KERNEL_MAX and weight.dtype in (torch.float32, torch.bfloat16)
            and weight.dim() == 2
            and weight.is_contiguous() and block_kernels.unavailable() is None)


def available(device: torch.device) -> bool:
    """Some packed linear exists in this build (MKL's, oneDNN's, FBGEMM's fp16) or may be
    built (autoopt's GEMV, on an x86-64 CPU), and the target is the CPU."""
    return bool(kernels(device))
