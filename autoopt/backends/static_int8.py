"""Static int8 (``precision="int8", calibration=batches``) on the engines that have it.

Each engine's own post-training quantizer calibrates the graph from before autoopt's
lowerings on the user's batches, and the engine runs what it made; ``choose_backend`` then
verifies each result against eager (the example inputs and fresh random ones, which
calibration never saw) under int8's tolerance and keeps the fastest, as for every precision:

- ``openvino``: NNCF (``nncf.quantize``) on the OpenVINO model read from autoopt's ONNX file:
  FakeQuantize ops that OpenVINO's CPU plugin fuses into its int8 convolutions and matrix
  multiplies (AMX or VNNI where the CPU has them); what stays in floating point runs at
  OpenVINO's default precision, as its own int8 deployments do;
- ``onnxruntime``: ONNX Runtime's static QDQ quantizer (``quantize_static``: uint8
  activations per tensor, int8 weights per channel, as it recommends on x86), whose
  QuantizeLinear/DequantizeLinear pairs its CPU provider fuses into integer kernels.

autoopt writes no quantizer of its own: its part is the choice, the verification, the report
(which ops run in int8, where, the error beside the tolerance, a classifier's top-1
agreement on the batches held out of calibration) and the refusal when no engine's int8
stays within the tolerance, naming the ops that err (``passes/int8_sensitivity``).
"""

from __future__ import annotations

import collections
import contextlib
import importlib.metadata
import logging
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule
from torch.utils import _pytree as pytree

from autoopt.backends.base import Lowering
from autoopt.errors import ConfigError
from autoopt.onnx.signature import flat_tensors, in_forward_order
from autoopt.options.backends import STATIC_INT8
from autoopt.options.calibration import Calibration
from autoopt.passes import int8_sensitivity

log = logging.getLogger(__name__)

# The engines that quantize with calibration, and their quantizer.
QUANTIZERS = {"openvino": "NNCF", "onnxruntime": "ONNX Runtime's QDQ quantizer"}
ENGINES = {name: QUANTIZERS[name] for name in STATIC_INT8}


def declined(name: str) -> str:
    """Why backend ``name`` is not a static int8 candidate."""
    return (f"no calibrated int8 kernels (static int8 runs on "
            f"{' and '.join(f'{e} ({q})' for e, q in ENGINES.items())})")


def nncf_available() -> str:
    try:
        importlib.metadata.version("nncf")
    except importlib.metadata.PackageNotFoundError:
        return "NNCF is not installed (pip install nncf): OpenVINO's int8 needs its quantizer"
    return ""


def feeds(calibration: Calibration, gm: GraphModule, input_names: Sequence[str],
          args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[dict[str, Any]]:
    """The calibration batches the quantizers observe, as numpy arrays by ONNX input name,
    shaped like ``(args, kwargs)`` (the graph's own inputs)."""
    out = []
    for a, k in calibration.like(args, kwargs).fit:
        tensors = flat_tensors(a, in_forward_order(gm.forward, k), input_names)
        out.append({name: t.detach().cpu().contiguous().numpy() for name, t in tensors.items()})
    return out


def is_transformer(gm: GraphModule) -> bool:
    """Whether ``gm`` holds attention (a softmax or a fused attention, beside a layer norm):
    NNCF's transformer scheme then keeps the ops int8 errs at most in floating point (a
    random-weight BERT-base erred 10% without it, 2.8% with it)."""
    targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    return any("softmax" in t or "scaled_dot_product_attention" in t for t in targets) \
        and any("layer_norm" in t for t in targets)


def nncf_quantize(model: Any, batches: list[dict[str, Any]], transformer: bool,
                  excluded: Sequence[str] = ()) -> Any:
    """``model`` (an OpenVINO model) quantized by NNCF on ``batches``, every batch used, but
    for the ops named ``excluded`` (ONNX node names, which OpenVINO keeps)."""
    import nncf

    names = {name for port in model.inputs for name in port.get_names()}
    data = [{k: v for k, v in batch.items() if k in names} for batch in batches]
    options: dict[str, Any] = {"subset_size": len(data)}  # NNCF counts the dataset's items
    if transformer:
        options["model_type"] = nncf.ModelType.TRANSFORMER
    if excluded:
        options["ignored_scope"] = nncf.IgnoredScope(names=list(excluded), validate=False)
    return nncf.quantize(model, nncf.Dataset(data), **options)


def ort_quantize(path: Path, batches: list[dict[str, Any]], folder: Path,
                 excluded: Sequence[str] = ()) -> Path:
    """The ONNX file at ``path`` quantized (QDQ) by ONNX Runtime on ``batches``, written
    in ``folder``, but for the nodes named ``excluded``."""
    import onnx
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        QuantType,
        quantize_static,
    )

    names = {i.name for i in onnx.load(str(path), load_external_data=False).graph.input}

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self._batches = iter([{k: v for k, v in b.items() if k in names} for b in batches])

        def get_next(self) -> dict[str, Any] | None:
            return next(self._batches, None)

    out = folder / "int8.onnx"
    # Its advice to pre-process (shape inference, fusions) goes to the root logger at each
    # call: the session's own optimizations fuse what the advice is about.
    with _quiet_root():
            quantize_static(str(path), str(out), Reader(), quant_format=QuantFormat.QDQ,
                        per_channel=True, activation_type=QuantType.QUInt8,
                        weight_type=QuantType.QInt8, use_external_data_format=True,
                        nodes_to_exclude=list(excluded), op_types_to_quantize=list(HEAVY))
    return out


