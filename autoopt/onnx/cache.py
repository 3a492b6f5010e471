"""ONNX graphs kept on disk without their weights, so that the next ``optimize`` of the same
model opens ONNX Runtime without exporting again (an export is 2-10 s; opening a session from
the cached graph, a tenth of a second).

An entry is the exported file with every weight initializer emptied (marked as external data
with no file behind it) and, for each of those initializers, the parameter, buffer or constant
of the graph module it is: the tensor of that name, or a 2-D tensor transposed (a linear's
weight as a MatMul operand), checked bitwise equal to what the exporter wrote.
A later lowering of the same graph (the same code, tensors' names, shapes and dtypes, inputs,
library versions: ``key``) writes the graph module's current tensors into a weights file
beside the cached graph, one at a time, and ONNX Runtime opens that (``materialize``): the
weights are always this run's, never the cached run's, and the session maps the file rather
than holding a copy of it. Not cached: a graph where the exporter computed a weight of its
own (a floating initializer that is none of the module's tensors, as when it folds an
embedding lookup of a constant index, or one named after a tensor that holds other values, as
when it folds a BatchNorm into a convolution), a graph that reads a weight the file holds no
initializer for (the exporter specialized on its values), devices other than the CPU. The one
such weight allowed is one of zeros, which the exporter drops (a freshly initialized
BatchNorm's folded bias): the key says which weights are zeros, so that graph serves only
weights that are zeros there too. The session is verified against eager like any lowering,
cached or not.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import logging
import math
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.fx import GraphModule
from torch.utils import _pytree as pytree

from autoopt.cost_model import default_cache_dir

log = logging.getLogger(__name__)

_FORMAT = 4  # 3: the key says which weights are zeros; 4: fully masked attention rows are zeros
_ALIGN = 1 << 16  # where each weight starts in a written file (ORT maps each from there)
_BLOCK = 1 << 24  # bytes of a written weight read back at a time
# Dtypes whose tensors ONNX Runtime can take from numpy views of the module's memory.
_NUMPY_DTYPES = (torch.float32, torch.float64, torch.float16, torch.int64, torch.int32,
                 torch.int16, torch.int8, torch.uint8, torch.bool)


def folder() -> Path:
    """Where entries live: ``onnx/`` beside the cost model's measurements."""
    return default_cache_dir() / "onnx"


def key(gm: GraphModule, args: tuple[Any, ...], kwargs: dict[str, Any],
        input_names: list[str], output_names: list[str], device: torch.device,
        dynamic: Any = None) -> str:
    """What an exported graph depends on, besides the weights' values: the graph's code, its
    tensors' names, shapes and dtypes, the inputs' (non-tensor inputs by value), which input
    sizes are left symbolic (``dynamic``, as export's ``dynamic_shapes``), the names given to
    inputs and outputs, the device, and the exporter's and ONNX Runtime's versions; integer
    and boolean tensors (index buffers) by value."""
    digest = hashlib.sha256()
    digest.update(f"{_FORMAT}|{gm.code}|{input_names}|{output_names}|{device.type}|"
                  f"{dynamic!r}".encode())
    for name, t in sorted(tensors_of(gm).items()):
        # Which weights are all zeros: the exporter drops those (a freshly initialized
        # BatchNorm's folded bias), so the graph depends on it (see ``store``).
        zero = "=0" if _all_zero(t) else ""
        digest.update(f"{name}:{tuple(t.shape)}:{t.dtype}{zero};".encode())
        if not t.is_floating_point() and t.device.type != "meta":
            # Integer and boolean tensors by value: the exporter writes an index buffer into
            # constants of its own (a permutation became GatherND's indices), so another
            # model's indices served this one (3.07 off).
            digest.update(t.detach().cpu().contiguous().numpy().tobytes())
    for name, t in sorted(_folded_from(gm).items()):
        # Weights the graph computes with before any input (``w.pow(2).sum()``): the exporter
        # folds such a computation into a constant of its own, which ``store`` cannot tell
        # from a literal of the code when it is a number, so the entry holds for these
        # values only (another model of the class was served this one's: 0.29 off).
        digest.update(f"{name}=".encode())
        digest.update(memoryview(t.detach().cpu().contiguous().reshape(-1)
                                 .view(torch.uint8).numpy()))
    for leaf in pytree.tree_leaves((args, kwargs)):
        digest.update((f"{tuple(leaf.shape)}:{leaf.dtype};" if isinstance(leaf, torch.Tensor)
                       else f"{type(leaf).__name__}={leaf!r};").encode())
    digest.update(_versions().encode())
    return digest.hexdigest()[:40]


