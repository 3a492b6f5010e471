"""The module ``optimize`` returns: calls routed to the graph compiled for their inputs.

``OptimizedModule`` keeps one ``Compiled`` form per input signature (``autoopt.compile.specialize``
makes them) and, on every call, checks what the graphs assume beyond the inputs: which tensors
the parameters are, their values, the Python attributes traced in (``autoopt.module.watch``). A call
that breaks an assumption is captured again or runs eagerly, never replayed on a stale graph.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule

from autoopt.check.inputs import clone_inputs
from autoopt.check.report import Report
from autoopt.check.state import has_hooks
from autoopt.compile.compiled import Compiled, EagerRaised, model_device
from autoopt.compile.guards import (
    InputSignature,
    current_modes,
    needs_gradients,
    signature_of,
    training_flags,
)
from autoopt.compile.sizes import varying_sizes
from autoopt.compile.specialize import Capturer
from autoopt.cost_model import CostModel
from autoopt.module.concurrency import GATE
from autoopt.module.watch import ModuleWatch
from autoopt.options.config import OptimizeConfig
from autoopt.runtime import cuda_graphs

log = logging.getLogger(__name__)

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
            included), ``cuda_graph`` (replayed as one CUDA graph), ``inductor`` (kernels
            TorchInductor generated), ``onnxruntime`` (an in-process ONNX Runtime session),
            ``dynamo`` or ``eager``.
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
    ``specialization_for(args, kwargs)``, ``graph_for(args, kwargs)``,
    ``runner_for(args, kwargs)`` and ``specialize(args, kwargs)``.
    """

    def __init__(self, module: nn.Module, config: OptimizeConfig, *, dynamic: bool | None = None,
                 dynamic_shapes: Any = None, shares_weights: bool = False) -> None:
        super().__init__()
        self.module = module
        # Whether ``module``'s parameters and buffers are views of the user's tensors.
        self._shares_weights = shares_weights
        self.report = Report()
        self._config = config
        self._dynamic = dynamic
        self._dynamic_shapes = dynamic_shapes
        self._specializations: list[Compiled] = []
        # Graphs gone stale because weights they folded or packed were written, kept to be
        # rebuilt from their exported graphs on their next call (``Capturer.rebuild``).
        self._rebuildable: list[Compiled] = []
        self._submodules = list(module.modules())  # for the train/eval flags checked per call
        self._parameters_list = list(module.parameters())  # for requires_grad, checked too
        # Measures nothing until a pass asks; measurements persist in the on-disk cache.
        self.cost_model = CostModel(model_device(module) or "cpu")
        self._capturer = Capturer(module, config, self.cost_model, self.report,
                                  dynamic=bool(dynamic), dynamic_shapes=dynamic_shapes,
                                  on_state_write=self._unshare)
        # What the graphs assume of the module beyond its inputs: which tensors, their
        # values, the Python attributes traced into them.
        self._watch = ModuleWatch(module)
        self._watch.shared = list(self._watch.tensors) if shares_weights else []
        # (tags token, train/eval flags) as the last walk of the module's dicts found them
        # (``forward``); None: walk on the next call.
        self._settled: tuple[object, tuple[bool, ...]] | None = None
        # Captures (and the bookkeeping of the graph list) one thread at a time; replaying a
        # graph that exists takes no lock.
        self._lock = threading.RLock()
        # load_state_dict(assign=True) replaces the tensors themselves, which no stamp sees;
        # and a load must not write into the user's tensors.
        module.register_load_state_dict_pre_hook(self._before_load)
        module.register_load_state_dict_post_hook(self._weights_loaded)

    # --- public surface ----------------------------------------------------------------------

    @property  # type: ignore[override]
    def training(self) -> bool:
        """The model's own train/eval flag: this module stands for it (``was = m.training;
        m.eval(); ...; m.train(was)`` must put the model back as it was)."""
        module = self.__dict__.get("_modules", {}).get("module")
        return module.training if module is not None else self.__dict__.get("_training", True)

    @training.setter
    def training(self, mode: bool) -> None:
        module = self.__dict__.get("_modules", {}).get("module")
        if module is not None:
            module.training = mode
        else:  # nn.Module.__init__, before the model is attached
            self.__dict__["_training"] = mode

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

    def specialization_for(self, args: Any = (), kwargs: Mapping[str, Any] | None = None,
                           ) -> Specialization:
        """The compiled form a call with these inputs runs, in the current grad mode
        (captured now if none serves them yet)."""
        args = (args,) if isinstance(args, torch.Tensor) else tuple(args)
        kwargs = dict(kwargs or {})
        self._checked()  # as a call would: nothing stale is found, nothing captured from it
        spec = self._find(args, kwargs) or self.specialize(args, kwargs)
        return Specialization(spec.signature, spec.method, spec.graph, _backend(spec))

    def graph_for(self, args: Any = (), kwargs: Mapping[str, Any] | None = None,
                  ) -> GraphModule | None:
        """The optimized whole graph a call with these inputs runs (see
        ``specialization_for``); None where the model runs through Dynamo or eagerly."""
        return self.specialization_for(args, kwargs).graph

    def memory_moved(self) -> None:
        """The module's tensors were given other memory holding the same values, by whoever
        shares them (``autoopt.generation.generator`` points a step module at ``fast.module``'s own
        memory once that module stops sharing yours): the graphs hold; the per-call check
        compares against the tensors as they are now."""
        with self._lock:
            self._take_fingerprint()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        GATE.wait_for_captures()
        training = self._checked()
        if training is None:
            # A capture that began in another thread after the wait may have swapped its
            # tracing tensors in: once it is done, what remains swapped is the caller's.
            GATE.wait_for_captures()
            training = self._checked()
        if training is None:
            # Swapped in for this call (torch.func.functional_call, stateless
            # reparametrization): eager reads them where they are.
            return self._run_reparametrized(args, kwargs)
        spec = self._find(args, kwargs, training)
        if spec is None:
            with self._lock:  # another thread may have captured it meanwhile
                try:
                    spec = self._find(args, kwargs) or self.specialize(args, kwargs)
                except EagerRaised as exc:  # these inputs are at fault: eager's own error
                    raise exc.original from None
        with GATE.calling():  # no capture runs in another thread meanwhile
            return spec.run(*args, **kwargs)

    def runner_for(self, args: Any = (), kwargs: Mapping[str, Any] | None = None,
                   ) -> Callable[..., Any] | None:
        """A call of the graph now serving ``(args, kwargs)``, for a caller that makes only
        calls whose inputs have the same signature (a decode loop: the same cache tensors,
        inputs of the same sizes, dtypes and layouts): it skips matching the inputs (76 us a
        decode step of 114 inputs) but checks the rest as a call does (the module's state,
        grad mode, autocast, train/eval flags), and where those no longer hold makes the
        full call, which captures again. None where no whole graph serves them."""
        kwargs = dict(kwargs or {})
        self._checked()
        spec = self._find(tuple(args), kwargs)
        if spec is None or spec.signature is None:
            return None
        signature = spec.signature

        def run(*args: Any, **kwargs: Any) -> Any:
            GATE.wait_for_captures()
            training = self._checked()
            if training is None or not any(s is spec for s in self._specializations) or \
                    current_modes(self.module, self._submodules, self._parameters_list,
                                  training) != signature.modes:
                return self(*args, **kwargs)
            with GATE.calling():
                return spec.run(*args, **kwargs)
        return run

    def _checked(self) -> tuple[bool, ...] | None:
        """Drop what the module's state no longer matches (slots, attributes, weights) and
        return the train/eval flags; None where other tensors are swapped into the slots for
        this call only. Run before anything is found or captured: a graph captured during a
        swap would hold copies of the swapped-in tensors, and one traced after an attribute
        changed must be what the snapshot records."""
        # Slots, attributes and train/eval flags are walked only when one of the dicts they
        # live in changed since the last walk found them consistent (one gather of version
        # tags, where the walk costs 0.2 ms on a large model after its run evicted the
        # caches). The token and the flags are kept as one pair: threads may race here.
        tags = self._watch.tags()
        settled = self._settled
        if tags is not None and settled is not None and settled[0] == tags:
            training = settled[1]
        else:
            if self._watch.replaced():
                # Other tensors sit in the module's slots than the graphs hold.
                if not self._watch.reassigned():
                    return None
                self._retrack()  # assigned for good (module.weight = Parameter(...))
            self._check_attributes()
            self._check_hooks()
            training = training_flags(self._submodules)
            self._settled = (tags, training)
        specs = self._specializations
        # Versions, addresses and samples as at the last fingerprint, which every graph
        # matched: nothing stale (the common call, one C loop per signal).
        if (any(s.signature is not None for s in specs) and any(s.stamp is not None for s in specs)
                and not self._watch.unchanged()):
            self._drop_stale_graphs()
        return training

    def _check_attributes(self) -> None:
        specs = self._specializations
        if specs and all(s.signature is None for s in specs):
            return  # Dynamo guards its own, eager reads them live
        if not self._watch.attributes_changed():
            return
        if specs:
            self._drop_graphs(lambda s: s.signature is not None,
                              "a Python attribute of the model changed after capture (a "
                              "graph replays the value it traced): its graphs are "
                              "captured again on their next call")
        # With no graph too: the snapshot must hold what the next capture traces, or a value
        # later put back to the snapshot's would pass for unchanged.
        self._watch.refresh_attributes()

    def _check_hooks(self) -> None:
        """A forward or backward hook registered after capture (on ``fast.module``'s
        submodules, or globally) is one no whole graph runs: those graphs go, and the next
        call captures with the hooks there (Dynamo, which runs them). Read only when some
        dict the watch tags changed."""
        specs = self._specializations
        if not any(s.signature is not None for s in specs):
            return  # Dynamo guards on hooks itself, eager runs them
        if not has_hooks(self.module, ignore=self._capturer.own_hooks):
            return
        self._drop_graphs(lambda s: s.signature is not None,
                          "forward/backward hooks were registered after capture (a whole "
                          "graph runs none): the model is captured again with them, by "
                          "Dynamo, which runs them")

    # --- weights written after capture ----------------------------------------------------

    def _run_reparametrized(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        note = ("parameters or buffers were replaced by other tensors (functional_call, "
                "attribute assignment): calls with them run eagerly")
        if note not in self.report.warnings:
            self.report.warnings.append(note)
        # A train-mode run writes the statistics it may still share with the user's model.
        # (Not inside a torch.func transform: a clone made there is the transform's tensor;
        # torch.func needs BatchNorm without running statistics in train mode anyway.)
        if (any(m.training for m in self._submodules)
                and torch._C._functorch.peek_interpreter_stack() is None):
            self._unshare()
        with GATE.calling():
            return self.module(*args, **kwargs)

    def _drop_graphs(self, which: Callable[[Compiled], bool], note: str) -> None:
        with self._lock:
            self._specializations = [s for s in self._specializations if not which(s)]
            # An attribute or a hook changed: the exported graphs replay the old model too.
            self._rebuildable = []
            if note not in self.report.warnings:
                self.report.warnings.append(note)

    def _take_fingerprint(self) -> None:
        """Fingerprint the tensors some graph holds copies of (not the trainable weights an
        optimizer changes every step, which no graph copies)."""
        seen: dict[int, torch.Tensor] = {}
        for spec in self._specializations:
            for t in spec.watched or ():
                seen.setdefault(id(t), t)
        self._watch.take_fingerprint(list(seen.values()))
        # A graph may be stale already (``specialize`` called directly, after a write): then
        # an unchanged fingerprint says nothing, and each call takes the full check.
        self._watch.fingerprint_clean(all(
            s.stamp == self._watch.stamp(s.watched) for s in self._specializations
            if s.stamp is not None))

    def _drop_stale_graphs(self) -> None:
        rewritten = self._watch.rewritten()
        stale = [s for s in self._specializations if s.stamp is not None and (
            s.stamp != self._watch.stamp(s.watched)
            or (rewritten and any(id(t) in rewritten for t in s.watched or ())))]
        if stale:
            gone = {id(s) for s in stale}
            note = ("parameters or buffers were written after an inference capture (training, "
                    "load_state_dict, in-place or .data edits): graphs whose folded or packed "
                    "constants came from the old values are rebuilt on their next call (the "
                    "passes run again on the exported graph, no new export)")
            with self._lock:
                self._specializations = [s for s in self._specializations
                                         if id(s) not in gone]
                # The exported graph reads the tensors live: only what the passes derived
                # from them is stale. One per signature, the newest.
                keep = [self._capturer.retire(s) for s in stale if s.source is not None]
                self._rebuildable = keep + [
                    s for s in self._rebuildable
                    if not any(s.signature == k.signature for k in keep)
                ][:self._config.max_specializations]
                if note not in self.report.warnings:
                    self.report.warnings.append(note)
        # The graphs left hold for the tensors as they are now (a write to a tensor no graph
        # copied, such as a frozen weight's version bump that a stale graph alone watched).
        with self._lock:
            self._take_fingerprint()

    def _unshare(self) -> None:
        """Give the private module its own copy of the weights it shares with the user's
        model, before anything writes them (a training step, BatchNorm statistics, a load).

        Each tensor keeps its identity and takes new storage holding the same values: an
        optimizer built on ``fast.parameters()`` stays valid, and so do the graphs, which
        hold these tensors. Each also takes a version counter of its own (at the count it
        had, so the graphs' stamps still hold): from now on this module's writes (a forward
        that counts its calls, verification putting buffers back) bump neither the user's
        counters nor those of other optimized modules sharing the user's memory, which
        would take them for edits and capture again."""
        if not self._shares_weights:
            return
        self._shares_weights = False
        # The tensors made to share, not whatever the slots hold now: functional_call may
        # have swapped others in for this call. Under inference_mode a clone would be an
        # inference tensor, which no later call with gradients could save for backward.
        with torch.inference_mode(False), torch.no_grad():
            for t in self._watch.shared:
                _own_memory(t)
        self._watch.shared = []
        self._take_fingerprint()  # new memory, the same values

    def _before_load(self, *args: Any, **kwargs: Any) -> None:
        self._unshare()

    def _weights_loaded(self, module: nn.Module, incompatible: Any) -> None:
        if self._watch.replaced():  # assign=True: graphs holding the old tensors are stale
            self._retrack()
        else:
            self._drop_stale_graphs()  # a load writes in place: stamps see it

    def _retrack(self) -> None:
        """Forget every graph; watch the tensors and attributes the module holds now."""
        with self._lock:
            self._specializations = []
            self._rebuildable = []  # their exported graphs hold the old tensors
            self._submodules = list(self.module.modules())
            self._parameters_list = list(self.module.parameters())
            self._watch.refresh_tensors()
            self._watch.refresh_attributes()

    def _find(self, args: tuple[Any, ...], kwargs: dict[str, Any],
              training: tuple[bool, ...] | None = None) -> Compiled | None:
        modes = current_modes(self.module, self._submodules, self._parameters_list, training)
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
        state["_rebuildable"] = []
        state["_settled"] = None  # the token reads the original's dicts by address
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        # The watch's snapshot was copied with the module, so it names the copied tensors.
        state.setdefault("_rebuildable", [])  # pickled by an autoopt that kept none
        super().__setstate__(state)
        self._lock = threading.RLock()
        self._settled = None  # pickled by an autoopt that kept no token: walk on the first call

    def specialize(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Compiled:
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
            # Verification puts back the buffers it ran through (in place): autoopt's own
            # writes leave every graph that was current, current.
            current = [s for s in self._specializations if s.stamp is not None
                       and s.stamp == self._watch.stamp(s.watched)]
            # What passes may copy into constants: every weight where nothing is
            # differentiated, else those no gradient reaches (buffers, frozen parameters).
            modes = current_modes(self.module, self._submodules, self._parameters_list)
            differentiable = needs_gradients(args, kwargs, modes)
            # A train-mode module's statistics are written by every call and folded by none
            # (a train-mode BatchNorm normalizes with batch statistics): not watched, so a
            # train-mode graph is not captured anew after each of its own calls, as in
            # swa_utils.update_bn, while an eval-mode graph that folded them is.
            written = {id(b) for m in self._submodules if m.training
                       for b in m._buffers.values() if b is not None}
            watched = [t for t in self._watch.tensors if id(t) not in written
                       and not (differentiable and t.requires_grad)]
            from autoopt.observe.progress import (
                reported,  # a first call of new inputs: minutes, said
            )

            with reported("call: capturing new inputs"), GATE.capturing(), \
                    torch.random.fork_rng(devices=sorted(devices)), _own_saved_tensors():
                spec = self._build(args, kwargs, modes, differentiable)
            if self._capturer.kept_state:
                # The probe kept what the forward's first call writes (a cache, a flag), as
                # eager's first call would: the values the graphs were traced with now.
                self._capturer.kept_state = False
                self._watch.refresh_attributes()
            if spec.signature is None:
                self._unshare()  # Dynamo's module or eager: serves any later call, training too
            for other in current:
                other.stamp = self._watch.stamp(other.watched)
            # What the forward writes itself (a call counter, a running mean), the graph
            # writes too and reads live: its own writes do not make it stale.
            own = {id(t) for t in self._capturer.written}
            watched = [t for t in watched if id(t) not in own]
            if spec.run is not self.module and watched:
                spec.watched = watched
                spec.stamp = self._watch.stamp(watched)
            self._specializations.append(spec)
            self._take_fingerprint()
            return spec

    def _build(self, args: tuple[Any, ...], kwargs: dict[str, Any], modes: tuple[Any, ...],
               differentiable: bool) -> Compiled:
        """A stale graph for these inputs rebuilt for the weights as they are, else a
        capture, from an exported graph of these inputs in another grad mode where one is
        kept (no new export)."""
        for stale in self._rebuildable:
            if stale.signature is not None and stale.signature.matches(args, kwargs, modes):
                self._rebuildable = [s for s in self._rebuildable if s is not stale]
                spec = self._capturer.rebuild(stale, *clone_inputs(args, kwargs))
                if spec is not None:
                    return spec
                break
        source = next((s.source for s in reversed([*self._rebuildable,
                                                   *self._specializations])
                       if s.source is not None and s.signature is not None
                       and s.signature.matches_any_grad(args, kwargs, modes)), None)
        if differentiable and not any(m.training for m in self._submodules) and any(
                s.signature is not None and not s.signature.modes[0]
                for s in self._specializations):
            self._say_gradient_graph(source is not None)
        varying = self._varying_sizes(args, kwargs) if source is None else None
        if not varying:
            return self._capturer.capture(*clone_inputs(args, kwargs), source=source)
        return self._capturer.capture(*clone_inputs(args, kwargs), varying=varying)

    def _varying_sizes(self, args: tuple[Any, ...], kwargs: dict[str, Any],
                       ) -> dict[int, dict[int, Any]] | None:
        """Where ``dynamic=`` was left to autoopt (None) and these inputs differ from static
        or dynamic graphs' only in some sizes: those dimensions, and every one an earlier
        graph made dynamic (``autoopt.compile.sizes``), to be captured dynamic. A loop over
        batches or sequence lengths then builds two or three graphs, not one per size. None:
        capture as configured."""
        if self._dynamic is not None or self._dynamic_shapes is not None:
            return None
        earlier = [s.signature for s in [*self._rebuildable, *self._specializations]
                   if s.method == "export" and s.signature is not None]
        return varying_sizes(signature_of(args, kwargs, self.module), earlier) or None

    def _say_gradient_graph(self, reused: bool) -> None:
        """Say why a call on a model in eval mode, captured for inference, builds a graph:
        gradients are enabled (``torch.compile``'s habit: no ``no_grad``), so the graph must
        keep every weight's gradient, where the inference graph folded weights into
        constants. It is a wait of seconds to minutes a user would otherwise not explain."""
        how = ("optimizing the graph already exported for it, no new export" if reused
               else "capturing it anew")
        message = (f"a call with gradients enabled on a model in eval mode: building a graph "
                   f"that computes gradients ({how}). For inference, call under "
                   f"torch.no_grad() or torch.inference_mode(): that runs the inference "
                   f"graph already built, with nothing to build")
        log.warning("autoopt: %s", message)
        if message not in self.report.warnings:
            self.report.warnings.append(message)

    def _eager_beyond_limit(self, args: tuple[Any, ...], kwargs: dict[str, Any],
                            ) -> Compiled:
        limit = self._config.max_specializations
        advice = ("The graphs are dynamic already: other dtypes, flags or grad modes, and "
                  "sizes outside their ranges, each take one; raise max_specializations."
                  if self._dynamic or self._dynamic_shapes is not None else
                  "Pass dynamic=True to let shapes vary in one graph.")
        message = (f"{limit} input signatures captured (max_specializations); new ones run "
                   f"eagerly. {advice}")
        if message not in self.report.warnings:
            self.report.warnings.append(message)
            warnings.warn(f"autoopt: {message}", stacklevel=3)
        return Compiled(signature_of(args, kwargs, self.module), "eager", self.module)


def _own_memory(t: torch.Tensor) -> None:
    """Give ``t`` new memory holding its values, and a version counter of its own, keeping
    the Python object (its identity, attributes and ``requires_grad``).

    ``t.data = copy`` keeps the counter ``t`` shares with the tensor it was detached from.
    A counter cannot be replaced in place, so ``t`` swaps its C++ tensor for a fresh one.
    That is only sound while nothing else holds ``t``'s C++ tensor (a saved autograd graph,
    a gradient accumulator) nor hooks on it: otherwise ``t`` takes new memory and keeps the
    shared counter, as before."""
    version = t._version
    fresh = t.detach().clone()
    swappable = (type(t) in (torch.Tensor, nn.Parameter) and t.is_leaf and t.grad is None
                 and not t._backward_hooks and not t._post_accumulate_grad_hooks
                 and t._use_count() == 1)
    if not swappable:
        t.data = fresh
        return
    fresh = (nn.Parameter(fresh, requires_grad=t.requires_grad) if type(t) is nn.Parameter
             else fresh.requires_grad_(t.requires_grad))
    torch._C._swap_tensor_impl(t, fresh)
    torch._C._autograd._unsafe_set_version_counter((t,), (version,))


def _backend(spec: Compiled) -> str:
    if spec.backend:
        return spec.backend
    if spec.method in ("dynamo", "eager"):
        return spec.method
    if isinstance(spec.run, nn.Module) and not isinstance(spec.run, GraphModule):
        return "eager"  # captured, but no pass changed the graph
    return "cuda_graph" if isinstance(spec.run, cuda_graphs.CudaGraphRunner) else "aten"


def _own_saved_tensors() -> Any:
    """Saved-tensor hooks of capture's own: what its runs (export, the probe, verification)
    save for their backward bypasses the caller's hooks. Inside
    ``torch.utils.checkpoint(fast, ...)`` the first call of a new signature captured under
    checkpoint's hooks, which counted every tensor capture saved (147 against the graph's 21
    in the recompute: a ``CheckpointError`` at backward)."""
    def same(t: torch.Tensor) -> torch.Tensor:
        return t

    if not torch._C._autograd._saved_tensors_hooks_is_enabled():
        return contextlib.nullcontext()  # hooks refused here (pushing one would raise)
    return torch.autograd.graph.saved_tensors_hooks(same, same)