@contextlib.contextmanager
def _quiet_root() -> Iterator[None]:
    root = logging.getLogger()
    level = root.level
    root.setLevel(max(level, logging.ERROR))
    try:
        yield
    finally:
        root.setLevel(level)


# What ONNX Runtime quantizes: the compute-heavy ops. By default it quantizes more (Gather:
# an embedding table in int8 per tensor erred 2% at every position of a BERT), for little
# time saved.
HEAVY = ("Conv", "ConvTranspose", "MatMul", "Gemm")


def int8_folder() -> tempfile.TemporaryDirectory[str]:
    return tempfile.TemporaryDirectory(prefix="autoopt-int8-", ignore_cleanup_errors=True)


def openvino_ops(compiled: Any) -> dict[str, int]:
    """The ops OpenVINO's CPU plugin runs in int8, by layer type, counted from its runtime
    model (what it executes, after fusing the FakeQuantize ops into its kernels)."""
    counts: collections.Counter[str] = collections.Counter()
    for op in compiled.get_runtime_model().get_ordered_ops():
        info = op.get_rt_info()
        try:
            precision = str(info["runtimePrecision"].astype(str)).lower()
            kind = str(info["layerType"].astype(str))
        except Exception:  # noqa: BLE001 - a runtime model without the plugin's annotations
            continue
        if precision in ("u8", "i8") and kind in _OPENVINO_HEAVY:
            counts[kind] += 1
    return dict(counts)


_OPENVINO_HEAVY = {"Convolution", "GroupConvolution", "FullyConnected", "MatMul",
                   "Deconvolution", "ScaledDotProductAttention"}


