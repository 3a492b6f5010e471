"""``autoopt.optimize``: capture, optimize, verify; and the module it returns."""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule
from torch.utils import _pytree as pytree

from . import capture as capture_lib
from . import cuda_graphs
from . import memory as memory_lib
from . import precision as precision_lib
from .backend import autoopt_backend
from .config import OptimizeConfig
from .cost_model import CostModel
from .errors import ConfigError, DeviceError, InputError, ModelError
from .guards import InputSignature, current_modes, needs_gradients, signature_of
from .passes import PassContext
from .pipeline import run_pipeline
from .report import CaptureRecord, Report
from .state import has_hooks, preserved, python_state, uses_custom_autograd
from .verify import VerifyResult, _leaves, check_all, clone_inputs, gradients, input_sets
from .watch import ModuleWatch

log = logging.getLogger(__name__)


def optimize(model: nn.Module, example_inputs: Any = (), example_kwargs: Mapping[str, Any] | None
             = None, *, device: str | torch.device | None = None,
             config: OptimizeConfig | Mapping[str, Any] | None = None, dynamic: bool = False,
             dynamic_shapes: Any = None, training: bool | None = None,
             **options: Any) -> OptimizedModule:
    """Return a module that computes what ``model`` computes, faster, checked against eager.

    ``model`` itself is never modified: autoopt works on a private copy.

    Args:
        model: the module to optimize.
        example_inputs: positional inputs, as a tuple (a single tensor is accepted).
        example_kwargs: keyword inputs.
        device: where the optimized module runs; default: where the model's parameters are.
        config: an ``OptimizeConfig`` or a dict of its fields.
        dynamic: let every dimension vary where the model allows (batch, sequence length).
        dynamic_shapes: ``torch.export``-style per-input dynamic dimensions; wins over dynamic.
        training: whether the example call is a training step (default: ``model.training``).
            An inference call is captured under ``torch.no_grad()``, where passes may fold
            parameters into constants; a later call with gradients enabled is captured anew,
            with every parameter's gradient kept.
        **options: ``OptimizeConfig`` fields, e.g. ``verify=False``, ``disable=["dead_code"]``.
            With ``devices=[...]`` (and ``microbatches=``) the result is instead an
            ``autoopt.pipelining.Pipeline``: one stage per device, run over microbatches.

    Example:
        >>> fast = autoopt.optimize(torchvision.models.resnet18().eval(), (x,))
        >>> print(fast.report)
    """
    cfg = OptimizeConfig.build(config, options)
    model = _unwrap(model)
    args, kwargs = check_inputs(example_inputs, example_kwargs)
    target = _resolve_device(model, device)
    training = model.training if training is None else training
    # An inference module reads your weights where they are (no second copy in memory) until
    # something would write them: it takes its own copy then (OptimizedModule._unshare).
    share = not training and cfg.devices is None and (target is None
                                                      or target == _model_device(model))
    try:
        private = _private_copy(model, share_weights=share)
    except Exception as exc:
        raise ModelError(f"autoopt needs a private copy of the model (it never modifies yours), "
                         f"but copy.deepcopy failed: {type(exc).__name__}: {exc}. Make the "
                         f"module deep-copyable (no open files, locks or generators as "
                         f"attributes).") from exc
    if target is not None:
        private.to(target)
        args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.to(target), (args, kwargs))
    _check_devices_and_dtypes(private, args, kwargs)
    # precision=: reject what cannot work on this device; skip casts that would be slower.
    cfg, precision_notes = precision_lib.check_target(cfg, _model_device(private), training)
    optimized = OptimizedModule(private, cfg, dynamic=dynamic, dynamic_shapes=dynamic_shapes,
                                shares_weights=share)
    optimized.report.warnings.extend(precision_notes)
    if cfg.memory_budget is not None and not training:
        raise ConfigError("memory_budget limits the activations saved for a training step; "
                          "pass training=True (or a model in train mode), or drop "
                          "memory_budget for inference.")
    if cfg.devices is not None:  # a pipeline of one stage per device (autoopt.pipelining)
        from .pipelining import pipeline_module

        return pipeline_module(optimized, args, kwargs, training)  # type: ignore[return-value]
    with torch.no_grad() if not training else contextlib.nullcontext():
        optimized.specialize(args, kwargs)
    optimized.report.warnings.extend(precision_lib.notes_after(cfg, optimized.report))
    if cfg.report is not None:  # report=: diagnose and time both modules, write the HTML
        from .html_report import collect, write_report

        write_report(cfg.report, collect(model, args, kwargs, optimized=optimized,
                                         training=training))
    return optimized