def _folded_from(gm: GraphModule) -> dict[str, torch.Tensor]:
    """The tensors of ``gm`` that an op reads with nothing but tensors of ``gm`` (no input),
    by name: what the exporter may fold into constants computed from their values. Where the
    pass pipeline ran, ``constant_fold`` left none but views (a weight's transpose, which
    ``store`` recognizes), so this is empty and costs nothing."""
    tensors = tensors_of(gm)
    constant: set[torch.fx.Node] = set()
    found: dict[str, torch.Tensor] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            constant.add(node)
        elif node.op == "call_function" and all(
                n in constant for n in node.all_input_nodes) and node.all_input_nodes:
            constant.add(node)
            if _is_view(node):
                continue
            stack = list(node.all_input_nodes)
            while stack:
                source = stack.pop()
                if source.op == "get_attr" and str(source.target) in tensors:
                    found[str(source.target)] = tensors[str(source.target)]
                else:
                    stack.extend(source.all_input_nodes)
    return {name: t for name, t in found.items() if t.device.type != "meta"}


def _is_view(node: torch.fx.Node) -> bool:
    """An op whose result is its input's values rearranged: the exporter writes the weight
    itself (or its transpose, which ``store`` recognizes), never a number from it."""
    target = getattr(node.target, "overloadpacket", node.target)
    return getattr(target, "__name__", "") in _VIEWS


_VIEWS = frozenset({"t", "transpose", "permute", "view", "reshape", "_unsafe_view", "expand",
                    "unsqueeze", "squeeze", "contiguous", "clone", "detach", "alias",
                    "numpy_T", "flatten", "to", "_to_copy"})


def tensors_of(gm: GraphModule) -> dict[str, torch.Tensor]:
    """The graph module's parameters, buffers and tensor constants, by the name the exporter
    gives their initializers."""
    found = dict(gm.state_dict(keep_vars=True))
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.target not in found:
            value: Any = gm
            for part in str(node.target).split("."):
                value = getattr(value, part, None)
            if isinstance(value, torch.Tensor):
                found[str(node.target)] = value
    return found


def materialize(entry: str, gm: GraphModule, path: Path) -> bool:
    """Write the cached graph for ``entry`` to ``path``, its emptied initializers filled from
    ``gm``'s tensors into the file beside it (``path.name + '.data'``), one tensor at a time;
    False where there is no entry or these tensors do not fit it.

    ONNX Runtime maps that file and keeps only its own (prepacked) copies: no copy of the
    weights stays in this process for the session, as after a fresh export."""
    import onnx

    base = folder() / entry
    if not base.with_suffix(".json").exists():
        return False  # no entry: the usual case, an export
    try:
        emptied = json.loads(base.with_suffix(".json").read_text())["initializers"]
        proto = onnx.ModelProto.FromString(base.with_suffix(".onnx").read_bytes())
        tensors = tensors_of(gm)
        given = {}
        for name, of in emptied.items():
            t = tensors.get(of["of"])
            if (t is None or list(t.shape) != of["shape"] or str(t.dtype) != of["dtype"]
                    or t.dtype not in _NUMPY_DTYPES):
                return False
            given[name] = t.t() if of["transpose"] else t
        data = path.with_name(f"{path.name}.data")
        offset = 0
        with open(data, "wb") as out:
            for init in proto.graph.initializer:
                t = given.pop(init.name, None)
                if t is None:
                    continue
                offset = -(-offset // _ALIGN) * _ALIGN  # ORT maps each tensor from here
                out.seek(offset)
                value = t.detach().cpu().contiguous()  # a transposed weight: one at a time
                out.write(memoryview(value.numpy()).cast("B"))
                size = value.numel() * value.element_size()
                _point(init, data.name, offset, size)
                offset += size
        if given:
            return False
        path.write_bytes(proto.SerializeToString())
    except Exception as exc:  # noqa: BLE001 - an entry that cannot be read is a miss
        log.info("the ONNX cache entry %s is not usable (%s)", entry, exc)
        return False
    return True


def store(entry: str, path: Path, gm: GraphModule) -> str:
    """Keep the file at ``path`` as ``entry``, its weights emptied; return why not, or ''.

    Each initializer the exporter wrote beside the graph is read back and compared with the
    module's tensor a few MiB at a time: the written weights are never in memory whole."""
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    proto = onnx.load(str(path), load_external_data=False)
    tensors = {n: t for n, t in tensors_of(gm).items() if t.dtype in _NUMPY_DTYPES}
    small_weights = any(t.is_floating_point() and t.numel() <= 1 for t in tensors.values())
    # A linear's weight is often written transposed (a MatMul's right operand): found by
    # its first row, then compared whole.
    transposed = {(tuple(t.shape[::-1]), _head(t.detach().cpu()[:, 0])): n
                  for n, t in tensors.items() if t.dim() == 2 and t.is_floating_point()}
    emptied: dict[str, dict[str, Any]] = {}
    for init in proto.graph.initializer:
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(init.data_type))
        shape = tuple(init.dims)
        if init.data_location == onnx.TensorProto.EXTERNAL:
            blocks = functools.partial(_blocks, path.parent, init, dtype, shape)
        else:
            blocks = functools.partial(iter, [(0, numpy_helper.to_array(init))])
        t = tensors.get(init.name)
        of, transpose = init.name, False
        if t is None and len(shape) == 2 and math.prod(shape) > 1:
            first = next(blocks())[1][0]
            of = transposed.get((shape, _head(torch.from_numpy(first.copy()))), "")
            t, transpose = tensors.get(of), True
        if t is None:
            # A constant of the exporter's: the graph's code names it (a shape, an axis,
            # a literal), unless it was computed from a weight.
            if np.issubdtype(dtype, np.floating) and (math.prod(shape) > 1 or small_weights):
                return f"the exporter computed initializer {init.name!r} from the weights"
            if init.data_location == onnx.TensorProto.EXTERNAL:
                # Its bytes are in the exporter's weights file, which is not kept (a later
                # weights file of that name holds other tensors there): into the graph.
                values = np.concatenate([part.reshape(-1) for _, part in blocks()])
                init.CopyFrom(numpy_helper.from_array(values.reshape(shape), init.name))
            continue
        held = t.detach().cpu()
        held = held.t() if transpose else held
        if tuple(held.shape) != shape or held.numpy().dtype != dtype or not all(
                np.array_equal((held[start:start + len(part)] if shape else held).numpy(),
                               part) for start, part in blocks()):
            return f"initializer {init.name!r} is not the module's tensor {of!r}"
        emptied[init.name] = {"of": of, "shape": list(t.shape), "dtype": str(t.dtype),
                              "transpose": transpose}
        _point(init, "autoopt-weights-not-stored", 0, held.numel() * dtype.itemsize)
    # A weight the graph reads that no initializer holds: the exporter decided on its values.
    # It drops a bias of zeros from its Conv (a freshly initialized BatchNorm's, folded): the
    # key says which weights are zeros, so that graph serves only weights zero there too;
    # anything else makes the graph one for these values only. (By identity: tied weights
    # are one initializer.)
    held = {id(tensors[of["of"]]) for of in emptied.values()}
    read = {str(n.target) for n in gm.graph.nodes if n.op == "get_attr" and n.users}
    for name in sorted(read):
        t = tensors.get(name)
        if (t is not None and t.is_floating_point() and t.numel() and id(t) not in held
                and not _all_zero(t)):
            return (f"the exported graph holds no initializer for {name!r}: the exporter "
                    f"specialized the graph on its values")
    target = folder()
    target.mkdir(parents=True, exist_ok=True)
    _write(target / f"{entry}.onnx", proto.SerializeToString())
    # The names last: an entry is read only once its list exists.
    _write(target / f"{entry}.json", json.dumps({"format": _FORMAT,
                                                  "initializers": emptied}).encode())
    return ""


