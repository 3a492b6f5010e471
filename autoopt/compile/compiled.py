"""What a capture produces: ``Compiled`` (what to run and the inputs it serves) and ``Source``
(the exported graph it was optimized from, to build it again without exporting), and
``EagerRaised``, the model's own error on the inputs being captured."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule

from autoopt.check.report import CaptureRecord
from autoopt.compile.guards import InputSignature
from autoopt.errors import ModelError


class EagerRaised(ModelError):
    """The model itself raised, run eagerly on the inputs being captured (``original``).

    For the example inputs ``autoopt.optimize`` says so; for a later call the module raises
    ``original``, the error eager raises for that call (a ``RuntimeError`` for a shape
    mismatch), not an autoopt error about the example."""

    def __init__(self, original: Exception) -> None:
        super().__init__(f"the model raised {type(original).__name__} when run eagerly on "
                         f"these inputs: {original}")
        self.original = original


@dataclass
class Compiled:
    """A compiled form of the model and the inputs it may be called with (None: any)."""

    signature: InputSignature | None
    method: str
    run: Callable[..., Any]
    graph: GraphModule | None = None  # the optimized whole graph ``run`` executes, if one
    # The weights' stamp (``ModuleWatch.stamp`` over ``watched``) its constants were computed
    # at: folded BatchNorms, merged and packed weights are copies, so the graph is stale once
    # one of them is written. None: reads them all live.
    stamp: int | None = None
    # The tensors a pass may have copied into the graph: all of them for an inference
    # capture, those no gradient reaches (buffers, frozen parameters) for one with gradients.
    watched: list[torch.Tensor] | None = None
    # The backend that runs it, when not ``aten`` (``inductor``, ``onnxruntime``).
    backend: str = ""
    # The exported graph it was optimized from, to build it again without exporting.
    source: Source | None = None


@dataclass
class Source:
    """An exported graph as ``torch.export`` gave it, before the passes, kept to build from
    again without exporting: for new weights (what the passes derived from them, folded
    BatchNorms, merged and packed copies, is stale; the graph is not, it reads the module's
    tensors live) or for another grad mode (its ops are differentiable either way).

    Args:
        graph: the exported graph (never modified: the passes work on copies).
        record: the report's record of the capture that exported it.
        written: the module's tensors the forward writes itself (``Capturer.written``).
    """

    graph: GraphModule
    record: CaptureRecord
    written: list[torch.Tensor]


def model_device(model: nn.Module) -> torch.device | None:
    """The device of the model's first parameter or buffer; None where it holds none."""
    for t in list(model.parameters()) + list(model.buffers()):
        return t.device
    return None
