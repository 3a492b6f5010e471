"""Capture, optimize and verify a module for one input signature.

``Capturer.capture`` tries the capture methods in the config's order (``torch.export``, then
``torch.fx.symbolic_trace``, then Dynamo), runs the pass driver on each whole graph with
verification and rollback, applies the memory plan and CUDA graphs as checked steps, and
returns a ``Compiled``: what to run and the signature it serves. Every run it makes of the
model works on copies of the inputs and leaves the module's state as it found it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule
from torch.utils import _pytree as pytree

from autoopt.backends.whole_graph import lower_whole_graph
from autoopt.capture import graph as capture_lib
from autoopt.check.compare import VerifyResult, check_all, gradients, reference_run
from autoopt.check.inputs import clone_inputs, input_sets, leaves
from autoopt.check.report import BackendChoice, CaptureRecord, PassRecord, Report
from autoopt.check.state import (
    HookKey,
    preserved,
)
from autoopt.compile.compiled import Compiled, Source, model_device
from autoopt.compile.dynamo import autoopt_backend
from autoopt.compile.guards import current_modes, needs_gradients, signature_of
from autoopt.compile.pass_runner import run_pipeline
from autoopt.compile.probe import EagerProbe
from autoopt.compile.reuse import Earlier
from autoopt.cost_model import CostModel
from autoopt.cost_model.isolation import is_read_only
from autoopt.errors import ConfigError, wrapped_error
from autoopt.observe import memory_profile
from autoopt.options.config import OptimizeConfig
from autoopt.options.memory import parse_budget
from autoopt.passes import PassContext
from autoopt.passes.graph import graph_to_keep, release_packed
from autoopt.runtime import budget as budget_lib
from autoopt.runtime import cuda_graphs

log = logging.getLogger(__name__)


class _HookGuarded:
    """Dynamo's compiled module, traced with guards on the modules' hooks: by default Dynamo
    assumes no hook is registered or removed after it compiled (``torch._dynamo.config.
    skip_nnmodule_hook_guards``), and one registered later on ``fast.module`` never ran."""

    def __init__(self, compiled: Callable[..., Any]) -> None:
        self.compiled = compiled

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with torch._dynamo.config.patch(skip_nnmodule_hook_guards=False):
            return self.compiled(*args, **kwargs)


class Capturer(EagerProbe):
    """Captures ``module`` for one input signature at a time.

    Args:
        module: autoopt's private copy of the model (never the user's).
        config: the options.
        cost_model: what the passes measure with.
        report: where each capture is recorded.
        dynamic, dynamic_shapes: dimensions to keep symbolic (``torch.export``'s terms).
        on_state_write: called when the eager probe of a capture writes the module's
            parameters or buffers in place (a forward that counts its calls in a buffer),
            before anything else runs the model: the owner then stops sharing memory with
            the user's model, which the calls would otherwise write.
    """

    def __init__(self, module: nn.Module, config: OptimizeConfig, cost_model: CostModel,
                 report: Report, *, dynamic: bool = False, dynamic_shapes: Any = None,
                 on_state_write: Callable[[], None] | None = None) -> None:
        self._on_state_write = on_state_write
        # Hooks the model installed on its first call, kept with the state (see _probe).
        self.own_hooks: set[HookKey] = set()
        # Whether a probe kept state a first call wrote (the owner's watch then re-reads it).
        self.kept_state = False
        # The parameters and buffers the last probe's forward wrote in place (a call
        # counter): the graph writes them on every call, and reads them live.
        self.written: list[torch.Tensor] = []
        self._output_types: tuple[type, ...] = ()  # see capture.objects
        self._reference: dict[Any, Any] = {}
        # Bytes of constants that graphs dropped for new weights may still hold, waiting for
        # a full collection (``rebuild``).
        self._uncollected = 0
        # Whether ``_dynamic_shapes`` are autoopt's choice for this capture (``varying``).
        self._automatic = False
        self.module = module
        self._config = config
        self.cost_model = cost_model
        self.report = report
        self._dynamic = dynamic
        self._dynamic_shapes = dynamic_shapes
        # What the first graph of each mode (grad, autocast, train or eval: ``current_modes``)
        # measured (None: nothing to reuse), and the one a capture in progress reuses.
        self._earlier: dict[tuple[Any, ...], Earlier | None] = {}
        self._reusing: Earlier | None = None

    def capture(self, args: tuple[Any, ...], kwargs: dict[str, Any],
                source: Source | None = None,
                varying: dict[int, dict[int, Any]] | None = None) -> Compiled:
        """Try each capture method in ``config.capture`` order on these inputs; the first
        whose graph verifies wins, else the model runs eagerly. Records it in ``report``,
        with the steps ``optimize_memory`` (or free memory) left out. With ``source`` (an
        exported graph whose signature matches these inputs but for the grad mode), the
        passes run on that graph first: no new export where it verifies. With ``varying``
        (input leaf, in ``signature_of``'s order -> dimension -> ``Dim``), those dimensions
        are exported dynamic (``torch.export`` keeps dynamic what the model allows)."""
        record = CaptureRecord(inputs=signature_of(args, kwargs, self.module).describe())
        self.report.captures.append(record)
        configured = self._dynamic_shapes
        if varying:
            self._dynamic_shapes = _dynamic_shapes(self.module, args, kwargs, varying)
            self._automatic = True
            log.info("capture: a size changed since the last graph: exporting with those "
                     "dimensions dynamic, one graph for the sizes that vary (dynamic=False "
                     "keeps a graph per size)")
        with memory_profile.allowing(self._config.optimize_memory_limit,
                                     model_device(self.module) or torch.device("cpu")) as room, \
                memory_profile.collecting_only_new():
            try:
                spec = self._capture(args, kwargs, record, source)
            finally:
                record.memory = list(room.notes)
                self._dynamic_shapes, self._automatic = configured, False
        if spec.signature is not None and spec.signature.shapes is not None:
            record.inputs = spec.signature.describe()  # the sizes it serves: ? where free
        return spec

    def rebuild(self, spec: Compiled, args: tuple[Any, ...], kwargs: dict[str, Any],
                ) -> Compiled | None:
        """``spec`` built again from its exported graph (``spec.source``) for the weights as
        they are now, on these inputs (which ``spec`` serves): the passes run again (what
        they derive from the weights), the backend ``spec`` chose is built again without
        measuring the others, and the result is verified against eager on these inputs (the
        graph's structure was verified at capture; new weights can only change what was
        derived from them). No export, no probe, no new record in ``report``: the capture's
        record counts the rebuild. None where it fails (the caller captures anew)."""
        source = spec.source
        if source is None:
            return None
        start = time.perf_counter()
        record = CaptureRecord(inputs=source.record.inputs)  # this build's, not reported
        config = self._config
        written = self.written
        # One candidate, the one measured fastest for this graph: nothing to measure. The
        # passes that changed the graph at capture, no others: a pass that found nothing to
        # do in this graph then finds nothing now (the rewrites look at the graph, not at the
        # weights' values), and each costs a copy of the graph.
        known = {name for name, _ in config.passes}
        idle = {r.name for r in source.record.passes if r.status != "applied"} & known
        self._config = dataclasses.replace(config, backend=None,
                                           backends=(spec.backend or "aten",),
                                           random_inputs=0,
                                           disable=tuple({*config.disable, *idle}))
        self.written = list(source.written)
        # A full collection (0.1-0.5 s in a process holding torch, often more than the
        # rebuild itself) only once the constants of dropped graphs waiting for one
        # (``retire``) add up to the model's weights.
        weights = sum(t.numel() * t.element_size()
                      for t in (*self.module.parameters(), *self.module.buffers()))
        collect = self._uncollected >= weights
        if collect:
            self._uncollected = 0
        try:
            with memory_profile.allowing(config.optimize_memory_limit,
                                         model_device(self.module) or torch.device("cpu")), \
                    memory_profile.collecting_only_new(full_first=collect):
                built = self._from_graph(source.graph, args, kwargs, record)
        except Exception as exc:  # noqa: BLE001 - a failed rebuild is a capture, not a crash
            log.info("rebuilding the graph for new weights failed (%s); capturing anew", exc)
            self.written = written
            return None
        finally:
            self._config = config
            self._reference = {}
        if built.backend != spec.backend:  # not what was chosen: measure anew instead
            self.written = written
            return None
        built.source = source
        source.record.rebuilds += 1
        log.info("capture: rebuilt the graph for %s for new weights in %.2f s (no export)",
                 source.record.inputs, time.perf_counter() - start)
        return built

    def retire(self, spec: Compiled) -> Compiled:
        """What is kept of a graph gone stale to ``rebuild`` it later: its signature,
        backend, exported graph and record, not the graph that ran (its folded, merged and
        packed copies of the old weights). The packed copies go now (by reference count);
        the rest waits for a collection, a graph module being a reference cycle."""
        self._uncollected += _constant_bytes(spec)
        return Compiled(spec.signature, spec.method, self.module, None, spec.stamp,
                        spec.watched, spec.backend, spec.source)

    def _capture(self, args: tuple[Any, ...], kwargs: dict[str, Any],
                 record: CaptureRecord, source: Source | None = None) -> Compiled:
        start = time.perf_counter()
        with memory_profile.stage("eager probe"):
            obstacles = self._probe(args, kwargs)
        spec = None
        if source is not None and not obstacles:
            spec = self._reuse(source, args, kwargs, record)
        for method in self._config.capture if spec is None else ():
            if method != "dynamo" and obstacles:
                record.attempts.append((method, "skipped: " + "; ".join(obstacles)))
                continue
            log.info("capture: trying %s", method)
            try:
                with memory_profile.stage(f"capture {method}"), \
                        self._reusing_choice(method, args, kwargs):
                    spec = getattr(self, f"_{method}")(args, kwargs, record)
                break
            except ConfigError:
                raise  # the user's options (an unmeetable memory_budget): no method helps
            except Exception as exc:  # noqa: BLE001 - each failure is a reason, not a crash
                wrapped = wrapped_error(exc, ConfigError)
                if wrapped is not None:  # raised in a Dynamo subgraph (a backend= forced)
                    raise wrapped from None
                log.info("capture by %s failed: %s", method, exc)
                record.attempts.append((method, _reason(exc)))
                # What the failed attempt recorded is not what will run.
                record.passes, record.verification = [], None
                record.nodes_before = record.nodes_after = record.subgraphs = 0
                record.memory_plan = None
        if spec is None:
            spec = Compiled(None, "eager", self.module)
            record.method = "eager"
            self.report.warnings.append(
                "no capture method could take the model; it runs eagerly (see attempts)")
        record.seconds = time.perf_counter() - start
        self._reference = {}  # eager's outputs and the random input sets: not kept
        if (self._config.memory_budget is not None and record.memory_plan is None
                and record.method in ("dynamo", "eager")
                and needs_gradients(args, kwargs, current_modes(self.module))):
            # The user asked for the budget: a module that ignores it is not an answer.
            attempts = "; ".join(f"{m}: {why}" for m, why in record.attempts) or "none"
            raise ConfigError(
                f"memory_budget: the model was captured by {record.method}, not as one whole "
                f"graph, so no memory plan applies (saved activations would be eager's). Why "
                f"no whole graph: {attempts}. Make the model exportable (torch.export), or "
                f"drop memory_budget to train it as captured.")
        return spec

    @contextlib.contextmanager
    def _reusing_choice(self, method: str, args: tuple[Any, ...],
                        kwargs: dict[str, Any]) -> Iterator[None]:
        """Within it, a whole-graph capture of new inputs builds the backend the module's
        first graph of the same modes measured fastest, with the passes that can matter
        (``reuse``); a Dynamo capture, whose subgraphs have their own candidates, does not."""
        earlier = self._earlier.get(current_modes(self.module)) if method != "dynamo" else None
        if earlier is None:
            yield
            return
        config = self._config
        self._config, self._reusing = earlier.config(config), earlier
        log.info("capture: building %s, measured fastest for %s, without measuring the "
                 "others", earlier.backend, earlier.inputs)
        try:
            yield
        finally:
            self._config, self._reusing = config, None

    def _reuse(self, source: Source, args: tuple[Any, ...], kwargs: dict[str, Any],
               record: CaptureRecord) -> Compiled | None:
        """The passes, backend choice and verification run on ``source``'s exported graph
        for these inputs; None where that fails (the capture methods follow)."""
        index = next((i for i, c in enumerate(self.report.captures) if c is source.record), -1)
        what = f"the graph exported for [{index}] {source.record.inputs}, no new export"
        log.info("capture: optimizing %s", what)
        try:
            with memory_profile.stage("capture reused export"):
                spec = self._from_graph(source.graph, args, kwargs, record)
        except ConfigError:
            raise  # the user's options (an unmeetable memory_budget): no method helps
        except Exception as exc:  # noqa: BLE001 - then export anew, as without it
            log.info("the exported graph does not serve this call (%s); capturing anew", exc)
            record.attempts.append(("reused export", _reason(exc)))
            record.passes, record.verification = [], None
            record.nodes_before = record.nodes_after = record.subgraphs = 0
            record.memory_plan = None
            record.backends = []
            return None
        record.reused = what
        return spec

    # --- capture methods, tried in config.capture order -----------------------------------

    def _export(self, args: tuple[Any, ...], kwargs: dict[str, Any],
                record: CaptureRecord) -> Compiled:
        with memory_profile.stage("torch.export"):
            try:
                gm = capture_lib.export_graph(self.module, args, kwargs, self._dynamic,
                                              self._dynamic_shapes, self._output_types)
            except Exception as exc:
                if not self._automatic:
                    raise
                # Sizes autoopt chose to free, not the user: at these sizes, as without.
                self._automatic = False
                log.info("capture: export with the varying sizes dynamic failed (%s); "
                         "exporting at these sizes", exc)
                self._dynamic_shapes = None
                gm = capture_lib.export_graph(self.module, args, kwargs, self._dynamic, None,
                                              self._output_types)
        return self._from_graph(gm, args, kwargs, record)

    def _from_graph(self, exported: GraphModule, args: tuple[Any, ...],
                    kwargs: dict[str, Any], record: CaptureRecord) -> Compiled:
        """An exported graph optimized, verified and lowered for these inputs."""
        flat = capture_lib.flat_example_inputs(exported, args, kwargs)
        gm = self._optimize_graph(exported, flat, args, kwargs, record, "export",
                                  lambda g: g)
        if self.report.captures[0] is record:  # the example's: precision= decided now, not
            from autoopt.options.precision import check_applied  # after minutes timing backends

            check_applied(self._config, Report([record]), self.module)
        run = self._unless_unimproved(self._cuda_graph(gm, args, kwargs, record), record)
        run, backend = self._lower(gm, run, args, kwargs, record, None)
        return Compiled(signature_of(args, kwargs, self.module, gm), "export", run,
                        graph_to_keep(gm, backend), backend=backend,
                        source=Source(exported, record, list(self.written)))

    def _lower(self, gm: GraphModule, aten: Callable[..., Any], args: tuple[Any, ...],
               kwargs: dict[str, Any], record: CaptureRecord,
               adapt: Callable[[Callable[..., Any]], Callable[..., Any]] | None,
               ) -> tuple[Callable[..., Any], str]:
        """The fastest verified backend's callable for ``gm`` (``aten`` runs ``aten``), and
        its name where it is not ``aten``."""
        modes = current_modes(self.module)
        gradients = needs_gradients(args, kwargs, modes)

        def lower(config: OptimizeConfig) -> tuple[Callable[..., Any], BackendChoice]:
            return lower_whole_graph(
                gm, aten, self.module, args, kwargs, config=config,
                cost_model=self.cost_model,
                verify=(lambda c: self._verify(c, args, kwargs, gm, self._reference))
                if config.verify else None,
                adapt=adapt, gradients=gradients,
                dynamic=self._dynamic or self._dynamic_shapes is not None,
                memory_plan=record.memory_plan is not None,
                device=model_device(self.module) or torch.device("cpu"))

        with memory_profile.stage("backend choice"):
            try:
                run, choice = lower(self._config)
            except ConfigError as exc:
                if self._reusing is None:
                    raise
                # The backend the first graph won with cannot run this one: the aten graph,
                # already verified, does.
                run, choice = lower(dataclasses.replace(self._config, backends=("aten",)))
                choice.skipped[self._reusing.backend] = _reason(exc)
        if self._reusing is not None:
            self._reusing.note(choice)
        elif self._config.backend is None and self._earlier.get(modes) is None:
            self._earlier[modes] = Earlier.of(record, choice)
        record.backends.append(choice)
        if choice.chosen == "aten":
            return run, ""
        record.runs = ""  # the generated code runs, not the model as is
        return run, choice.chosen

    def _cuda_graph(self, gm: GraphModule, args: tuple[Any, ...], kwargs: dict[str, Any],
                    record: CaptureRecord) -> Callable[..., Any]:
        """``gm`` replayed as one CUDA graph where that applies and matches eager, else gm."""
        device = model_device(self.module)
        if (not self._config.cuda_graphs or device is None or device.type != "cuda"
                or torch.is_grad_enabled() or self._dynamic or self._dynamic_shapes is not None):
            return gm
        # A step of the driver like a pass: recorded, verified, rolled back on a mismatch.
        start = time.perf_counter()
        runner, why = cuda_graphs.record(gm, args, kwargs)
        if why:
            record.cuda_graph = f"not used: {why}"
            record.passes.append(PassRecord("cuda_graph", "unchanged", reason=why,
                                            seconds=time.perf_counter() - start))
            return gm
        if self._config.verify:
            result = self._verify(runner, args, kwargs, gm)
            if not result.ok:
                record.cuda_graph = f"not used: its replay differs from eager ({result.detail})"
                record.passes.append(PassRecord("cuda_graph", "rolled_back", reason=result.detail,
                                                seconds=time.perf_counter() - start))
                return gm
        record.cuda_graph = "recorded"
        record.passes.append(PassRecord("cuda_graph", "applied",
                                        seconds=time.perf_counter() - start))
        return runner

    def _symbolic_trace(self, args: tuple[Any, ...], kwargs: dict[str, Any],
                        record: CaptureRecord) -> Compiled:
        gm, positional = capture_lib.symbolic_trace_graph(self.module, args, kwargs)

        def adapt(g: GraphModule) -> Callable[..., Any]:
            return lambda *a, **k: g(*positional(*a, **k))

        gm = self._optimize_graph(gm, positional(*args, **kwargs), args, kwargs, record,
                                  "symbolic_trace", adapt)
        run, backend = self._lower(gm, self._unless_unimproved(adapt(gm), record), args,
                                   kwargs, record, adapt)
        return Compiled(signature_of(args, kwargs, self.module), "symbolic_trace", run,
                        graph_to_keep(gm, backend), backend=backend)

    def _unless_unimproved(self, run: Callable[..., Any], record: CaptureRecord,
                           ) -> Callable[..., Any]:
        """The model itself where no pass or driver step changed the graph: a captured graph
        that only replays the model's ops dispatches each through its ATen overload, slower
        than eager (a 40-layer MLP: 0.53 ms against eager's 0.37 ms), and computes nothing
        eager does not. The graph stays in the record for export."""
        if any(r.status == "applied" for r in record.passes):
            return run
        record.runs = "eager: no pass changed the captured graph, so calls run the model as is"
        return self.module

    def _dynamo(self, args: tuple[Any, ...], kwargs: dict[str, Any],
                record: CaptureRecord) -> Compiled:
        record.method = "dynamo"
        backend = functools.partial(autoopt_backend, config=self._config, record=record)
        compiled = _HookGuarded(torch.compile(self.module, backend=backend,
                                              dynamic=True if self._dynamic else None))
        if self._config.verify:
            result = self._verify(compiled, args, kwargs)
            record.verification = result
            if not result.ok:
                raise _Mismatch(f"compiled module differs from eager: {result.detail}")
        return Compiled(None, "dynamo", compiled)

    def _optimize_graph(self, gm: GraphModule, flat_inputs: tuple[Any, ...],
                        args: tuple[Any, ...], kwargs: dict[str, Any], record: CaptureRecord,
                        method: str, adapt: Callable[[GraphModule], Callable[..., Any]],
                        ) -> GraphModule:
        """Verify the captured graph, then run the pass pipeline on it with rollback."""
        record.method = method
        verdicts: dict[int, tuple[GraphModule, VerifyResult]] = {}
        reference: dict[Any, Any] = {}
        # Eager's results per input set, memoized for this capture: the backend candidates
        # are verified against the same runs (a BERT-base at batch 8: 1.7 s per eager run).
        self._reference = reference

        def check(candidate: GraphModule) -> VerifyResult:
            # The driver's final check and ours see the same module: verify it once.
            if id(candidate) not in verdicts:
                verdict = self._verify(adapt(candidate), args, kwargs, candidate, reference)
                verdicts[id(candidate)] = (candidate, verdict)
            return verdicts[id(candidate)][1]

        record.nodes_before = len(gm.graph.nodes)

        device = model_device(self.module) or torch.device("cpu")
        # A gradient can flow to a parameter or an input: every op must keep its backward.
        training = needs_gradients(args, kwargs, current_modes(self.module))
        ctx = PassContext(flat_inputs, device, training, self.cost_model,
                          self._config.resolved_pass_options)
        optimized, records = run_pipeline(gm, self._config.passes, ctx,
                                          check if self._config.verify else None,
                                          disabled=self._config.disabled_passes,
                                          debug=self._config.debug)
        record.passes = records
        record.nodes_after = len(optimized.graph.nodes)
        record.precision = optimized.meta.get("precision")  # what the precision pass chose
        if self._config.memory_budget is not None and training:
            optimized = self._memory_plan(optimized, ctx, record,
                                          check if self._config.verify else None)
        if self._config.verify:
            # Usually already checked by the driver (memoized). When the result still differs,
            # every pass was rolled back, so it is the capture that is wrong.
            record.verification = check(optimized)
            if not record.verification.ok:
                raise _Mismatch(f"captured graph differs from eager: "
                                f"{record.verification.detail}")
        return optimized

    def _memory_plan(self, gm: GraphModule, ctx: PassContext, record: CaptureRecord,
                     check: Callable[[GraphModule], VerifyResult] | None) -> GraphModule:
        """The graph following ``memory_budget``'s plan, after the passes so that the plan
        prices the graph that runs; checked like a pass. The user asked for the budget, so a
        plan that changes the function is an error, not a silent fall-back to a capture
        without it."""
        start = time.perf_counter()
        planned, plan = budget_lib.apply_memory_budget(
            gm, ctx, parse_budget(self._config.memory_budget),
            self._config.memory_modes)
        record.memory_plan = plan
        if check is not None:
            verdict = check(planned)
            if not verdict.ok and check(gm).ok:
                record.passes.append(PassRecord("memory_plan", "rolled_back",
                                                seconds=time.perf_counter() - start,
                                                reason=verdict.detail))
                raise ConfigError(f"memory_budget: the memory plan changes what the model "
                                  f"computes ({verdict.detail}), so it is not applied; pass "
                                  f"memory_modes=('keep', 'recompute') (or without the mode "
                                  f"the plan names) to plan another way.\n{plan.describe()}")
        record.passes.append(PassRecord("memory_plan", "applied", seconds=time.perf_counter()
                                        - start))
        return planned

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
                values = {p: (v.detach().clone() if isinstance(v, torch.Tensor) else v)
                          for p, v in leaves(out, "output")}
                values.update(leaves((a, k), "inputs after the call"))
                if differentiable:
                    values.update(gradients(out, (a, k), module.named_parameters()))
                buffers = {n: b.detach().clone() for n, b in owner.named_buffers()
                           if not is_read_only(b)}  # a pass's constants: no run writes them
            return values, buffers

        def run_pair(a: tuple[Any, ...], k: dict[str, Any]) -> tuple[Any, Any]:
            key = (id(a), id(k))  # () is one shared object; the kwargs dicts are not
            if key in reference:
                expected, expected_buffers = reference[key]
            else:
                with reference_run():  # eager rejecting a random set discards it
                    expected, expected_buffers = run(module, module, a, k)
                kept = sum(v.numel() * v.element_size() for v in [
                    *expected.values(), *expected_buffers.values()] if isinstance(v, torch.Tensor))
                # Kept for the next check (a backend candidate) unless that would not fit:
                # then eager runs again, one set at a time.
                if not memory_profile.allowance().shortfall(
                        kept, "verification's eager outputs kept between checks"):
                    reference[key] = expected, expected_buffers
            actual, actual_buffers = run(candidate, state or module, a, k)
            common = sorted(expected_buffers.keys() & actual_buffers.keys())
            return ((expected, {n: expected_buffers[n] for n in common}),
                    (actual, {n: actual_buffers[n] for n in common}))

        if "sets" not in reference:  # the same input objects each call, so ids key the memo
            reference["sets"] = input_sets(args, kwargs, self._config.random_inputs)
        return check_all(run_pair, reference["sets"], self._config.verification_tolerances)


def _dynamic_shapes(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                    varying: dict[int, dict[int, Any]]) -> Any:
    """``torch.export``'s ``dynamic_shapes`` for these inputs with the ``varying``
    dimensions of each tensor leaf (numbered as ``signature_of`` flattens them, keywords
    sorted) dynamic."""
    leaves = pytree.tree_leaves((tuple(args), dict(sorted(kwargs.items()))))
    dims = {id(leaves[i]): d for i, d in varying.items()}
    return capture_lib.dynamic_shapes_for(module.forward, args, kwargs,
                                          lambda t: dims.get(id(t)))


def _constant_bytes(spec: Compiled) -> int:
    """The bytes of the constants a dropped graph holds of its own (folded, merged and
    converted weights), its packed kernels' copies released now; a compiled engine's
    constants (Inductor's frozen weights) counted as the weights they copy."""
    graphs = {id(g): g for g in (spec.graph, spec.run) if isinstance(g, GraphModule)}
    total = 0
    for gm in graphs.values():
        release_packed(gm)  # freed now: nothing else holds them; a call would pack again
        total += sum(b.numel() * b.element_size() for b in gm.buffers() if is_read_only(b))
    if spec.backend not in ("", "hybrid"):
        total += sum(t.numel() * t.element_size() for t in spec.watched or ())
    return total


class _Mismatch(Exception):
    """A capture produced a graph that is not the model's function; try the next method."""


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    first = text[0][:240] if text else ""
    return f"{type(exc).__name__}: {first}" if not isinstance(exc, _Mismatch) else first