@dataclass
class _Specialization:
    """A compiled form of the model and the inputs it may be called with (None: any)."""

    signature: InputSignature | None
    method: str
    run: Callable[..., Any]
    graph: GraphModule | None = None  # the optimized whole graph ``run`` executes, if one
    # For an inference capture, the weights' stamp (``ModuleWatch.stamp``) its constants
    # were computed at: folded BatchNorms, merged and packed weights are copies, so the graph
    # is stale once a parameter or buffer is written. None: reads them live.
    stamp: int | None = None
    # Whether running it writes the module's buffers (train mode: BatchNorm statistics); its
    # own writes keep it current.
    writes_buffers: bool = False


@dataclass(frozen=True)
class Specialization:
    """A read-only record of one compiled form of the model (``OptimizedModule.
    specializations``).

    Args:
        signature: the inputs and modes it serves; None: any call (Dynamo guards its own,
            or the model runs eagerly).
        method: how it was captured: ``export``, ``symbolic_trace``, ``dynamo`` or ``eager``.
        graph: the optimized whole graph that runs (a ``symbolic_trace`` graph takes every
            forward argument positionally); None for Dynamo and eager.
        backend: what executes it: ``aten`` (the graph's own kernels, lowered ones
            included), ``cuda_graph`` (replayed as one CUDA graph), ``dynamo`` or ``eager``.
    """

    signature: InputSignature | None
    method: str
    graph: GraphModule | None
    backend: str


