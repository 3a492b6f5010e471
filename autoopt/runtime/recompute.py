"""Apply a ``MemoryPlan``: cut the graph into its segments and wrap each by its mode.

    x ─ seg0 ─ seg1 ─ seg2 ─ y    ⟶    x ─ seg0 ─ Recompute(seg1) ─ Offload(seg2) ─ y

A recomputed segment runs under ``torch.utils.checkpoint`` (non-reentrant, RNG state preserved,
so dropout draws the same mask again); a selectively recomputed one too, keeping the results of
its matmuls, convolutions and attention from forward (``create_selective_checkpoint_contexts``)
so only its cheap ops run again. An offloaded segment runs inside saved-tensor hooks that
the caller supplies (``autoopt.runtime.offload``); this module knows nothing of streams or
host memory.
"""

from __future__ import annotations

import copy
import inspect
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils.checkpoint as checkpoint_module
from torch import nn
from torch.fx import GraphModule
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
    noop_context_fn,
)

from autoopt.cost_model.isolation import written_placeholders
from autoopt.cost_model.stages import split_stages
from autoopt.passes import ops
from autoopt.planning.memory_plan import MemoryPlan
from autoopt.planning.segments import KEEP, OFFLOAD, RECOMPUTE, SELECTIVE

OffloadWrap = Callable[[nn.Module, int], nn.Module]

# The results a selective recompute keeps go through enclosing saved-tensor hooks like any
# saved tensor (so hooks that count or offload saved tensors see them). PyTorch before 2.12
# has no such option (it would pass it on to the segment): there the kept results stay in
# the checkpoint's own storage, held on the device, unseen by enclosing hooks.
_CHECKPOINT_OPTIONS = ({"respect_saved_tensors_hooks": True}
                       if "respect_saved_tensors_hooks" in inspect.signature(checkpoint).parameters
                       else {})


class Recompute(nn.Module):
    """Runs ``segment`` keeping only its inputs for backward; it runs again in backward.

    State the segment writes in place (BatchNorm running statistics, ``num_batches_tracked``,
    a counter buffer) is updated once per forward, as in eager: the run in backward works on
    a copy of that state as the forward found it, so it computes what the forward computed
    and writes nothing of the module's. The state is not handed to ``checkpoint`` either,
    which would save it for backward and then find it written by the forward.
    """

    def __init__(self, segment: nn.Module, selective: bool = False) -> None:
        super().__init__()
        self.segment = segment
        self.selective = selective
        self._written = written_placeholders(segment)
        # Normalization layers called as modules (symbolic_trace graphs) own their statistics.
        self._own_stats = [(m, name) for m in segment.modules()
                           if isinstance(m, nn.modules.batchnorm._NormBase)
                           and m.track_running_stats
                           for name, b in m.named_buffers(recurse=False) if b is not None]

    def forward(self, *args: Any) -> Any:
        state = {i: args[i] for i in self._written if isinstance(args[i], torch.Tensor)}
        if not torch.is_grad_enabled() or not (state or self._own_stats):
            return self._checkpoint(self.segment, args)
        # Taken before the forward writes them: what the rerun must start from. State is
        # small (statistics, counters) next to the activations a recompute frees; an
        # activation the segment writes in place (a ReLU(inplace=True) on its input, as in
        # a ResNet block) is its input, which a recompute keeps anyway. That copy requires
        # grad as the activation does: the rerun must record the graph the forward did (it
        # saves the same tensors, which checkpoint counts), while gradients still reach the
        # activation through the forward's own graph.
        before = {i: t.detach().clone().requires_grad_(t.requires_grad)
                  for i, t in state.items()}
        own_before = [(m, name, m._buffers[name].detach().clone())  # type: ignore[union-attr]
                      for m, name in self._own_stats]
        rest = [a for i, a in enumerate(args) if i not in state]
        calls = 0

        def run(*inputs: Any) -> Any:
            nonlocal calls
            calls += 1
            values = iter(inputs)
            if calls == 1:
                full = [state[i] if i in state else next(values) for i in range(len(args))]
                return self.segment(*full)
            # A rerun in backward (one per backward pass, with retain_graph): fresh copies,
            # so each rerun starts from the forward's state and the module's stays as is.
            full = [before[i].clone() if i in before else next(values)
                    for i in range(len(args))]
            swapped = [(m, name, m._buffers[name]) for m, name, _ in own_before]
            for m, name, value in own_before:
                m._buffers[name] = value.clone()
            try:
                return self.segment(*full)
            finally:
                for m, name, value in swapped:
                    m._buffers[name] = value

        return self._checkpoint(run, rest)

    def _checkpoint(self, fn: Callable[..., Any], args: Sequence[Any]) -> Any:
        context = _selective_contexts if self.selective else noop_context_fn
        return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True,
                          context_fn=context, **_CHECKPOINT_OPTIONS)


