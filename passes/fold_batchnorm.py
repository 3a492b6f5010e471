"""Fold an eval-mode BatchNorm into the convolution or linear layer that feeds it.

    x ─ conv ─ bn ─ y      ⟶      x ─ conv' ─ y      (conv' carries bn's scale and shift)

With running statistics BatchNorm is a per-channel affine map, ``y = (z - mean) * s + beta``
with ``s = gamma / sqrt(var + eps)``, so it moves into the producer's weights:
``w' = w * s`` along the output-channel axis and ``b' = (b - mean) * s + beta``.
"""

from __future__ import annotations

import copy
import itertools
import logging
import operator
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule, Node

from . import ops
from .base import PassContext, PassResult
from .graph import add_constant, attr, call_kwargs, constant_tensor, fresh_name, storage_id

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Producer:
    """The conv/linear node a BatchNorm reads, and the tensors the fold rewrites."""

    node: Node
    kind: str  # "conv", "conv_transpose" or "linear"
    weight: torch.Tensor
    bias: torch.Tensor | None
    groups: int
    inputs: tuple[Node, ...]  # the get_attr nodes of weight and bias (empty at module level)


@dataclass(frozen=True)
class _Norm:
    """A BatchNorm node with its statistics; ``outputs`` hold its normalized result."""

    node: Node
    outputs: tuple[Node, ...]  # bn itself, or the getitem(bn, 0) nodes of a tuple variant
    training: bool
    mean: torch.Tensor | None
    var: torch.Tensor | None
    gamma: torch.Tensor | None
    beta: torch.Tensor | None
    eps: float
    inputs: tuple[Node, ...]  # its get_attr nodes (empty at module level)


def fold_batchnorm(gm: GraphModule, ctx: PassContext) -> PassResult:
    """Fold each eval BatchNorm whose input comes straight from a conv or linear layer.

    Works on ``torch.export`` graphs (ATen convolutions, ``linear`` and ``batch_norm``, weights
    as ``get_attr``) and on ``symbolic_trace`` graphs (``nn.Conv*``/``nn.Linear`` then
    ``nn.BatchNorm*`` modules). Existing tensors are never written: the folded weight and bias
    are new tensors, registered on ``gm`` under fresh names.

    Args:
        gm: the graph module, rewritten in place.
        ctx: ``training`` says whether the result will be differentiated; a fold would cut the
            gradients of the weights it replaces, so it is skipped for those that need them.

    Example:
        >>> gm = fold_batchnorm(export_graph(conv_bn.eval(), (x,), {}), PassContext())
    """
    folded = 0
    for node in list(gm.graph.nodes):
        match = _match(gm, node)
        if match is None:
            continue
        producer, norm = match
        reason = _refusal(producer, norm, _consumers(gm), ctx)
        if reason is not None:
            log.debug("not folding %s into %s: %s", norm.node, producer.node, reason)
            continue
        weight, bias = _folded(producer, norm)
        if producer.node.op == "call_module":
            _rewrite_module(gm, producer, weight, bias)
        else:
            _rewrite_function(gm, producer, weight, bias)
        _remove_norm(gm, producer, norm)
        folded += 1
    if folded:
        gm.recompile()
    return PassResult(gm, bool(folded), {"folded_bn": folded} if folded else {})


def _refusal(producer: _Producer, norm: _Norm, consumers: dict[int, list[Node]],
             ctx: PassContext) -> str | None:
    """Why folding this pair would change the function or share state; None when it is safe."""
    weight, bias = producer.weight, producer.bias
    if norm.training or norm.mean is None or norm.var is None:
        return "BatchNorm normalizes with batch statistics (training, or no running stats)"
    if list(producer.node.users) != [norm.node]:
        return "the producer's output has other users, which need the un-normalized value"
    for t in (weight, bias):
        # A tied weight would be duplicated (and its uses would stop sharing it).
        if t is not None and consumers.get(storage_id(t)) != [producer.node]:
            return "the producer's weight or bias is shared with other nodes"
    tensors = [t for t in (weight, bias, norm.mean, norm.var, norm.gamma, norm.beta)
               if t is not None]
    if not all(t.is_floating_point() for t in tensors):
        return "a weight or statistic is not floating point"
    if ctx.training and any(t.requires_grad for t in tensors):
        return "the graph will be differentiated and folding would cut the weights' gradients"
    if producer.kind == "conv_transpose" and producer.groups != 1:
        return "grouped transposed convolution (its weight interleaves groups and channels)"
    channels = weight.shape[1 if producer.kind == "conv_transpose" else 0]
    out = producer.node.meta.get("val")
    if not isinstance(out, torch.Tensor) or out.dim() < 2 or out.shape[1] != channels:
        return "the producer's output channels are not BatchNorm's dim 1 (or not static)"
    # Linear on (N, C, L) and unbatched conv put other dims at 1: BatchNorm's channels differ.
    if out.dim() != (2 if producer.kind == "linear" else weight.dim()):
        return "BatchNorm's channel dim is not the producer's output features"
    per_channel = [t for t in (bias, norm.mean, norm.var, norm.gamma, norm.beta) if t is not None]
    if any(tuple(t.shape) != (channels,) for t in per_channel):
        return "a bias or BatchNorm tensor does not have one entry per channel"
    return None