class OptimizedModule(nn.Module):
    """The module ``optimize`` returns.

    Calls are routed to the graph captured for the call's input signature; a new signature is
    captured, optimized and verified on first use (up to ``max_specializations``, then it
    runs eagerly). ``report`` says what was done. ``module`` is autoopt's private copy of the
    original model (parameters live there and are shared with the graphs).

    Public surface for tools built on it: ``config``, ``is_dynamic``, ``specializations``,
    ``graph_for(args, kwargs)`` and ``specialize(args, kwargs)``.
    """

    def __init__(self, module: nn.Module, config: OptimizeConfig, *, dynamic: bool = False,
                 dynamic_shapes: Any = None, shares_weights: bool = False) -> None:
        super().__init__()
        self.module = module
        # Whether ``module``'s parameters and buffers are views of the user's tensors.
        self._shares_weights = shares_weights
        self.report = Report()
        self._config = config
        self._dynamic = dynamic
        self._dynamic_shapes = dynamic_shapes
        self._specializations: list[_Specialization] = []
        self._submodules = list(module.modules())  # for the train/eval flags checked per call
        self._parameters_list = list(module.parameters())  # for requires_grad, checked too
        # Measures nothing until a pass asks; measurements persist in the on-disk cache.
        self.cost_model = CostModel(_model_device(module) or "cpu")
        # What the graphs assume of the module beyond its inputs: which tensors, their
        # values, the Python attributes traced into them.
        self._watch = ModuleWatch(module)
        # Captures (and the bookkeeping of the graph list) one thread at a time; replaying a
        # graph that exists takes no lock.
        self._lock = threading.RLock()
        # load_state_dict(assign=True) replaces the tensors themselves, which no stamp sees;
        # and a load must not write into the user's tensors.
        module.register_load_state_dict_pre_hook(self._before_load)
        module.register_load_state_dict_post_hook(self._weights_loaded)

    # --- public surface ----------------------------------------------------------------------

    @property
    def config(self) -> OptimizeConfig:
        """The options it was optimized with."""
        return self._config

    @property
    def is_dynamic(self) -> bool:
        """Whether graphs keep some dimensions symbolic (``dynamic=True`` or
        ``dynamic_shapes=``)."""
        return bool(self._dynamic) or self._dynamic_shapes is not None

    @property
    def specializations(self) -> tuple[Specialization, ...]:
        """What has been compiled so far, one record per input signature."""
        return tuple(Specialization(s.signature, s.method, s.graph, _backend(s))
                     for s in self._specializations)

    def graph_for(self, args: Any = (), kwargs: Mapping[str, Any] | None = None,
                  ) -> GraphModule | None:
        """The optimized whole graph a call with these inputs runs, in the current grad mode
        (captured now if no graph serves them yet); None where the model runs through Dynamo
        or eagerly."""
        args = (args,) if isinstance(args, torch.Tensor) else tuple(args)
        kwargs = dict(kwargs or {})
        spec = self._find(args, kwargs) or self.specialize(args, kwargs)
        return spec.graph

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        specs = self._specializations
        if specs and any(s.signature is not None for s in specs):
            if self._watch.replaced():
                # Other tensors sit in the module's slots than the graphs hold.
                if not self._watch.reassigned():
                    # Swapped in for this call (torch.func.functional_call, stateless
                    # reparametrization): eager reads them where they are.
                    return self._run_reparametrized(args, kwargs)
                self._retrack()  # assigned for good (module.weight = Parameter(...))
                specs = ()
            elif self._watch.attributes_changed():
                self._drop_graphs(lambda s: s.signature is not None,
                                  "a Python attribute of the model changed after capture (a "
                                  "graph replays the value it traced): its graphs are "
                                  "captured again on their next call")
            if any(s.stamp is not None for s in specs):
                self._drop_stale_graphs()
        spec = self._find(args, kwargs)
        if spec is None:
            with self._lock:  # another thread may have captured it meanwhile
                spec = self._find(args, kwargs) or self.specialize(args, kwargs)
        if spec.writes_buffers and spec.stamp is not None:
            return self._run_writing(spec, args, kwargs)
        return spec.run(*args, **kwargs)

    def _run_writing(self, spec: _Specialization, args: tuple[Any, ...],
                     kwargs: dict[str, Any]) -> Any:
        """A graph that updates BatchNorm statistics (train mode under ``no_grad``, as in
        ``swa_utils.update_bn``): its own writes leave it current, so it is not captured anew
        on every call."""
        out = spec.run(*args, **kwargs)
        with self._lock:
            stamp = self._watch.stamp()
            for other in self._specializations:
                if other.stamp == spec.stamp:
                    other.stamp = stamp
            self._watch.take_fingerprint()
        return out

    # --- weights written after capture ----------------------------------------------------

    def _run_reparametrized(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        note = ("parameters or buffers were replaced by other tensors (functional_call, "
                "attribute assignment): calls with them run eagerly")
        if note not in self.report.warnings:
            self.report.warnings.append(note)
        return self.module(*args, **kwargs)

    def _drop_graphs(self, which: Callable[[_Specialization], bool], note: str) -> None:
        with self._lock:
            self._specializations = [s for s in self._specializations if not which(s)]
            self._watch.refresh_attributes()
            if note not in self.report.warnings:
                self.report.warnings.append(note)

    def _drop_stale_graphs(self) -> None:
        stamp = self._watch.stamp()
        rewritten = self._watch.fingerprint_changed()
        stale = [s for s in self._specializations
                 if s.stamp is not None and (s.stamp != stamp or rewritten)]
        if stale:
            self._drop_graphs(lambda s: s in stale,
                              "parameters or buffers were written after an inference capture "
                              "(training, load_state_dict, in-place or .data edits): graphs "
                              "whose folded or packed constants came from the old values are "
                              "captured again on their next call")
            with self._lock:
                self._watch.take_fingerprint()

    def _unshare(self) -> None:
        """Give the private module its own copy of the weights it shares with the user's
        model, before anything writes them (a training step, BatchNorm statistics, a load).

        Each tensor keeps its identity and takes new storage holding the same values: an
        optimizer built on ``fast.parameters()`` stays valid, and so do the graphs, which
        hold these tensors. They keep the user's version counters, so an in-place write to
        the user's model still drops graphs built from the values it had."""
        if not self._shares_weights:
            return
        self._shares_weights = False
        done: set[int] = set()
        for m in self.module.modules():
            for t in (*m._parameters.values(), *m._buffers.values()):
                if t is not None and id(t) not in done:
                    done.add(id(t))
                    t.data = t.data.clone()
        self._watch.take_fingerprint()  # new memory, the same values

    def _before_load(self, *args: Any, **kwargs: Any) -> None:
        self._unshare()

    def _weights_loaded(self, module: nn.Module, incompatible: Any) -> None:
        if self._watch.replaced():  # assign=True: graphs holding the old tensors are stale
            self._retrack()
        else:
            self._specializations = [s for s in self._specializations if s.stamp is None]

    def _retrack(self) -> None:
        """Forget every graph; watch the tensors and attributes the module holds now."""
        with self._lock:
            self._specializations = []
            self._parameters_list = list(self.module.parameters())
            self._watch.refresh_tensors()
            self._watch.refresh_attributes()

    def _find(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Specialization | None:
        modes = current_modes(self.module, self._submodules, self._parameters_list)
        for spec in self._specializations:
            if spec.signature is None or spec.signature.matches(args, kwargs, modes):
                return spec
        return None

    def _apply(self, fn: Callable[..., Any], recurse: bool = True) -> OptimizedModule:
        # .to(), .half(), .cuda(): graphs may hold device- or dtype-specific constants, so
        # they are dropped and captured again on the next call.
        super()._apply(fn, recurse)
        self._retrack()  # moved buffers are new tensors
        return self

    def __getstate__(self) -> dict[str, Any]:
        # Graphs hold kernels bound to this process (packed weights, oneDNN handles): a saved
        # module keeps the model, the options and the report, and captures again on load.
        state = dict(self.__dict__)
        state["_specializations"] = []
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        # The watch's snapshot was copied with the module, so it names the copied tensors.
        super().__setstate__(state)
        self._lock = threading.RLock()

    def specialize(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> _Specialization:
        """Capture, optimize and verify for this input signature; record it in ``report``.

        Capture, measuring and verification run on copies of the inputs (a forward may write
        them) and leave the module's buffers, Python attributes and the global RNG as they
        were; one thread at a time."""
        kwargs = dict(kwargs)
        with self._lock:
            if len(self._specializations) >= self._config.max_specializations:
                return self._eager_beyond_limit(args, kwargs)
            if torch.is_grad_enabled() or any(m.training for m in self._submodules):
                self._unshare()  # a training capture writes weights, a train-mode one stats
            devices = [d.index for d in {t.device for t in self._watch.tensors}
                       if d.type == "cuda" and d.index is not None]
            with torch.random.fork_rng(devices=sorted(devices)):
                spec = self._capture(*clone_inputs(args, kwargs))
            self._specializations.append(spec)
            self._watch.take_fingerprint()
            return spec

    def _capture(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Specialization:
        start = time.perf_counter()
        before = self._watch.stamp()
        record = CaptureRecord(inputs=signature_of(args, kwargs, self.module).describe())
        self.report.captures.append(record)
        obstacles = self._probe(args, kwargs)
        spec = None
        for method in self._config.capture:
            if method != "dynamo" and obstacles:
                record.attempts.append((method, "skipped: " + "; ".join(obstacles)))
                continue
            try:
                spec = getattr(self, f"_capture_{method}")(args, kwargs, record)
                break
            except ConfigError:
                raise  # the user's options (an unmeetable memory_budget): no method helps
            except Exception as exc:  # noqa: BLE001 - each failure is a reason, not a crash
                log.info("capture by %s failed: %s", method, exc)
                record.attempts.append((method, _reason(exc)))
                # What the failed attempt recorded is not what will run.
                record.passes, record.verification = [], None
                record.nodes_before = record.nodes_after = record.subgraphs = 0
                record.memory_plan = None
        if spec is None:
            spec = _Specialization(None, "eager", self.module)
            record.method = "eager"
            self.report.warnings.append(
                "no capture method could take the model; it runs eagerly (see attempts)")
        record.seconds = time.perf_counter() - start
        if (self._config.memory_budget is not None and torch.is_grad_enabled()
                and record.memory_plan is None):
            self.report.warnings.append(
                f"memory_budget: captured by {record.method}, not as one whole graph, so no "
                f"memory plan applies; saved activations are eager's")
        if spec.signature is None:
            self._unshare()  # Dynamo's module or eager: serves any later call, training too
        # Verification puts back the buffers it ran through (in place): autoopt's own writes
        # leave every graph that was current, current.
        after = self._watch.stamp()
        for other in self._specializations:
            if other.stamp == before:
                other.stamp = after
        if spec.method != "eager" and not torch.is_grad_enabled():
            spec.stamp = after
            spec.writes_buffers = any(m.training for m in self._submodules)
        return spec

    def _eager_beyond_limit(self, args: tuple[Any, ...], kwargs: dict[str, Any],
                            ) -> _Specialization:
        limit = self._config.max_specializations
        message = (f"{limit} input signatures captured (max_specializations); new ones run "
                   f"eagerly. Pass dynamic=True to let shapes vary in one graph.")
        if message not in self.report.warnings:
            self.report.warnings.append(message)
            warnings.warn(f"autoopt: {message}", stacklevel=3)
        return _Specialization(signature_of(args, kwargs, self.module), "eager", self.module)

    def _probe(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[str]:
        """Run eagerly once; return why a whole-graph capture could not replay this model."""
        obstacles = []
        if has_hooks(self.module):
            obstacles.append("the model has forward/backward hooks, which a graph would run "
                             "only once at capture time")
        with preserved(self.module):
            before = python_state(self.module)
            try:
                probe_args, probe_kwargs = clone_inputs(args, kwargs)
                out = self.module(*probe_args, **probe_kwargs)
            except Exception as exc:
                raise ModelError(f"the model raised {type(exc).__name__} when run eagerly on "
                                 f"the example inputs: {exc}. Check the inputs' number, shapes "
                                 f"and dtypes against the model's forward.") from exc
            changed = sorted(f"{p + '.' if p else ''}{k}" for (p, k), v in
                             python_state(self.module).items() if before.get((p, k)) != v)
            if changed:
                obstacles.append(f"forward changes Python state ({', '.join(changed[:3])})")
            if torch.is_grad_enabled() and uses_custom_autograd(out):
                obstacles.append("the model uses a custom autograd.Function, whose backward "
                                 "a traced graph would drop")
        return obstacles

    # --- capture methods, tried in config.capture order -------------------------------------

    def _capture_export(self, args: tuple[Any, ...], kwargs: dict[str, Any],
                        record: CaptureRecord) -> _Specialization:
        gm = capture_lib.export_graph(self.module, args, kwargs, self._dynamic,
                                      self._dynamic_shapes)
        flat = capture_lib.flat_example_inputs(gm, args, kwargs)
        gm = self._optimize_graph(gm, flat, args, kwargs, record, "export",
                                  lambda g: g)
        return _Specialization(signature_of(args, kwargs, self.module, gm), "export",
                               self._cuda_graph(gm, args, kwargs, record), gm)

    def _cuda_graph(self, gm: GraphModule, args: tuple[Any, ...], kwargs: dict[str, Any],
                    record: CaptureRecord) -> Callable[..., Any]:
        """``gm`` replayed as one CUDA graph where that applies and matches eager, else gm."""
        device = _model_device(self.module)
        if (not self._config.cuda_graphs or device is None or device.type != "cuda"
                or torch.is_grad_enabled() or self._dynamic or self._dynamic_shapes is not None):
            return gm
        runner, why = cuda_graphs.record(gm, args, kwargs)
        if why:
            record.cuda_graph = f"not used: {why}"
            return gm
        if self._config.verify:
            result = self._verify(runner, args, kwargs, gm)
            if not result.ok:
                record.cuda_graph = f"not used: its replay differs from eager ({result.detail})"
                return gm
        record.cuda_graph = "recorded"
        return runner

    def _capture_symbolic_trace(self, args: tuple[Any, ...], kwargs: dict[str, Any],
                                record: CaptureRecord) -> _Specialization:
        gm, positional = capture_lib.symbolic_trace_graph(self.module, args, kwargs)

        def adapt(g: GraphModule) -> Callable[..., Any]:
            return lambda *a, **k: g(*positional(*a, **k))

        gm = self._optimize_graph(gm, positional(*args, **kwargs), args, kwargs, record,
                                  "symbolic_trace", adapt)
        return _Specialization(signature_of(args, kwargs, self.module), "symbolic_trace",
                               adapt(gm), gm)

    def _capture_dynamo(self, args: tuple[Any, ...], kwargs: dict[str, Any],
                        record: CaptureRecord) -> _Specialization:
        record.method = "dynamo"
        backend = functools.partial(autoopt_backend, config=self._config, record=record)
        compiled = torch.compile(self.module, backend=backend,
                                 dynamic=True if self._dynamic else None)
        if self._config.verify:
            result = self._verify(compiled, args, kwargs)
            record.verification = result
            if not result.ok:
                raise _Mismatch(f"compiled module differs from eager: {result.detail}")
        return _Specialization(None, "dynamo", compiled)

    def _optimize_graph(self, gm: GraphModule, flat_inputs: tuple[Any, ...],
                        args: tuple[Any, ...], kwargs: dict[str, Any], record: CaptureRecord,
                        method: str, adapt: Callable[[GraphModule], Callable[..., Any]],
                        ) -> GraphModule:
        """Verify the captured graph, then run the pass pipeline on it with rollback."""
        record.method = method
        verdicts: dict[int, tuple[GraphModule, VerifyResult]] = {}
        reference: dict[Any, Any] = {}

        def check(candidate: GraphModule) -> VerifyResult:
            # The driver's final check and ours see the same module: verify it once.
            if id(candidate) not in verdicts:
                verdict = self._verify(adapt(candidate), args, kwargs, candidate, reference)
                verdicts[id(candidate)] = (candidate, verdict)
            return verdicts[id(candidate)][1]

        record.nodes_before = len(gm.graph.nodes)

        device = _model_device(self.module) or torch.device("cpu")
        # A gradient can flow to a parameter or an input: every op must keep its backward.
        training = needs_gradients(args, kwargs, current_modes(self.module))
        ctx = PassContext(flat_inputs, device, training, self.cost_model,
                          self._config.resolved_pass_options)
        optimized, records = run_pipeline(gm, self._config.passes, ctx,
                                          check if self._config.verify else None,
                                          disabled=self._config.disable,
                                          debug=self._config.debug)
        record.passes = records
        record.nodes_after = len(optimized.graph.nodes)
        record.precision = optimized.meta.get("precision")  # what the precision pass chose
        if self._config.memory_budget is not None and training:
            # After the passes, so the plan prices the graph that runs; verified below.
            optimized, plan = memory_lib.apply_memory_budget(
                optimized, ctx, memory_lib.parse_budget(self._config.memory_budget),
                self._config.memory_modes)
            record.memory_plan = plan
        if self._config.verify:
            # Usually already checked by the driver (memoized). When the result still differs,
            # every pass was rolled back, so it is the capture that is wrong.
            record.verification = check(optimized)
            if not record.verification.ok:
                raise _Mismatch(f"captured graph differs from eager: "
                                f"{record.verification.detail}")
        return optimized

    def _verify(self, candidate: Callable[..., Any], args: tuple[Any, ...],
                kwargs: dict[str, Any], state: nn.Module | None = None,
                reference: dict[Any, Any] | None = None) -> VerifyResult:
        """Compare ``candidate`` with eager on the example and fresh inputs: outputs, the
        buffers each leaves behind (BatchNorm statistics in training), what each writes into
        its inputs and, where a gradient can flow, the gradients of the inputs and parameters.
        Each run gets its own copy of the inputs. ``reference`` memoizes eager's results per
        input set across calls (each run starts from the same state and seed, so they do not
        change)."""
        reference = {} if reference is None else reference
        module = self.module
        holders = [m for m in (module, state) if m is not None]
        differentiable = needs_gradients(args, kwargs, current_modes(module))

        def run(fn: Callable[..., Any], owner: nn.Module, a: tuple[Any, ...],
                k: dict[str, Any]) -> Any:
            a, k = clone_inputs(a, k)
            with preserved(*holders):
                torch.manual_seed(0)
                out = fn(*a, **k)
                leaves = {p: (v.detach().clone() if isinstance(v, torch.Tensor) else v)
                          for p, v in _leaves(out, "output")}
                leaves.update(_leaves((a, k), "inputs after the call"))
                if differentiable:
                    leaves.update(gradients(out, (a, k), module.named_parameters()))
                buffers = {n: b.detach().clone() for n, b in owner.named_buffers()}
            return leaves, buffers

        def run_pair(a: tuple[Any, ...], k: dict[str, Any]) -> tuple[Any, Any]:
            key = (id(a), id(k))  # () is one shared object; the kwargs dicts are not
            if key not in reference:
                reference[key] = run(module, module, a, k)
            expected, expected_buffers = reference[key]
            actual, actual_buffers = run(candidate, state or module, a, k)
            common = sorted(expected_buffers.keys() & actual_buffers.keys())
            return ((expected, {n: expected_buffers[n] for n in common}),
                    (actual, {n: actual_buffers[n] for n in common}))

        if "sets" not in reference:  # the same input objects each call, so ids key the memo
            reference["sets"] = input_sets(args, kwargs, self._config.random_inputs)
        return check_all(run_pair, reference["sets"], self._config.verification_tolerances)


def _backend(spec: _Specialization) -> str:
    if spec.method in ("dynamo", "eager"):
        return spec.method
    return "cuda_graph" if isinstance(spec.run, cuda_graphs.CudaGraphRunner) else "aten"


class _Mismatch(Exception):
    """A capture produced a graph that is not the model's function; try the next method."""


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    first = text[0][:240] if text else ""
    return f"{type(exc).__name__}: {first}" if not isinstance(exc, _Mismatch) else first


def _unwrap(model: Any) -> nn.Module:
    if isinstance(model, OptimizedModule):
        return model.module
    original = getattr(model, "_orig_mod", None)  # torch.compile's wrapper
    if isinstance(original, nn.Module):
        return original
    if not isinstance(model, nn.Module):
        raise ModelError(f"optimize expects a torch.nn.Module; got {type(model).__name__}. "
                         "Wrap a function in an nn.Module whose forward calls it.")
    if isinstance(model, torch.jit.ScriptModule):
        raise ModelError("TorchScript modules cannot be captured; pass the original Python "
                         "nn.Module instead of the torch.jit.script/trace result.")
    meta = [n for n, p in model.named_parameters() if p.is_meta]
    if meta:
        raise ModelError(f"parameters on the meta device have no values ({meta[0]}, ...); "
                         "load or initialise the weights (e.g. model.to_empty(device=...) "
                         "then load_state_dict) before optimizing.")
    return model


def check_inputs(example_inputs: Any, example_kwargs: Mapping[str, Any] | None,
                  ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    if isinstance(example_inputs, Mapping):
        raise InputError("example_inputs is a dict; pass keyword inputs as example_kwargs="
                         "{...} and positional ones as a tuple.")
    if not isinstance(example_inputs, tuple):
        hint = (" If the model's first argument is a list, pass (your_list,)."
                if isinstance(example_inputs, list) else "")
        raise InputError(f"example_inputs must be a tuple of positional arguments (or one "
                         f"tensor); got {type(example_inputs).__name__}.{hint}")
    if example_kwargs is None:
        example_kwargs = {}
    if not isinstance(example_kwargs, Mapping) or not all(isinstance(k, str)
                                                          for k in example_kwargs):
        raise InputError(f"example_kwargs must be a dict from argument name to value; got "
                         f"{type(example_kwargs).__name__}.")
    leaves = [x for x in pytree.tree_leaves((example_inputs, dict(example_kwargs)))
              if isinstance(x, torch.Tensor) and x.is_floating_point()]
    if any(not bool(torch.isfinite(x).all()) for x in leaves if not x.is_meta):
        warnings.warn("autoopt: example inputs contain NaN or Inf; verification cannot judge "
                      "outputs computed from them. Pass finite example inputs.", stacklevel=3)
    return example_inputs, dict(example_kwargs)


def _model_device(model: nn.Module) -> torch.device | None:
    for t in list(model.parameters()) + list(model.buffers()):
        return t.device
    return None


def _private_copy(model: nn.Module, share_weights: bool) -> nn.Module:
    """A deep copy of ``model``: its own modules and Python state; with ``share_weights`` its
    parameters and buffers are new tensors on the same memory as the model's (and the same
    version counters, so the model's in-place writes are seen) instead of copies."""
    memo: dict[int, Any] = {}
    if share_weights:
        for t in (*model.parameters(), *model.buffers()):
            if t.is_inference():
                continue  # made under inference_mode: only a copy can be used outside it
            if type(t) is nn.Parameter:
                memo[id(t)] = nn.Parameter(t.detach(), requires_grad=t.requires_grad)
            elif type(t) is torch.Tensor:
                memo[id(t)] = t.detach()
            # Other tensor types (lazy or quantized parameters, subclasses) are copied.
    return copy.deepcopy(model, memo)


def _resolve_device(model: nn.Module, device: str | torch.device | None) -> torch.device | None:
    if device is None:
        return None
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise DeviceError(f"device={device!r} is not a device name; use 'cpu', 'cuda' or "
                          f"'cuda:N'.") from exc
    if target.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"device={device!r} asks for CUDA but no CUDA GPU is available "
                              f"(torch.cuda.is_available() is False); use device='cpu'.")
        if target.index is not None and target.index >= torch.cuda.device_count():
            raise DeviceError(f"device={device!r} but only {torch.cuda.device_count()} CUDA "
                              f"device(s) exist.")
    return target


def _check_devices_and_dtypes(model: nn.Module, args: tuple[Any, ...],
                              kwargs: dict[str, Any]) -> None:
    device = _model_device(model)
    float_dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    flat, _ = pytree.tree_flatten_with_path((args, kwargs))
    for path, value in flat:
        if not isinstance(value, torch.Tensor):
            continue
        where = _input_name(path)
        if device is not None and value.device != device and value.dim() > 0:
            raise InputError(f"example input {where} is on {value.device} but the model is on "
                             f"{device}; move it with .to('{device}') or pass device=.")
        if (value.is_floating_point() and len(float_dtypes) == 1
                and value.dtype not in float_dtypes):
            model_dtype = next(iter(float_dtypes))
            raise InputError(f"example input {where} is {value.dtype} but the model's "
                             f"parameters are {model_dtype}; cast the input with "
                             f".to({model_dtype}) (or the model, for reduced precision).")


def _input_name(path: tuple[Any, ...]) -> str:
    text = "".join(str(p) for p in path)
    if text.startswith("[0]"):
        return "args" + text[3:]
    if text.startswith("[1]"):
        return "kwargs" + text[3:]
    return text or "input"