def _all_zero(t: torch.Tensor) -> bool:
    return (t.is_floating_point() and t.numel() > 0 and t.device.type != "meta"
            and not bool(t.detach().any()))


def _point(init: Any, location: str, offset: int, length: int) -> None:
    """Make ``init`` read its values from ``location`` at ``offset``, holding none itself."""
    import onnx
    from onnx import external_data_helper

    for field in ("float_data", "int32_data", "int64_data", "double_data", "external_data"):
        init.ClearField(field)
    init.raw_data = b"\0"  # set_external_data asks for raw data, which it then drops
    external_data_helper.set_external_data(init, location=location, offset=offset,
                                           length=length)
    init.ClearField("raw_data")
    init.data_location = onnx.TensorProto.EXTERNAL


def _blocks(base: Path, init: Any, dtype: Any, shape: tuple[int, ...],
            ) -> Iterator[tuple[int, Any]]:
    """An external initializer's values read back from its file a block of rows at a time,
    each with the index of its first row (a scalar is one block of its own)."""
    import numpy as np

    info = {entry.key: entry.value for entry in init.external_data}
    rows = shape[0] if shape else 1
    row_bytes = dtype.itemsize * math.prod(shape[1:])
    step = max(1, _BLOCK // max(row_bytes, 1))
    with open(base / info["location"], "rb") as data:
        data.seek(int(info.get("offset", 0)))
        for start in range(0, rows, step):
            count = min(step, rows - start)
            block = np.frombuffer(data.read(count * row_bytes), dtype=dtype)
            yield start, block.reshape((count, *shape[1:]) if shape else ())


def _head(row: torch.Tensor) -> bytes:
    return row[:8].contiguous().numpy().tobytes()


def _write(path: Path, data: bytes) -> None:
    """Whole or not at all: another process may read the entry meanwhile."""
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(data)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def _versions() -> str:
    found = []
    for package in ("onnx", "onnxscript", "onnxruntime", "onnxruntime-gpu"):
        try:
            found.append(f"{package}={importlib.metadata.version(package)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    return f"torch={torch.__version__}|{'|'.join(found)}"