def _folded(producer: _Producer, norm: _Norm) -> tuple[torch.Tensor, torch.Tensor]:
    """New weight and bias, computed in float64 (one rounding at the end) and cast back."""
    weight = producer.weight
    work = torch.device("cpu") if weight.device.type == "mps" else weight.device  # no f64 on MPS

    def f64(t: torch.Tensor | None, fill: float) -> torch.Tensor:
        if t is None:
            return torch.full((channels,), fill, dtype=torch.float64, device=work)
        return t.detach().to(work, torch.float64)

    axis = 1 if producer.kind == "conv_transpose" else 0
    channels = weight.shape[axis]
    scale = f64(norm.gamma, 1.0) * torch.rsqrt(f64(norm.var, 1.0) + norm.eps)  # (C,)
    shape = [1] * weight.dim()
    shape[axis] = channels
    new_weight = f64(weight, 0.0) * scale.reshape(shape)
    new_bias = (f64(producer.bias, 0.0) - f64(norm.mean, 0.0)) * scale + f64(norm.beta, 0.0)
    bias_dtype = producer.bias.dtype if producer.bias is not None else weight.dtype
    return (new_weight.to(weight.device, weight.dtype),
            new_bias.to(weight.device, bias_dtype))


def _match(gm: GraphModule, node: Node) -> tuple[_Producer, _Norm] | None:
    """The (producer, BatchNorm) pair ending at ``node``, when its shape is one we fold."""
    if node.op == "call_module":
        return _match_module(gm, node)
    # ATen level only: the function path reads BatchNorm's and the producer's arguments by
    # their ATen schema names (`transposed`, the tuple outputs of `native_batch_norm`).
    if node.op == "call_function" and node.target in ops.BATCH_NORM.aten:
        return _match_function(gm, node)
    return None


def _match_function(gm: GraphModule, bn: Node) -> tuple[_Producer, _Norm] | None:
    kw = call_kwargs(bn)
    outputs = _normalized_outputs(bn)
    if kw is None or outputs is None:
        return None
    attrs = {k: kw.get(k) for k in ("weight", "bias", "running_mean", "running_var")}
    if not all(v is None or constant_tensor(gm, v) is not None for v in attrs.values()):
        return None
    values = {k: attr(gm, v) if isinstance(v, Node) else None for k, v in attrs.items()}
    norm = _Norm(bn, outputs, bool(kw.get("training", False)), values["running_mean"],
                 values["running_var"], values["weight"], values["bias"],
                 float(kw.get("eps", 1e-5)), tuple(v for v in attrs.values() if v is not None))
    conv = kw.get("input")
    if not isinstance(conv, Node) or conv.op != "call_function":
        return None
    ckw = call_kwargs(conv)
    if ckw is None:
        return None
    if conv.target in ops.LINEAR.aten:
        kind = "linear"
    elif conv.target in ops.CONV_TRANSPOSE.aten or (
            conv.target in ops.CONV.aten and ckw.get("transposed", False)):
        kind = "conv_transpose"
    elif conv.target in ops.CONV.aten:
        kind = "conv"
    else:
        return None
    w, b = ckw.get("weight"), ckw.get("bias")
    if constant_tensor(gm, w) is None or not (b is None or constant_tensor(gm, b) is not None):
        return None
    producer = _Producer(conv, kind, attr(gm, w), attr(gm, b) if b is not None else None,
                         int(ckw.get("groups", 1)), tuple(n for n in (w, b) if n is not None))
    return producer, norm


