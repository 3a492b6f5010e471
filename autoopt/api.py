"""``autoopt.optimize``: the one call users make.

A thin facade over the core (``autoopt.module.build``, ``autoopt.module.optimized``): it
builds the optimized module, then hands it on to the features layered on top — the pipeline
package for ``devices=``, the HTML report for ``report=``, ``generate`` for language models
(``autoopt.generation.generator``'s module class). The core imports none of them, so no
feature imports the core back through here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from autoopt.diagnose.collect import collect
from autoopt.diagnose.render import write_report
from autoopt.generation.generator import defers_forward, module_class
from autoopt.module.build import capture_example, check_inputs, defer_example, prepare, unwrap
from autoopt.module.optimized import OptimizedModule, Specialization
from autoopt.observe import progress
from autoopt.options.config import OptimizeConfig
from autoopt.parallel.planning import pipeline_module

__all__ = ["OptimizedModule", "Specialization", "check_inputs", "optimize"]


def optimize(model: nn.Module, example_inputs: Any = (), example_kwargs: Mapping[str, Any] | None
             = None, *, device: str | torch.device | None = None,
             config: OptimizeConfig | Mapping[str, Any] | None = None,
             dynamic: bool | None = None,
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
        dynamic: True: let every dimension vary where the model allows (batch, sequence
            length), from the first graph. None (the default): each input signature's first
            graph has static sizes, and a call that differs from a graph's inputs only in
            some sizes is captured with those dimensions dynamic (one graph for every later
            size there, as ``torch.compile`` does). False: every size is its own graph.
        dynamic_shapes: ``torch.export``-style per-input dynamic dimensions; wins over dynamic.
        training: whether the example call is a training step (default: ``model.training``).
            An inference call is captured under ``torch.no_grad()``, where passes may fold
            parameters into constants; a later call with gradients enabled is captured anew,
            with every parameter's gradient kept.
        **options: ``OptimizeConfig`` fields, e.g. ``verify=False``, ``disable=["dead_code"]``.
            With ``devices=[...]`` (and ``microbatches=``) the result is instead an
            ``autoopt.Pipeline``: one stage per device, run over microbatches.

    Example:
        >>> fast = autoopt.optimize(torchvision.models.resnet18().eval(), (x,))
        >>> print(fast.report)
    """
    cfg = OptimizeConfig.build(config, options)
    with progress.reported("optimize"):
        optimized, args, kwargs, training = prepare(model, example_inputs, example_kwargs, cfg,
                                                    device=device, dynamic=dynamic,
                                                    dynamic_shapes=dynamic_shapes,
                                                    training=training,
                                                    module_class=module_class(unwrap(model)))
        if cfg.devices is not None:  # a pipeline of one stage per device (autoopt.parallel)
            return pipeline_module(optimized, args, kwargs,  # type: ignore[return-value]
                                   training)
        if defers_forward(optimized, training):  # generate builds the graphs it runs
            defer_example(optimized, args, kwargs)
        else:
            capture_example(optimized, args, kwargs, training)
        if cfg.report is not None:  # report=: diagnose and time both modules, write the HTML
            write_report(cfg.report, collect(unwrap(model), args, kwargs,
                                             optimized=optimized, training=training))
    return optimized
