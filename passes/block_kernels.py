"""int8 and int4 linears in llama.cpp's manner, as kernels of autoopt's own: the activations
quantized to int8 per block of 32 input features at each call, int8 x int8 (int4 x int8) dot
products with AVX-512 VNNI, one fp32 scale step per block (``block_gemm.cpp``). Beside them,
fp16 weights with fp32 activations (``fp16_panels``), for ``precision="bf16"`` on a CPU
without a fast bf16 GEMM, in the same panels; and an fp32 GEMV on the weight as the model holds
it (``fp32_linear``, ``packed_kernels``' ``fp32_rows``: fp32 decode steps), measured beside
MKL's and oneDNN's.

    x ─ linear(W, b) ─ y   ⟶   x ─ autoopt_blocks.int8_linear(panels(q8 + 128), s, b) ─ y
    x ─ linear(W, b) ─ y   ⟶   x ─ autoopt_blocks.int4_linear(panels(q4 | s | z), b) ─ y

The weights are ``weight_only``'s (the same codes, scales and zeros: int8 per output channel,
int4 in groups), laid out in panels of 16 output rows that one ``vpdpbusd`` multiplies by 4
broadcast input features. ATen's weight-only kernels take bf16 activations and, at one row,
ran at 23% (int4) and 39% (int8) of the memory roofline on an Intel Xeon without AMX; these
read the weights at ~11-14 GB/s there (the machine streams 15.7). They are candidates like any
other kernel: ``precision_int8.slower_than_fp32`` measures them per shape beside fp32's and
the others, and keeps the fastest.

The C++ source is compiled on first use as a torch C++ extension (~20 s, once) into autoopt's
cache folder, keyed by the source's hash, torch's version and the flags; where there is no
compiler or ninja, no x86-64 CPU with AVX-512 VNNI, or the build fails, ``unavailable()`` says
why and the kernels are not candidates. The ops' schemas and shapes are registered here with
``torch.library`` (the CPU kernels when the extension loads), so graphs, Inductor and
``torch.export`` carry them as any ATen op.

Reference: ``reference(x, dequantized_weight, bias, kernel)``, the product of the dequantized
weight with the activations quantized per block as the kernel quantizes them, in fp32: the
kernels equal it up to the order of fp32 sums.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from autoopt.cost_model.cache import default_cache_dir

from . import weight_only

log = logging.getLogger(__name__)

BLOCK = 32  # input features per activation scale (Q8_0's)
_PANEL = 16  # output rows per panel: one vpdpbusd's int32 lanes
_SOURCES = [Path(__file__).with_name(name)
            for name in ("block_gemm.cpp", "decode_attention.cpp")]
# OpenMP: ATen's parallel_for is inline OpenMP in an extension, and without the flag it ran
# every panel on one thread (2 threads: 6.1 ms for a decode step's int4 linears, as at 1).
_FLAGS = ["-O3", "-fopenmp"]


@dataclass(frozen=True)
class BlockInt8Weight:
    """An ``(out, in)`` int8 weight (``weight_only.quantize_int8``'s codes and scales) in
    panels: ``panels`` uint8 ``(out / 16, in * 16)``, the codes plus 128; ``scales`` bf16 per
    padded output row."""

    panels: torch.Tensor
    scales: torch.Tensor
    out: int

    def tensors(self) -> dict[str, Any]:
        return {"panels": self.panels, "scales": self.scales}

    def call(self, held: dict[str, Any], x: Any, bias: Any) -> tuple[Any, tuple[Any, ...]]:
        """The op and its arguments, the weight's tensors read from ``held`` (the tensors
        themselves, or a graph's nodes for them)."""
        return (torch.ops.autoopt_blocks.int8_linear.default,
                (x, held["panels"], held["scales"], bias, self.out))


@dataclass(frozen=True)
class BlockInt4Weight:
    """An ``(out, in)`` int4 weight (``weight_only``'s codes, scales and zeros, in groups of
    ``group``) in panels: uint8 ``(out / 16, in / group, group * 8 + 64)``, each group's
    nibbles followed by its 16 rows' bf16 scales and zeros."""

    panels: torch.Tensor
    group: int
    out: int

    def tensors(self) -> dict[str, Any]:
        return {"panels": self.panels}  # the scales and zeros are inside

    def call(self, held: dict[str, Any], x: Any, bias: Any) -> tuple[Any, tuple[Any, ...]]:
        return (torch.ops.autoopt_blocks.int4_linear.default,
                (x, held["panels"], self.group, bias, self.out))


@dataclass(frozen=True)
class Fp16PanelWeight:
    """An ``(out, in)`` weight in fp16 (where every magnitude fits), in panels: fp16
    ``(out / 16, in * 16)``, each input feature's 16 rows side by side. For ``precision="bf16"``
    where the CPU has no fast bf16 GEMM (``precision_int8.FP16_WEIGHT``): fp32 activations."""

    panels: torch.Tensor
    out: int

    def tensors(self) -> dict[str, Any]:
        return {"panels": self.panels}

    def call(self, held: dict[str, Any], x: Any, bias: Any) -> tuple[Any, tuple[Any, ...]]:
        return torch.ops.autoopt_blocks.fp16_linear.default, (x, held["panels"], bias, self.out)


BlockWeight = BlockInt8Weight | BlockInt4Weight | Fp16PanelWeight


def fits(weight: torch.Tensor, group: int = BLOCK) -> bool:
    """Whether the kernels take this ``(out, in)`` weight: an input width in whole blocks
    (and int4 groups)."""
    return weight.dim() == 2 and weight.shape[1] % BLOCK == 0 and weight.shape[1] % group == 0


def widths_needed(group: int = BLOCK) -> str:
    return f"an input width that is a multiple of {max(group, BLOCK)}"


def pack_int8(weight: torch.Tensor) -> BlockInt8Weight:
    q8 = weight_only.quantize_int8(weight)
    out, width = q8.q.shape
    padded = -(-out // _PANEL) * _PANEL
    codes = torch.zeros(padded, width, dtype=torch.int16)
    codes[:out] = q8.q.to(torch.int16)
    # panel, chunk of 4 features, row, feature: one vpdpbusd operand per (panel, chunk)
    panels = (codes + 128).to(torch.uint8).reshape(padded // _PANEL, _PANEL, width // 4, 4)
    panels = panels.permute(0, 2, 1, 3).reshape(padded // _PANEL, -1).contiguous()
    scales = torch.zeros(padded, dtype=torch.bfloat16)
    scales[:out] = q8.scales
    return BlockInt8Weight(panels, scales, out)


def pack_int4(weight: torch.Tensor, group: int = weight_only.DEFAULT_GROUP) -> BlockInt4Weight:
    if not fits(weight, group):
        raise ValueError(f"int4_blocks needs {widths_needed(group)}; got a weight of "
                         f"{tuple(weight.shape)}")
    codes, scale_zeros = weight_only._int4_codes(weight, group)  # (out, in), (g, out, 2)
    out, width = codes.shape
    padded, groups = -(-out // _PANEL) * _PANEL, width // group
    full = torch.full((padded, width), 8, dtype=torch.int32)  # padding rows: scale 0, zero 0
    full[:out] = codes
    # panel, group, pair of 4-feature chunks, row, feature, low/high nibble
    full = full.reshape(padded // _PANEL, _PANEL, groups, group // 8, 2, 4)
    full = full.permute(0, 2, 3, 1, 5, 4)
    nibbles = (full[..., 0] | (full[..., 1] << 4)).to(torch.uint8)
    nibbles = nibbles.reshape(padded // _PANEL, groups, group * 8)
    sz = torch.zeros(groups, padded, 2, dtype=torch.bfloat16)
    sz[:, :out] = scale_zeros
    sz = sz.reshape(groups, padded // _PANEL, _PANEL, 2).permute(1, 0, 3, 2).contiguous()
    sz = sz.view(torch.uint8).reshape(padded // _PANEL, groups, 4 * _PANEL)
    return BlockInt4Weight(torch.cat([nibbles, sz], -1).contiguous(), group, out)


def pack_fp16(weight: torch.Tensor) -> Fp16PanelWeight:
    out, width = weight.shape
    padded = -(-out // _PANEL) * _PANEL
    rows = torch.zeros(padded, width, dtype=torch.float16)
    rows[:out] = weight.detach()
    panels = rows.reshape(padded // _PANEL, _PANEL, width).transpose(1, 2)
    return Fp16PanelWeight(panels.reshape(padded // _PANEL, -1).contiguous(), out)


def fits_fp16(weight: torch.Tensor) -> bool:
    """An input width the fp16 kernel takes (whole steps of 4 features)."""
    return weight.dim() == 2 and weight.shape[1] % 4 == 0


def pack(kernel: str, weight: torch.Tensor, group: int = weight_only.DEFAULT_GROUP,
         ) -> BlockWeight:
    """``weight`` packed for ``kernel`` (``int8_blocks``, ``int4_blocks``, ``fp16_panels``)."""
    if kernel == "int4_blocks":
        return pack_int4(weight, group)
    return pack_int8(weight) if kernel == "int8_blocks" else pack_fp16(weight)


def dequantized(weight: torch.Tensor, kernel: str, group: int = weight_only.DEFAULT_GROUP,
                ) -> torch.Tensor:
    """The fp32 ``(out, in)`` weight ``kernel`` (``int8_blocks``, ``int4_blocks``,
    ``fp16_panels``) computes with."""
    if kernel == "fp16_panels":
        return weight.detach().half().float()
    if kernel == "int8_blocks":
        return weight_only.dequantize_int8(weight_only.quantize_int8(weight))
    return weight_only.dequantize_int4(weight, group)


def quantized_activations(x: torch.Tensor) -> torch.Tensor:
    """``x`` (fp32, last dimension in whole blocks) as the kernels see it: each block of 32
    rounded to 255 steps of its largest magnitude over 127, back in fp32."""
    blocks = x.float().reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
    largest = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.where(largest > 0, 127.0 / largest, torch.zeros_like(largest))
    codes = torch.round(blocks * inverse).clamp(-127, 127)
    return (codes * (largest / 127.0)).reshape(x.shape)


def reference(x: torch.Tensor, dequantized_weight: torch.Tensor, bias: torch.Tensor | None,
              kernel: str = "int8_blocks") -> torch.Tensor:
    """What ``kernel`` computes, in fp32 from the dequantized weight (see the module's doc):
    the int8 and int4 kernels on the activations rounded per block, the fp16 one on them as
    they are."""
    x = x.float() if kernel == "fp16_panels" else quantized_activations(x)
    y = x @ dequantized_weight.t()
    return y if bias is None else y + bias


def tensors(weight: BlockWeight) -> dict[str, torch.Tensor]:
    """The tensors a graph holds for ``weight``, by a suffix for their attribute names."""
    return weight.tensors()


def linear(x: torch.Tensor, weight: BlockWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """The quantized linear, run eagerly (through the registered op, as a graph runs it)."""
    why = unavailable()
    if why is not None:
        raise RuntimeError(f"autoopt's block kernels need {why}")
    op, args = weight.call(weight.tensors(), x, bias)
    return op(*args)


def emit(gm: torch.fx.GraphModule, node: torch.fx.Node, x: torch.fx.Node, weight: BlockWeight,
         attrs: dict[str, torch.fx.Node], bias: torch.fx.Node | None) -> torch.fx.Node:
    """The op's node before ``node`` (whose input is ``x``), reading the weight's tensors from
    the ``get_attr`` nodes ``attrs`` (``tensors(weight)``'s keys)."""
    new = gm.graph.call_function(*weight.call(attrs, x, bias))
    new.meta["val"] = node.meta.get("val")
    return new


# --- the library -----------------------------------------------------------------------------

@functools.cache
def unavailable() -> str | None:
    """Why the kernels cannot run here (what they need), or None where they can; builds the
    extension on the first call in a machine's life (~20 s, then loaded from the cache)."""
    why = _loaded()
    if why is not None:
        log.info("block kernels: not candidates here: they need %s", why)
    return why


def _loaded() -> str | None:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"an x86-64 CPU with AVX-512 VNNI (this is {platform.machine()})"
    if os.name != "posix":
        return "a POSIX system's C++ compiler"
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        return "a C++ compiler (c++ or g++ on PATH) to build them"
    if not (torch.cpu._is_avx512_supported() and torch.cpu._is_vnni_supported()):
        return "a CPU with AVX-512 VNNI (this one has none)"
    quiet = logging.getLogger("torch.utils.cpp_extension")  # its import warns of CUDA_HOME
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        from torch.utils import cpp_extension
    finally:
        quiet.setLevel(level)
    if not cpp_extension.is_ninja_available():
        return "ninja to build them (pip install ninja)"
    source = b"".join(path.read_bytes() for path in _SOURCES)
    key = hashlib.sha256(source + repr((torch.__version__, _FLAGS)).encode()).hexdigest()[:12]
    folder = default_cache_dir() / "kernels" / key
    folder.mkdir(parents=True, exist_ok=True)
    # The line optimize's progress shows while it builds (the first time: ~20 s).
    log.info("block kernels: compiling autoopt's own kernels (int8, int4, fp16, fp32, decode "
             "attention; once on this machine)")
    try:
        cpp_extension.load(f"autoopt_block_gemm_{key}", [str(path) for path in _SOURCES],
                           extra_cflags=_FLAGS,
                           extra_ldflags=["-fopenmp"], build_directory=str(folder),
                           is_python_module=False, verbose=False)
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        text = " ".join(str(exc).split())
        return f"their C++ source to build ({text[:300]})"
    return None if torch.ops.autoopt_blocks.supported() else "a CPU with AVX-512 VNNI"


# The schemas (the CPU kernels are block_gemm.cpp's, registered when it loads) and the shapes
# they return, for graphs, Inductor and export.
_LIB = torch.library.Library("autoopt_blocks", "FRAGMENT")
_LIB.define("int8_linear(Tensor x, Tensor panels, Tensor scales, Tensor? bias, int out) "
            "-> Tensor")
_LIB.define("int4_linear(Tensor x, Tensor panels, int group, Tensor? bias, int out) -> Tensor")
_LIB.define("fp16_linear(Tensor x, Tensor panels, Tensor? bias, int out) -> Tensor")
_LIB.define("fp32_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
_LIB.define("fp32_stream_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
_LIB.define("bf16_stream_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
# decode_attention.cpp: a few queries over a KV cache (see ``autoopt.passes.attention_window``)
_LIB.define("decode_attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale) -> Tensor")


@torch.library.register_fake("autoopt_blocks::int8_linear")
def _int8_fake(x: torch.Tensor, panels: torch.Tensor, scales: torch.Tensor,
               bias: torch.Tensor | None, out: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out))


@torch.library.register_fake("autoopt_blocks::int4_linear")
def _int4_fake(x: torch.Tensor, panels: torch.Tensor, group: int,
               bias: torch.Tensor | None, out: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out))


@torch.library.register_fake("autoopt_blocks::fp16_linear")
def _fp16_fake(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None,
               out: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out))


@torch.library.register_fake("autoopt_blocks::fp32_linear")
@torch.library.register_fake("autoopt_blocks::fp32_stream_linear")
@torch.library.register_fake("autoopt_blocks::bf16_stream_linear")
def _fp32_fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.register_fake("autoopt_blocks::decode_attention")
def _attention_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                    scale: float) -> torch.Tensor:
    return q.new_empty((*q.shape[:-1], v.shape[-1]))