def onnx_ops(path: Path) -> dict[str, int]:
    """The ops of a QDQ file that read dequantized int8 values (which ONNX Runtime runs as
    integer kernels), by op type."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    dequantized = {o for n in model.graph.node if n.op_type == "DequantizeLinear"
                   for o in n.output}
    counts: collections.Counter[str] = collections.Counter(
        n.op_type for n in model.graph.node
        if n.op_type in HEAVY and n.input and n.input[0] in dequantized)
    return dict(counts)


class Summary:
    """What the report says of a static int8 candidate: its quantizer, the ops it runs in
    int8, and (set by verification) the error beside the tolerance."""

    def __init__(self, engine: str, ops: dict[str, int], kept: Sequence[str] = ()) -> None:
        self.engine, self.ops, self.kept = engine, ops, list(kept)
        self.error: float | None = None
        self.agreement = ""

    def describe(self, tolerance: float | None) -> str:
        ops = ", ".join(f"{n} {k}" for k, n in sorted(self.ops.items())) or "no op"
        text = f"static int8 by {ENGINES[self.engine]}: {ops} in int8"
        if self.kept:
            names = ", ".join(self.kept[:6]) + (", ..." if len(self.kept) > 6 else "")
            text += (f"; {len(self.kept)} op(s) int8 errs at most kept in floating point "
                     f"({names})")
        if self.error is not None and tolerance is not None:
            text += (f"; error {self.error:.3g} (tolerance {tolerance:g}) on inputs "
                     f"calibration never saw")
        return text + (f"; {self.agreement}" if self.agreement else "")


def unseen(run: Any, module: nn.Module, batches: list[tuple[tuple[Any, ...], dict[str, Any]]],
           ) -> tuple[float, str]:
    """``run``'s error against ``module`` on ``batches`` (the largest output difference over
    ``max(1, max|output|)``, verification's measure), and a classifier's top-1 agreement
    (a model whose output is one ``[batch, classes]`` tensor) on all but the first batch
    (the example inputs: the batches held out of calibration), or ''."""
    error, same, total = 0.0, 0, 0
    with torch.no_grad():
        for i, (a, k) in enumerate(batches):
            want, got = module(*a, **k), run(*a, **k)
            for x, y in zip(_floats(want), _floats(got), strict=True):
                if x.numel():
                    error = max(error, float((x - y).abs().max()) / max(1.0, float(
                        x.abs().max())))
            if i and isinstance(want, torch.Tensor) and want.dim() == 2 and want.shape[1] > 1:
                same += int((want.argmax(1) == got.argmax(1)).sum())
                total += want.shape[0]
    agreed = (f"top-1 agreement with fp32 {same}/{total} ({100 * same / total:.1f}%) on the "
              f"{len(batches) - 1} batch(es) held out of calibration") if total else ""
    return error, agreed


def _floats(value: Any) -> list[torch.Tensor]:
    return [x.detach().float() for x in pytree.tree_leaves(value)
            if isinstance(x, torch.Tensor) and x.is_floating_point()]


def onnx_nodes(path: Path, ops: Sequence[str]) -> list[str]:
    """The names of the ONNX nodes the exporter made of the graph's ops ``ops`` (fx node
    names, which it records on each node) that a quantizer would make int8."""
    import onnx

    wanted = {f"%{name}" for name in ops}
    model = onnx.load(str(path), load_external_data=False)
    return [n.name for n in model.graph.node if n.op_type in HEAVY
            and any(p.key == "pkg.torch.onnx.fx_node" and p.value.split(" ", 1)[0] in wanted
                    for p in n.metadata_props)]


# Shares of the graph's quantized ops, worst first, kept in floating point in turn while an
# engine's int8 errs beyond the tolerance on unseen inputs; and how close to the tolerance
# that error may come (verification's random inputs err a little more than these).
KEEP_SHARES = (0.05, 0.15, 0.35)
MARGIN = 0.8
# What keeping more ops must bring to be worth another build: the error at most this share of
# the last. Where the ops that err most alone, kept, leave the error as it was, int8's error
# is spread over the graph (a random-weight BERT-base: 0.091 with none kept, 0.092-0.098 with
# 1, 3 and 7 of 25), and each further try is another quantize and compile (13-18 s there).
HELPS = 0.9


class Fallback:
    """Keeps the ops int8 errs at most in floating point, as few as bring an engine's error
    within the tolerance: each quantized op's error alone (``passes/int8_sensitivity``),
    measured once per graph, ranks them."""

    def __init__(self, source: GraphModule, module: nn.Module, calibration: Calibration,
                 args: tuple[Any, ...], kwargs: dict[str, Any], tolerance: float,
                 random_inputs: int = 2) -> None:
        self.source, self.module, self.tolerance = source, module, tolerance
        self.args, self.kwargs = args, kwargs
        self.random_inputs = random_inputs
        self.calibration = calibration.like(args, kwargs)
        self._ranked: list[str] | None = None

    def ranked(self) -> list[str]:
        if self._ranked is None:
            ranges = int8_sensitivity.observe(self.source, [_flat(a, k) for a, k in
                                                            self.calibration.fit])
            found = int8_sensitivity.errors(self.source, ranges,
                                            [_flat(a, k) for a, k in self.sets()])
            self._ranked = sorted(found, key=lambda name: -found[name])
            log.info("static int8: ops by their error alone: %s", ", ".join(
                f"{n} {found[n]:.3g}" for n in self._ranked[:8]))
        return self._ranked

    def error(self, run: Any) -> float:
        """``run``'s error on the inputs verification will compare (the example and its
        fresh sets, drawn alike) and on the batches held out of calibration."""
        return unseen(run, self.module, [*self.sets(), *self.calibration.held_out])[0]

    def sets(self) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
        from autoopt.check.inputs import clone_inputs, input_sets

        return [clone_inputs(a, k) for a, k in input_sets(self.args, self.kwargs,
                                                          self.random_inputs)]

    def within(self, attempt: Any) -> Any:
        """``attempt(kept)`` (the engine built with the fx ops ``kept`` in floating point)
        with as few kept as bring its error within the tolerance; else the one that erred
        least, once keeping more stops lowering the error (``HELPS``) or all shares are
        tried (verification then rejects it, with its error in the reason)."""
        run = attempt([])
        error = self.error(run)
        tried: set[int] = set()
        for share in KEEP_SHARES:
            if error <= MARGIN * self.tolerance:
                break
            ranked = self.ranked()
            kept = ranked[:max(1, round(share * len(ranked)))]
            if len(kept) in tried:
                continue
            tried.add(len(kept))
            log.info("static int8: error %.3g beyond %.3g; keeping %d op(s) in floating "
                     "point", error, MARGIN * self.tolerance, len(kept))
            candidate = attempt(kept)
            now = self.error(candidate)
            if now > HELPS * error:
                log.info("static int8: keeping %d op(s) left the error at %.3g (was %.3g): "
                         "int8 errs across the graph; no more ops kept", len(kept), now, error)
                if now < error:
                    run = candidate
                break
            del run
            run, error = candidate, now
        return run


def fallback(graph: Any) -> Fallback:
    """The graph's one ``Fallback``, shared by the engines offered it."""
    found = getattr(graph, "_int8_fallback", None)
    if found is None:
        found = Fallback(graph.source, graph.module, graph.config.calibration, graph.args,
                         graph.kwargs, graph.config.precision_tolerance,
                         graph.config.random_inputs)
        graph._int8_fallback = found
    return found


