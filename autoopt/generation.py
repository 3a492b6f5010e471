"""``OptimizedModule.generate``: Hugging Face generation through autoopt's graphs.

Autoregressive decoding reads every weight once per token and launches hundreds of small
kernels per step. ``transformers``' own ``generate`` keeps driving the loop — logits
processors, greedy or seeded sampling, stopping on ``eos``, padding, ``max_new_tokens`` — so
the result is what ``model.generate`` returns for the same arguments; only the model call of
each step is autoopt's:

- the KV cache is static (``cache_implementation="static"``: preallocated to the maximum
  length and written in place at each step's position), so every decode step has the same
  shapes and one graph, captured, optimized and verified once, serves every step of every
  call with that batch size and maximum length;
- that graph (``_Step``: the model called on a cache rebuilt around the step's cache tensors,
  which it writes in place) goes through ``autoopt.optimize`` with the options the module was
  optimized with: the graph passes (``merge_linear`` for Q/K/V and gate/up, ``attention``),
  ``precision=`` (``"int8"``: weights stored in int8, read once per token), the measured
  backend, CUDA graphs on a GPU;
- the prompt (prefill) step runs the same way once the cache holds its tensors; the first
  step of a call, which allocates them, runs eagerly.

The cache object is taken apart with ``capture.objects`` (its tensors become graph inputs, its
other attributes ride along in the spec), so no ``transformers`` type is registered anywhere.
"""

from __future__ import annotations

import copy
import inspect
import itertools
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from .build import build
from .capture import objects
from .errors import ConfigError
from .module import OptimizedModule

log = logging.getLogger(__name__)

__all__ = ["GenerationStats", "GenerativeModule", "module_class"]


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


class _Step(nn.Module):
    """One model call of the generation loop with the cache as plain tensors.

    ``forward(cache_tensors, **inputs)`` rebuilds a cache object of the recorded structure
    around ``cache_tensors`` (which the model writes in place at the step's position) and
    returns the logits.
    """

    def __init__(self, model: nn.Module, cache_spec: pytree.TreeSpec, cache_name: str) -> None:
        super().__init__()
        self.model = model
        self.cache_spec = cache_spec
        self.cache_name = cache_name

    def forward(self, cache_tensors: list[torch.Tensor], **inputs: Any) -> torch.Tensor:
        cache = pytree.tree_unflatten(cache_tensors, self.cache_spec)
        out = self.model(**inputs, **{self.cache_name: cache})
        return out.logits if hasattr(out, "logits") else out[0]


class _Stepper:
    """The forward ``generate`` calls: autoopt's graph where the cache is allocated, the
    model's own forward where not (the step that allocates it)."""

    def __init__(self, optimized: Any, eager_forward: Callable[..., Any],
                 stats: GenerationStats) -> None:
        self._optimized = optimized
        self._eager = eager_forward
        self._stats = stats
        # generate reads the forward's signature to decide what to pass (position ids, which
        # logits to keep): it must see the model's own.
        self.__signature__ = inspect.signature(eager_forward)
        self._last: tuple[Any, ...] | None = None

    def _flat(self, cache: Any) -> tuple[list[Any], pytree.TreeSpec, str]:
        """The cache's tensors, structure and the structure's text (part of a step graph's
        key), taken apart once per cache object (a static cache keeps its tensors from step
        to step; ~0.6 ms a step otherwise, and 0.1 ms to write the structure out)."""
        keys = [layer.keys for c in _caches(cache) for layer in c.layers]
        if self._last is None or self._last[0] is not cache or any(
                a is not b for a, b in zip(self._last[1], keys, strict=True)):
            tensors, spec = objects.flatten(cache)
            self._last = (cache, keys, tensors, spec, str(spec))
        return self._last[2], self._last[3], self._last[4]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from transformers.cache_utils import Cache

        found = [(k, v) for k, v in kwargs.items() if isinstance(v, Cache)]
        if args or len(found) != 1:
            self._stats.eager_steps += 1
            return self._eager(*args, **kwargs)
        name, cache = found[0]
        self._stats.cache_type = type(cache).__name__
        if not _allocated(cache):  # as the first call's cache was, if known
            self._optimized.allocate(cache, _batch(kwargs))
        if not _allocated(cache):
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
        logits = step(tensors, **inputs)
        self._stats.graph_steps += 1
        return _Output(logits=logits, cache=cache, past_key_values=cache)


class _Output(dict):
    """What ``generate`` reads of a model output: ``logits`` and the cache, by attribute or
    key (``cache`` in transformers 5, ``past_key_values`` before)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def _caches(cache: Any) -> list[Any]:
    """The layered caches inside ``cache``: itself, or an encoder-decoder cache's two."""
    if hasattr(cache, "layers"):
        return [cache]
    return [getattr(cache, name) for name in ("self_attention_cache", "cross_attention_cache")
            if hasattr(getattr(cache, name, None), "layers")]


