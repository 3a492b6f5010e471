"""The forward transformers' ``generate`` calls in ``fast.generate`` (``Stepper``): each step
through autoopt's step graph where the cache is allocated, the model's own forward where not;
the steps after a call's first decode step on the route bound to its cache
(``autoopt.generation.bound``). And what a call ran (``GenerationStats``)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from autoopt.capture import objects
from autoopt.generation.bound import BoundStep
from autoopt.generation.cache import allocated, caches, count_tokens, slides
from autoopt.generation.call import batch, tokens


@dataclass
class GenerationStats:
    """What the last ``generate`` call ran: steps through autoopt's graphs and eagerly."""

    graph_steps: int = 0
    eager_steps: int = 0
    seconds: float = 0.0
    cache_type: str = ""
    note: str = ""

    def __str__(self) -> str:
        text = (f"generate: {self.graph_steps} step(s) through autoopt graphs, "
                f"{self.eager_steps} eager, {self.seconds:.2f} s")
        return text + (f" ({self.note})" if self.note else "")


class RunEagerly(Exception):  # noqa: N818 (a signal, not an error)
    """Raised by the call's first step where autoopt's graphs cannot serve the call: nothing
    has run yet, so ``Generator.generate`` runs the whole call eagerly instead."""


class Stepper:
    """The forward ``generate`` calls: autoopt's graph where the cache is allocated, the
    model's own forward where not (the step that allocates it); every step eagerly with
    ``eager_only``."""

    def __init__(self, optimized: Any, model: nn.Module, stats: GenerationStats,
                 eager_only: bool = False) -> None:
        self._optimized = optimized
        # The model's own call, hooks and all: the driver's call runs none (see
        # ``Generator._run``), so each step runs them once, here or inside the step graph.
        self._eager = model
        self._stats = stats
        self._eager_only = eager_only
        # generate reads the forward's signature to decide what to pass (position ids, which
        # logits to keep): it must see the model's own.
        self.__signature__ = inspect.signature(model.forward)
        self._last: tuple[Any, ...] | None = None
        self._bound: BoundStep | None = None  # this call's decode step, once it ran

    def _flat(self, cache: Any) -> tuple[list[Any], pytree.TreeSpec, str]:
        """The cache's tensors, structure and the structure's text (part of a step graph's
        key), taken apart once per cache object (a static cache keeps its tensors from step
        to step; ~0.6 ms a step otherwise, and 0.1 ms to write the structure out)."""
        keys = [layer.keys for c in caches(cache) for layer in c.layers]
        if self._last is None or self._last[0] is not cache or any(
                a is not b for a, b in zip(self._last[1], keys, strict=True)):
            tensors, spec = objects.flatten(cache)
            self._last = (cache, keys, tensors, spec, str(spec))
        return self._last[2], self._last[3], self._last[4]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from transformers.cache_utils import Cache

        if self._eager_only:
            self._stats.eager_steps += 1
            return self._eager(*args, **kwargs)
        bound = self._bound
        if bound is not None and not args:
            inputs = bound.inputs_of(kwargs)
            if inputs is not None:
                logits = bound.run(bound.tensors, **inputs)
                count_tokens(bound.cache, 1)
                self._stats.graph_steps += 1
                return Output(logits=logits, cache=bound.cache, past_key_values=bound.cache)
        first = not (self._stats.graph_steps or self._stats.eager_steps)
        found = [(k, v) for k, v in kwargs.items() if isinstance(v, Cache)]
        # The graph returns the logits alone.
        extra = [k for k in ("output_hidden_states", "output_attentions") if kwargs.get(k)]
        if extra and first:
            raise RunEagerly(f"{'/'.join(extra)}=True: the step graphs return the logits "
                              f"alone")
        if found and first and slides(found[0][1]):
            raise RunEagerly("a sliding-window cache layer fills its window in this call "
                              "(it keeps its length in a Python int, which a graph would "
                              "replay)")
        if args or len(found) != 1 or extra:
            self._stats.eager_steps += 1
            return self._eager(*args, **kwargs)
        name, cache = found[0]
        self._stats.cache_type = type(cache).__name__
        if not allocated(cache):  # as the first call's cache was, if known
            self._optimized.allocate(cache, batch(kwargs))
        if not allocated(cache):
            self._stats.eager_steps += 1
            out = self._eager(*args, **kwargs)
            self._optimized.remember_layout(cache)
            return out
        tensors, spec, spec_key = self._flat(cache)
        if not all(isinstance(t, torch.Tensor) for t in tensors):
            self._stats.eager_steps += 1
            return self._eager(*args, **kwargs)
        inputs = {k: v for k, v in kwargs.items() if k != name and v is not None}
        inputs.setdefault("return_dict", True)
        step = self._optimized.step_for(spec, name, tensors, inputs, spec_key)
        if step is None:  # its graph was refused (see ``refused``): the model runs it
            self._stats.eager_steps += 1
            return self._eager(*args, **kwargs)
        logits = step(tensors, **inputs)
        count_tokens(cache, tokens(inputs))
        self._stats.graph_steps += 1
        if tokens(inputs) == 1:
            run = step.runner_for((tensors,), inputs)
            if run is not None:
                self._bound = BoundStep(name, cache, [layer for c in caches(cache)
                                                      for layer in c.layers],
                                        tensors, inputs, run)
        return Output(logits=logits, cache=cache, past_key_values=cache)


class Output(dict):
    """What ``generate`` reads of a model output: ``logits`` and the cache, by attribute or
    key (``cache`` in transformers 5, ``past_key_values`` before)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None