def _match_module(gm: GraphModule, bn: Node) -> tuple[_Producer, _Norm] | None:
    module = gm.get_submodule(str(bn.target))
    # Exact types: subclasses (QAT, fused, parametrized modules) compute something else.
    if type(module) not in ops.BATCH_NORM.modules or len(bn.args) != 1 or bn.kwargs:
        return None
    conv = bn.args[0]
    if not isinstance(conv, Node) or conv.op != "call_module":
        return None
    layer = gm.get_submodule(str(conv.target))
    kinds = {**dict.fromkeys(ops.CONV.modules, "conv"), **dict.fromkeys(ops.LINEAR.modules,
             "linear"), **dict.fromkeys(ops.CONV_TRANSPOSE.modules, "conv_transpose")}
    kind = kinds.get(type(layer))
    if kind is None or len(conv.args) != 1 or conv.kwargs:
        return None
    producer = _Producer(conv, kind, layer.weight, layer.bias, getattr(layer, "groups", 1), ())
    norm = _Norm(bn, (bn,), module.training, module.running_mean, module.running_var,
                 module.weight, module.bias, float(module.eps), ())
    return producer, norm


def _normalized_outputs(bn: Node) -> tuple[Node, ...] | None:
    """The nodes holding BatchNorm's output; None when a tuple variant's statistics are read."""
    if bn.target is ops.aten.batch_norm.default:
        return (bn,)
    outputs = []
    for user in bn.users:
        if user.op != "call_function" or user.target is not operator.getitem:
            return None
        if user.args[1] == 0:
            outputs.append(user)
        elif user.users:
            return None
    return tuple(outputs)


def _rewrite_function(gm: GraphModule, producer: _Producer, weight: torch.Tensor,
                      bias: torch.Tensor) -> None:
    """Point the conv's weight and bias at new ``get_attr`` nodes (adding a bias if it had
    none); the old attributes stay untouched for anyone else holding them."""
    conv = producer.node
    with gm.graph.inserting_before(conv):
        new_weight = add_constant(gm, "folded_bn_weight", weight)
        new_bias = add_constant(gm, "folded_bn_bias", bias)
    _set_arg(conv, 1, "weight", new_weight)
    _set_arg(conv, 2, "bias", new_bias)


def _rewrite_module(gm: GraphModule, producer: _Producer, weight: torch.Tensor,
                    bias: torch.Tensor) -> None:
    """Call a copy of the conv module that holds the folded tensors; the original module is
    shared with the user's model and is left as it was."""
    conv = producer.node
    layer = gm.get_submodule(str(conv.target))
    # Share every tensor instead of copying it; only weight and bias are then replaced.
    memo: dict[int, Any] = {id(t): t for t in itertools.chain(layer.parameters(), layer.buffers())}
    new = copy.deepcopy(layer, memo)
    new.weight = nn.Parameter(weight, requires_grad=False)
    new.bias = nn.Parameter(bias, requires_grad=False)
    name = fresh_name(gm, "folded_bn_" + str(conv.target).replace(".", "_"))
    gm.add_submodule(name, new)
    conv.target = name


def _remove_norm(gm: GraphModule, producer: _Producer, norm: _Norm) -> None:
    """Route BatchNorm's readers to the producer and erase what only BatchNorm needed."""
    conv = producer.node
    for out in norm.outputs:
        for key in ("val", "tensor_meta"):  # conv now yields what bn did
            if key in out.meta:
                conv.meta[key] = out.meta[key]
        out.replace_all_uses_with(conv)
    for user in list(norm.node.users):  # the unused getitems of a tuple variant
        gm.graph.erase_node(user)
    gm.graph.erase_node(norm.node)
    for attr_node in {*producer.inputs, *norm.inputs}:
        if not attr_node.users:
            gm.graph.erase_node(attr_node)


def _consumers(gm: GraphModule) -> dict[int, list[Node]]:
    """Storage -> the nodes that read it (a get_attr's users, or the module owning it), so a
    tensor reached through two names or two calls shows up as shared."""
    consumers: dict[int, list[Node]] = defaultdict(list)
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = attr(gm, str(node.target))
            if isinstance(value, torch.Tensor):
                consumers[storage_id(value)].extend(node.users)
        elif node.op == "call_module":
            module = gm.get_submodule(str(node.target))
            for t in itertools.chain(module.parameters(), module.buffers()):
                consumers[storage_id(t)].append(node)
    return consumers








def _set_arg(node: Node, index: int, name: str, value: Node) -> None:
    """Set an argument given by position or keyword (or absent, left to its default)."""
    if name in node.kwargs:
        node.update_kwarg(name, value)
    elif index < len(node.args):
        node.update_arg(index, value)
    elif index == len(node.args):
        node.args = (*node.args, value)
    else:
        node.update_kwarg(name, value)