def _allocated(cache: Any) -> bool:
    """Whether a step would leave the cache's Python state as it is, so a graph can replay
    it: every layer holds its tensors (the first update of a transformers ``StaticLayer``
    allocates them) and an encoder-decoder cache has its cross-attention keys (its first
    decoder step computes them and sets ``is_updated``)."""
    caches = _caches(cache)
    if not caches or not all(c.layers for c in caches):
        return False
    updated = getattr(cache, "is_updated", None)
    if isinstance(updated, dict) and not all(updated.values()):
        return False
    return all(getattr(layer, "is_initialized", False)
               and isinstance(getattr(layer, "keys", None), torch.Tensor)
               for c in caches for layer in c.layers)


_CACHE_BUCKET = 256  # static cache lengths are rounded up to a multiple of this
_MAX_STEP_MODULES = 4  # cache structures (batch size, length) kept, least recently used out


def _fed(inputs: Mapping[str, Any]) -> torch.Tensor | None:
    """What this step feeds the model, (sequences, tokens, ...), or None."""
    for name in ("input_ids", "decoder_input_ids", "inputs_embeds"):
        value = inputs.get(name)
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            return value
    return None


def _tokens(inputs: Mapping[str, Any]) -> int:
    """Tokens per sequence this step feeds (1 for a decode step)."""
    fed = _fed(inputs)
    return fed.shape[1] if fed is not None else 1


def _batch(inputs: Mapping[str, Any]) -> int | None:
    """Sequences this step feeds (beams and returned sequences counted), or None."""
    fed = _fed(inputs)
    return fed.shape[0] if fed is not None else None


def _max_positions(module: nn.Module) -> int | None:
    config = getattr(module, "config", None)
    for name in ("max_position_embeddings", "n_positions"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _beyond_positions(module: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any],
                      ) -> ConfigError | None:
    """The clear error for a call whose prompt and new tokens need more positions than the
    model has (a learned position table then fails with a bare index error), or None."""
    ids = args[0] if args and isinstance(args[0], torch.Tensor) else kwargs.get("input_ids")
    positions = _max_positions(module)
    new = kwargs.get("max_new_tokens")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or positions is None or \
            not isinstance(new, int) or ids.shape[1] + new <= positions:
        return None
    return ConfigError(f"generate: a prompt of {ids.shape[1]} tokens and max_new_tokens={new} "
                       f"need {ids.shape[1] + new} positions; {type(module).__name__} has "
                       f"{positions}. Shorten the prompt or max_new_tokens.")


