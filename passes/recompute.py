"""Apply a ``MemoryPlan``: cut the graph into its segments and wrap each by its mode.

    x ─ seg0 ─ seg1 ─ seg2 ─ y    ⟶    x ─ seg0 ─ Recompute(seg1) ─ Offload(seg2) ─ y

A recomputed segment runs under ``torch.utils.checkpoint`` (non-reentrant, RNG state preserved,
so dropout draws the same mask again); a selectively recomputed one too, keeping the results of
its matmuls, convolutions and attention from forward (``create_selective_checkpoint_contexts``)
so only its cheap ops run again. An offloaded segment runs inside saved-tensor hooks that
the caller supplies (``autoopt.offload``); this module knows nothing of streams or host memory.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
    noop_context_fn,
)

from autoopt.cost_model.stages import split_stages

from .memory_plan import KEEP, OFFLOAD, RECOMPUTE, SELECTIVE, MemoryPlan

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

    The run in backward must not repeat the forward's side effects: inputs the segment writes
    in place (BatchNorm running statistics, ``num_batches_tracked``) are put back after it.
    """

    def __init__(self, segment: nn.Module, selective: bool = False) -> None:
        super().__init__()
        self.segment = segment
        self.selective = selective
        self._written = _written_inputs(segment)
        # Normalization layers called as modules (symbolic_trace graphs) own their statistics.
        self._own_stats = [b for m in segment.modules()
                           if isinstance(m, nn.modules.batchnorm._NormBase)
                           and m.track_running_stats for b in m.buffers()]

    def forward(self, *args: Any) -> Any:
        calls = 0

        def run(*inputs: Any) -> Any:
            nonlocal calls
            calls += 1
            if calls == 1 or not (self._written or self._own_stats):
                return self.segment(*inputs)
            written = [inputs[i] for i in self._written if isinstance(inputs[i], torch.Tensor)]
            written += self._own_stats
            saved = [t.detach().clone() for t in written]
            try:
                return self.segment(*inputs)
            finally:
                with torch.no_grad():
                    for tensor, value in zip(written, saved, strict=True):
                        tensor.copy_(value)

        context = _selective_contexts if self.selective else noop_context_fn
        return checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True,
                          context_fn=context, **_CHECKPOINT_OPTIONS)


# Kernels whose results a selective recompute keeps from forward instead of running again
# (matmuls, convolutions, attention: the costly ops); everything else runs again in backward.
_KEEP_RESULTS = frozenset({
    torch.ops.aten.addmm.default, torch.ops.aten.mm.default, torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default, torch.ops.aten.convolution.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
})


def _policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return (CheckpointPolicy.MUST_SAVE if op in _KEEP_RESULTS
            else CheckpointPolicy.PREFER_RECOMPUTE)


def _selective_contexts() -> Any:
    return create_selective_checkpoint_contexts(_policy)


# Ops that update running statistics (arguments 3 and 4) when their ``training`` argument
# (5) is true, though their schema does not say so.
_RUNNING_STATS_OPS = (torch.ops.aten.batch_norm.default, torch.ops.aten.native_batch_norm.default,
                      torch.ops.aten._native_batch_norm_legit.default,
                      torch.ops.aten.instance_norm.default)


def _written_inputs(segment: nn.Module) -> list[int]:
    """Positions of the segment's inputs that an op in it writes in place: what the schema
    marks written, and running statistics a normalization in training mode updates."""
    if not isinstance(segment, GraphModule):
        return []
    placeholders = [n for n in segment.graph.nodes if n.op == "placeholder"]
    written: set[int] = set()
    for node in segment.graph.nodes:
        if node.op != "call_function":
            continue
        targets: list[object] = []
        if node.target in _RUNNING_STATS_OPS and len(node.args) > 5 and node.args[5]:
            targets += node.args[3:5]
        schema = getattr(node.target, "_schema", None)
        if schema is not None and schema.is_mutable:
            for i, argument in enumerate(schema.arguments):
                alias = argument.alias_info
                if alias is not None and alias.is_write:
                    targets.append(node.args[i] if i < len(node.args)
                                   else node.kwargs.get(argument.name))
        written.update(placeholders.index(t) for t in targets if t in placeholders)
    return sorted(written)


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
