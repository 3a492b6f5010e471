"""The local pipeline runtime: stages on their devices in one process, run over microbatches.

``Pipeline`` runs the stages (``autoopt.parallel.stages``) across devices, each call split into
microbatches: GPipe order for inference and ``forward`` + ``backward``, GPipe or 1F1B
(``autoopt.parallel.schedules``) for ``train_step``. On CUDA each stage has a compute stream and
a copy stream, so the copy of microbatch m+1's input overlaps stage compute of microbatch m.
``torch.distributed.pipelining`` runs the same stages across processes
(``autoopt.parallel.distributed``).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule
from torch.fx._pytree import tree_flatten_spec
from torch.utils import _pytree as pytree

from autoopt.errors import ConfigError, InputError
from autoopt.parallel.microbatches import (
    check_mergeable_outputs,
    merge_microbatches,
    split_microbatches,
)
from autoopt.parallel.partition import Partition
from autoopt.parallel.schedules import gpipe_order, one_f_one_b_order
from autoopt.parallel.stages import emit_stages, place_stage, shared_parameters, traced_values

_INFERENCE_ONLY = (
    "this pipeline was optimized for inference (an eval-mode model, training=False): its "
    "stages fold weights into constants and run kernels without a backward, so gradients "
    "through it would reach only the weights left unfolded. Optimize with training=True to "
    "train through the pipeline, or call it without gradients (torch.no_grad()).")


class Pipeline(nn.Module):
    """Stages on their devices, run as a pipeline over microbatches.

    ``forward`` runs every microbatch through the stages in GPipe order and returns the
    merged output (differentiable end to end: ``loss.backward()`` then gives the unsplit
    model's gradients, up to the floating-point order of summation). ``train_step`` runs
    forward and backward per stage in GPipe or 1F1B order with a per-microbatch loss.

    Args:
        stages: from ``emit_stages``; moved to their devices (copied first where a parameter
            lives elsewhere, so the caller's graph keeps its own).
        devices: one per stage.
        microbatches: microbatches per call.
        plan: the partition the stages come from (shown by ``table``).
        in_spec, out_spec: the pytree structure of the original call and result (from the
            exported graph); None: positional tensors in, a flat tuple out.
    """

    def __init__(self, stages: Sequence[GraphModule], devices: Sequence[str | torch.device],
                 microbatches: int = 1, plan: Partition | None = None,
                 in_spec: pytree.TreeSpec | None = None,
                 out_spec: pytree.TreeSpec | None = None) -> None:
        super().__init__()
        self.devices = [torch.device(d) for d in devices]
        self.stages = nn.ModuleList(_share_tied_weights(
            stages, [place_stage(stage, device)
                     for stage, device in zip(stages, self.devices, strict=True)], self.devices))
        self.microbatches = microbatches
        self.plan = plan
        check_mergeable_outputs(traced_values(stages[0], "placeholder"),
                                traced_values(stages[-1], "output"), microbatches, out_spec)
        self._in_spec = in_spec
        self._out_spec = out_spec
        self._streams = _Streams(self.devices)
        # Set by ``optimize(..., training=False)``: stages captured for inference, with
        # weights folded into constants and kernels that have no backward.
        self.inference_only = False
        # Set by ``optimize``: the train/eval mode the stages' graphs were captured in (they
        # bake it: dropout, batch statistics). None: stages made by hand, mode not known.
        self.captured_training: bool | None = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._check_mode()
        if self.inference_only and torch.is_grad_enabled():
            if any(isinstance(x, torch.Tensor) and x.requires_grad
                   for x in pytree.tree_leaves((args, kwargs))):
                raise ConfigError(_INFERENCE_ONLY)
            # Its outputs carry no gradient (a backward raises), where a partial one (the
            # few weights left unfolded) would silently train the last layers alone.
            with torch.no_grad():
                return self._run(args, kwargs)
        return self._run(args, kwargs)

    def _check_mode(self) -> None:
        if self.captured_training is not None and self.training != self.captured_training:
            raise ConfigError(
                f"this pipeline's stages were captured in "
                f"{'train' if self.captured_training else 'eval'} mode and run that way (the "
                f"mode is part of their graphs: dropout, batch statistics), but it is now in "
                f"{'train' if self.training else 'eval'} mode. Put it back with "
                f".train({self.captured_training}), or optimize the model again in the mode "
                f"you want (training={self.training}).")

    def _run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        micro = split_microbatches(self._flatten(args, kwargs), self.microbatches)
        self._check_shapes(micro[0])
        for _, s, m in gpipe_order(len(self.stages), self.microbatches, backward=False):
            moved = self._streams.move(s, m, micro[m])
            with self._streams.compute(s):
                micro[m] = list(self.stages[s](*moved))
                self._streams.done(s, m)
        self._streams.synchronize()
        merged = merge_microbatches(micro)
        for x in merged:  # made on a stage's stream, used on the caller's from here on
            if isinstance(x, torch.Tensor) and x.is_cuda:
                x.record_stream(torch.cuda.current_stream(x.device))
        return self._unflatten(merged)

    def train_step(self, args: tuple[Any, ...], target: torch.Tensor,
                   loss_fn: Callable[[Any, torch.Tensor], torch.Tensor], *,
                   kwargs: dict[str, Any] | None = None, schedule: str = "1f1b",
                   scale_grads: bool = True) -> torch.Tensor:
        """Forward and backward over microbatches in ``schedule`` order (``gpipe``, ``1f1b``);
        gradients accumulate in the stages' parameters. Returns the summed loss (divided by
        the microbatch count when ``scale_grads``, as for a mean-reduced loss)."""
        self._check_mode()
        if schedule not in ("gpipe", "1f1b"):
            raise ConfigError(f"schedule must be 'gpipe' or '1f1b'; got {schedule!r}")
        if self.inference_only:
            raise ConfigError(_INFERENCE_ONLY)
        k, n = len(self.stages), self.microbatches
        micro_in = split_microbatches(self._flatten(args, kwargs or {}), n)
        self._check_shapes(micro_in[0])
        targets = split_microbatches([target], n)
        scale = 1.0 / n if scale_grads else 1.0
        saved: dict[tuple[int, int], tuple[list[Any], list[Any]]] = {}
        carry: dict[tuple[int, int], list[Any]] = {(0, m): micro_in[m] for m in range(n)}
        grads: dict[tuple[int, int], list[Any]] = {}
        total = torch.zeros(())
        order = gpipe_order(k, n) if schedule == "gpipe" else one_f_one_b_order(k, n)
        for kind, s, m in order:
            if kind == "F":
                inputs = self._to_stage(s, carry.pop((s, m)), detach=s > 0)
                outputs = list(self.stages[s](*inputs))
                saved[(s, m)] = (inputs, outputs)
                if s < k - 1:
                    carry[(s + 1, m)] = outputs
                continue
            inputs, outputs = saved.pop((s, m))
            if s == k - 1:
                loss = loss_fn(self._unflatten(outputs), targets[m][0].to(self.devices[s]))
                total = total + loss.detach().cpu()
                (loss * scale).backward()
            else:
                pairs = [(o, g) for o, g in zip(outputs, grads.pop((s, m)), strict=True)
                         if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
                if pairs:
                    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            if s > 0:
                grads[(s - 1, m)] = [x.grad.to(self.devices[s - 1])
                                     if isinstance(x, torch.Tensor) and x.grad is not None
                                     else None for x in inputs]
        self._streams.synchronize()
        return total * scale

    def table(self) -> str:
        return self.plan.table() if self.plan is not None else f"{len(self.stages)} stages"

    def named_stage_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """Every stage's parameters under their names in the original model."""
        for stage in self.stages:
            yield from stage.named_parameters()

    # --- running one stage -----------------------------------------------------------------

    def _to_stage(self, s: int, values: list[Any], detach: bool) -> list[Any]:
        """``values`` on stage ``s``'s device (plain copies on the current streams); with
        ``detach`` as new leaves that collect their gradient (where a per-stage backward
        stops)."""
        device = self.devices[s]
        moved = [x.to(device) if isinstance(x, torch.Tensor) else x for x in values]
        if not detach:
            return moved
        return [x.detach().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor)
                else x for x in moved]

    def _check_shapes(self, flat: list[Any]) -> None:
        """The stages were captured for one microbatch's shapes; others would fail inside."""
        expected = [n.meta.get("val") for n in self.stages[0].graph.nodes
                    if n.op == "placeholder"]
        for i, (value, meta) in enumerate(zip(flat, expected, strict=False)):
            if isinstance(value, torch.Tensor) and isinstance(meta, torch.Tensor) and \
                    tuple(value.shape) != tuple(meta.shape):
                raise InputError(f"input {i} splits into microbatches of shape "
                                 f"{tuple(value.shape)}, but the pipeline was built for "
                                 f"{tuple(meta.shape)} ({self.microbatches} microbatches); "
                                 f"call it with the example's batch size or build another.")

    def _flatten(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        if self._in_spec is None:
            return list(args)
        try:
            return list(tree_flatten_spec((tuple(args), dict(kwargs)), self._in_spec))
        except Exception as exc:
            raise InputError(f"the pipeline was built for calls shaped like {self._in_spec}; "
                             f"this call does not match ({exc}).") from exc

    def _unflatten(self, flat: Sequence[Any]) -> Any:
        if self._out_spec is None:
            return tuple(flat)
        return pytree.tree_unflatten(list(flat), self._out_spec)


def _share_tied_weights(stages: Sequence[GraphModule], placed: list[GraphModule],
                        devices: Sequence[torch.device]) -> list[GraphModule]:
    """``placed`` with every weight that several stages read held once again.

    Placing a stage on another device copies its weights, so a weight two stages share (an
    embedding tied to the LM head) became two that train apart. The first stage reading it
    keeps it; each later one reads it through a ``.to(device)`` in its graph, so autograd
    sums both stages' gradients into the one parameter.
    """
    for name, holders in shared_parameters(stages):
        original = stages[holders[0]].get_parameter(name)
        owner = placed[holders[0]].get_parameter(name)
        for s in holders[1:]:
            names = [n for n, p in stages[s].named_parameters(remove_duplicate=False)
                     if p is original]
            if all(placed[s].get_parameter(n) is owner for n in names):
                continue
            if placed[s] is stages[s]:  # the caller's stage keeps its own graph
                placed[s] = copy.deepcopy(stages[s])
            stage = placed[s]
            for n in names:
                prefix, _, leaf = n.rpartition(".")
                stage.get_submodule(prefix).register_parameter(leaf, owner)
            for node in list(stage.graph.nodes):
                if node.op == "get_attr" and str(node.target) in names:
                    with stage.graph.inserting_after(node):
                        moved = stage.graph.call_method("to", (node, devices[s]))
                    node.replace_all_uses_with(moved, delete_user_cb=lambda u, m=moved: u is not m)
                    moved.meta = dict(node.meta)
            stage.recompile()
    return placed


class _Streams:
    """Per-stage CUDA compute and copy streams; plain synchronous copies elsewhere."""

    def __init__(self, devices: Sequence[torch.device]) -> None:
        self.devices = list(devices)
        cuda = [d.type == "cuda" for d in devices]
        self.compute_streams = [torch.cuda.Stream(d) if c else None
                                for d, c in zip(devices, cuda, strict=True)]
        self.copy_streams = [torch.cuda.Stream(d) if c else None
                             for d, c in zip(devices, cuda, strict=True)]
        self.events: dict[tuple[int, int], Any] = {}  # (stage, microbatch) -> its outputs'

    def move(self, s: int, m: int, values: list[Any]) -> list[Any]:
        """Microbatch ``m``'s inputs on stage ``s``'s device."""
        device, stream = self.devices[s], self.copy_streams[s]
        previous = self.events.pop((s - 1, m), None)
        if stream is None:
            if previous is not None:  # a GPU stage's outputs: wait until they are written
                previous.synchronize()
            return [x.to(device) if isinstance(x, torch.Tensor) else x for x in values]
        # The copy waits for the producing stage's compute of this microbatch (or, for the
        # caller's inputs, the streams that made them), then runs beside this stage's compute
        # of the microbatch before; the compute stream waits for the copy.
        callers = {x.device: torch.cuda.current_stream(x.device) for x in values
                   if isinstance(x, torch.Tensor) and x.is_cuda}
        with torch.cuda.stream(stream):
            if previous is not None:
                stream.wait_event(previous)
            else:
                for caller in callers.values():
                    stream.wait_stream(caller)
            moved = []
            for x in values:
                if isinstance(x, torch.Tensor):
                    y = x.to(device, non_blocking=True)
                    if x.is_cuda:
                        x.record_stream(stream)
                    y.record_stream(self.compute_streams[s])
                    moved.append(y)
                else:
                    moved.append(x)
        self.compute_streams[s].wait_stream(stream)
        return moved

    def compute(self, s: int) -> Any:
        stream = self.compute_streams[s]
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def done(self, s: int, m: int) -> None:
        if self.compute_streams[s] is not None:
            self.events[(s, m)] = self.compute_streams[s].record_event()

    def synchronize(self) -> None:
        self.events.clear()
        for stream in self.compute_streams:
            if stream is not None:
                stream.synchronize()


def pipeline_from_graph(gm: GraphModule, plan: Partition, microbatches: int = 1) -> Pipeline:
    """The local pipeline of ``gm`` cut as ``plan`` says, on the plan's devices."""
    info = getattr(gm.graph._codegen, "pytree_info", None)
    return Pipeline(emit_stages(gm, plan), [s.device for s in plan.stages], microbatches, plan,
                    info.in_spec if info else None, info.out_spec if info else None)