class Generator:
    """The decode/prefill graphs of one ``OptimizedModule``: one optimized ``_Step`` module
    per cache structure (batch size, maximum length, dtype), each holding a graph per input
    signature (prefill per prompt length, decode)."""

    def __init__(self, optimized: Any) -> None:
        self._optimized = optimized
        self._steps: dict[Any, Any] = {}
        self._layout: list[tuple[Any, ...]] = []
        self._weights: tuple[tuple[int, int], ...] = ()  # what the step graphs were built on
        self.stats = GenerationStats()

    def _drop_steps_on_other_weights(self) -> None:
        """Each step module is built on a copy of the module that reads its tensors' memory
        as it was then (in-place writes to it, an optimizer step, are seen through the
        shared version counters and capture again). A tensor given other memory since (the
        module's first load_state_dict or training call ends its sharing of your model's
        weights; ``.to()``; ``load_state_dict(assign=True)``) is not seen there: those steps
        would replay the old weights, so they are dropped and built again."""
        tensors = itertools.chain(self._optimized.module.parameters(),
                                  self._optimized.module.buffers())
        weights = tuple((id(t), t.data_ptr()) for t in tensors)
        if weights != self._weights:
            if self._steps:
                log.info("generate: the module's weights moved to other memory since the "
                         "step graphs were built; building them again")
            self._steps.clear()
            self._weights = weights

    def remember_layout(self, cache: Any) -> None:
        """Record the shapes the model's first step gave each cache layer (heads, head
        sizes, dtype), so the next call's cache is allocated before its prompt step and
        that step runs through a graph too."""
        if _allocated(cache) and hasattr(cache, "layers"):
            self._layout = [(type(layer), layer.keys.shape, layer.values.shape,
                             layer.keys.dtype, layer.keys.device) for layer in cache.layers]

    def allocate(self, cache: Any, batch: int | None) -> None:
        """Allocate ``cache``'s tensors for ``batch`` sequences with the recorded layout (the
        layout's own batch is the first call's: a call with another batch size has its own
        cache shapes, and graphs)."""
        layers = getattr(cache, "layers", None)
        if not self._layout or not layers or len(layers) != len(self._layout) or batch is None:
            return
        # The length is the layer's own (``max_cache_len``, which lazy_initialization reads):
        # a call whose cache is another length bucket allocates with the same layout.
        for layer, (kind, *_) in zip(layers, self._layout, strict=True):
            if type(layer) is not kind or not hasattr(layer, "lazy_initialization"):
                return
        for layer, (_, keys, values, dtype, device) in zip(layers, self._layout, strict=True):
            layer.lazy_initialization(
                torch.empty((batch, keys[1], 0, keys[3]), dtype=dtype, device=device),
                torch.empty((batch, values[1], 0, values[3]), dtype=dtype, device=device))

    def step_for(self, spec: pytree.TreeSpec, name: str, tensors: list[torch.Tensor],
                 inputs: Mapping[str, Any], spec_key: str | None = None) -> Any:
        # Decode steps (one token) share one static graph; prompt steps one graph whose
        # sequence length is symbolic, so prompts of any length add no graph (and no copy
        # of the packed weights) each.
        prompt = _tokens(inputs) != 1
        key = (prompt, spec_key if spec_key is not None else str(spec), name,
               tuple((t.shape, t.dtype, t.device) for t in tensors))
        step = self._steps.get(key)
        if step is None:
            started = time.perf_counter()
            log.info("generate: capturing a %s step graph for a cache of %d tensors",
                     "prompt" if prompt else "decode", len(tensors))
            model = _Step(self._optimized.module, spec, name).eval()
            step = build(model, (tensors,), dict(inputs), config=self._optimized.config,
                         training=False, dynamic=prompt)
            log.info("generate: step graph ready in %.1f s", time.perf_counter() - started)
            self._steps[key] = step
            while len(self._steps) > _MAX_STEP_MODULES:  # each holds graphs and weight copies
                self._steps.pop(next(iter(self._steps)))
        else:
            self._steps[key] = self._steps.pop(key)  # most recently used last
        return step

    def _sized(self, prepare: Callable[..., Any]) -> Callable[..., Any]:
        """transformers' static-cache constructor with the length rounded up to a bucket, so
        calls with other prompt lengths or ``max_new_tokens`` share one decode graph."""
        positions = _max_positions(self._optimized.module)

        def prepare_bucketed(*args: Any, **kwargs: Any) -> Any:
            length = kwargs.get("max_cache_len")
            if isinstance(length, int):
                bucket = -(-length // _CACHE_BUCKET) * _CACHE_BUCKET
                kwargs["max_cache_len"] = max(length, min(bucket, positions or bucket))
            return prepare(*args, **kwargs)
        return prepare_bucketed

    @property
    def reports(self) -> list[Any]:
        return [step.report for step in self._steps.values()]

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        module = self._optimized.module  # has generate: see module_class
        if module.training:
            raise ConfigError("generate: the model is in train mode; optimize it in eval mode "
                              "(model.eval()) to generate.")
        if kwargs.get("cache_implementation", "static") != "static" or \
                kwargs.get("past_key_values") is not None:
            raise ConfigError("generate: autoopt decodes with a static KV cache, one graph for "
                              "every step; drop cache_implementation= and past_key_values= "
                              "(or call the model's own generate for another cache).")
        if not getattr(module, "_can_compile_fullgraph", True):
            raise ConfigError(f"generate: {type(module).__name__} does not support a static "
                              f"KV cache in this transformers version, which autoopt's "
                              f"decoding graphs need; call model.generate instead.")
        kwargs["cache_implementation"] = "static"
        self._drop_steps_on_other_weights()
        self.stats = GenerationStats()
        started = time.perf_counter()
        driver = copy.copy(module)  # shares submodules and weights; its own forward
        driver.forward = _Stepper(self, module.forward, self.stats)
        prepare = getattr(driver, "_prepare_static_cache", None)
        if callable(prepare):  # transformers 5; without it, each length has its own graph
            driver._prepare_static_cache = self._sized(prepare)
        with torch.no_grad():
            try:
                result = driver.generate(*args, **kwargs)
            except (IndexError, RuntimeError) as exc:
                clear = _beyond_positions(module, args, kwargs)
                if clear is None:
                    raise
                raise clear from exc
        self.stats.seconds = time.perf_counter() - started
        if self.stats.eager_steps > 1 and not self.stats.graph_steps:
            self.stats.note = (f"every step ran eagerly: the model's cache "
                               f"({self.stats.cache_type}) is not a static cache whose "
                               f"layers autoopt can take apart")
            if self.stats.note not in self._optimized.report.warnings:
                self._optimized.report.warnings.append(f"generate: {self.stats.note}")
            log.warning("generate: %s", self.stats.note)
        log.info("%s", self.stats)
        return result


class GenerativeModule(OptimizedModule):
    """The ``OptimizedModule`` ``autoopt.optimize`` returns for a model that has transformers'
    ``generate``: the same module, plus ``generate``."""

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """``model.generate(...)`` with the same arguments and result, each step through
        autoopt's graphs: a static KV cache, one verified graph for every decode step (see
        ``autoopt.generation``)."""
        generator = self.__dict__.get("_generator")
        if generator is None:
            generator = Generator(self)
            self.__dict__["_generator"] = generator
        return generator.generate(*args, **kwargs)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.pop("_generator", None)  # its step graphs, like the module's own
        return state


def module_class(model: nn.Module) -> type[OptimizedModule]:
    """What ``autoopt.optimize`` makes for ``model``."""
    return GenerativeModule if callable(getattr(model, "generate", None)) else OptimizedModule