def lowering(name: str, graph: Any, attempt: Callable[[list[str]], Any],
             memory: int) -> Lowering:
    """Engine ``name``'s static int8 candidate: ``attempt(kept)`` builds it with the fx ops
    ``kept`` in floating point, as few kept as bring it within the tolerance (``Fallback``);
    its report line is its ``Summary``."""
    made: dict[str, Summary] = {}

    def build() -> Any:
        run = fallback(graph).within(attempt)
        made["summary"] = run.int8
        return graph.warm(run)

    return Lowering(name, build, memory=memory,
                    regions=lambda: made["summary"].describe(graph.config.precision_tolerance))


def refusal(source: GraphModule, calibration: Calibration, args: tuple[Any, ...],
            kwargs: dict[str, Any], tolerance: float, reasons: dict[str, str]) -> ConfigError:
    """The one-line refusal when no engine's int8 stays within ``tolerance``: each engine's
    reason, and the ops whose int8 errs most (each quantized alone, on the example inputs)."""
    why = "; ".join(f"{name}: {reason}" for name, reason in reasons.items())
    try:
        flat = _flat(args, kwargs)
        ranges = int8_sensitivity.observe(source, [_flat(a, k) for a, k in
                                                   calibration.like(args, kwargs).fit])
        found = int8_sensitivity.errors(source, ranges, [flat])
        ops = ", ".join(f"{name} ({error:.3g} alone)"
                        for name, error in int8_sensitivity.blamed(found, tolerance))
    except Exception as exc:  # noqa: BLE001 - the refusal stands without the ops named
        log.info("static int8: the ops could not be measured one at a time: %s", exc)
        ops = ""
    named = f" The ops int8 errs at most: {ops}." if ops else ""
    return ConfigError(f"precision='int8' with calibration= refused: no engine's int8 stays "
                       f"within the tolerance {tolerance:g} ({why}).{named} Pass a larger "
                       f"tolerance=, or precision='bf16'.")


def _flat(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    return pytree.tree_leaves((tuple(args), dict(kwargs)))