# Kernels whose results a selective recompute keeps from forward instead of running again
# (matmuls, convolutions, attention: the costly ops, as autograd records them); everything else
# runs again in backward.
_KEEP_RESULTS = ops.COSTLY_KERNELS.aten


def _policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return (CheckpointPolicy.MUST_SAVE if op in _KEEP_RESULTS
            else CheckpointPolicy.PREFER_RECOMPUTE)


# PyTorch's selective checkpoint drops each kept result once a rerun has read it, marking the
# entry with this sentinel; a second rerun of the segment (``retain_graph=True``, a double
# backward such as a gradient penalty) then fails with "Trying to backward an extra time".
# Where the marker is known the results are kept instead, until autograd frees the segment's
# graph (which a plan already prices: a selective segment's kept results are counted alive
# through its backward). Where it is not, selective recompute supports one backward only.
_CONSUMED = getattr(checkpoint_module, "_CONSUMED", None)
SELECTIVE_BACKWARD_TWICE = _CONSUMED is not None


class _KeptResults(dict):  # type: ignore[type-arg]
    """One op's kept results, by call index; reading one does not drop it."""

    def __setitem__(self, key: Any, value: Any) -> None:
        if value is _CONSUMED and key in self:
            return
        super().__setitem__(key, value)


def _selective_contexts() -> Any:
    forward, rerun = create_selective_checkpoint_contexts(_policy)
    if SELECTIVE_BACKWARD_TWICE and getattr(forward, "storage", None) is not None \
            and forward.storage is getattr(rerun, "storage", None):
        forward.storage = rerun.storage = defaultdict(_KeptResults)
    return forward, rerun


def apply_plan(gm: GraphModule, plan: MemoryPlan, offload: OffloadWrap | None = None,
               ) -> GraphModule:
    """A module computing what ``gm`` computes, its segments kept, offloaded or recomputed.

    Args:
        gm: the graph the plan was made for (not modified).
        plan: one mode per segment.
        offload: wraps a segment module (and its index) so its saved tensors go to the host;
            required when the plan offloads.

    Raises:
        ValueError: the plan names nodes ``gm`` lacks, or offloads without ``offload``.
    """
    if OFFLOAD in plan.modes and offload is None:
        raise ValueError("the plan offloads segments but no offload runtime was given")
    nodes = {n.name: n for n in gm.graph.nodes}
    missing = [name for seg in plan.segments for name in seg.nodes if name not in nodes]
    if missing:
        raise ValueError(f"the plan was made for another graph: no node {missing[0]!r}")
    if all(mode == KEEP for mode in plan.modes):
        return gm
    groups = [[nodes[name] for name in seg.nodes] for seg in plan.segments]
    split = split_stages(gm, groups)
    # Keep gm's calling convention (export's pytree inputs and outputs) on the split module.
    split.graph._codegen = copy.deepcopy(gm.graph._codegen)
    split.recompile()
    # split_module numbers its submodules by segment and drops empty ones: map by order.
    names = [n.target for n in split.graph.nodes
             if n.op == "call_module" and str(n.target).startswith("submod_")]
    for name, mode, seg in zip(names, plan.modes, plan.segments, strict=True):
        if not seg.permits(mode):
            raise ValueError(f"{seg.describe()} writes module state; it cannot be {mode}")
        index = seg.index
        segment = getattr(split, str(name))
        if mode in (RECOMPUTE, SELECTIVE):
            setattr(split, str(name), Recompute(segment, selective=mode == SELECTIVE))
        elif mode == OFFLOAD:
            assert offload is not None
            setattr(split, str(name), offload(segment, index))
    return split
