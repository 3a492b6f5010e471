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
  step of a call, which allocates them, runs eagerly, as does a step whose graph verification
  refused after a call was served (``autoopt.generation.refused``).

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
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from autoopt.check.state import hook_keys
from autoopt.compile.guards import training_flags
from autoopt.errors import ConfigError, ModelError
from autoopt.generation.cache import (
    CACHE_BUCKET,
    MAX_CACHE_SHAPES,
    allocated,
)
from autoopt.generation.call import (
    beyond_positions,
    eager_reason,
    max_positions,
    option,
    sliding_window,
    tokens,
)
from autoopt.generation.refused import Refusals
from autoopt.generation.returned import returned_cache
from autoopt.generation.stepper import GenerationStats, RunEagerly, Stepper
from autoopt.module.build import build
from autoopt.module.optimized import OptimizedModule
from autoopt.module.watch import ModuleWatch
from autoopt.observe import progress
from autoopt.options.precision import PROMPT_STEP

log = logging.getLogger(__name__)

__all__ = ["GenerationStats", "GenerativeModule", "defers_forward", "module_class"]


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


def _named_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    return dict(itertools.chain(module.named_parameters(remove_duplicate=False),
                                module.named_buffers(remove_duplicate=False)))


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (type(a) is type(b) and a.shape == b.shape and a.dtype == b.dtype
            and a.device == b.device and a.stride() == b.stride() and torch.equal(a, b))


def _swappable(t: torch.Tensor) -> bool:
    """Whether ``t`` can take another C++ tensor under its Python object (as
    ``autoopt.module.optimized``'s ``_own_memory`` does): nothing else holds its own (an
    autograd graph, a gradient) nor hooks on it."""
    return (type(t) in (torch.Tensor, nn.Parameter) and t.is_leaf and t.grad is None
            and not t._backward_hooks and t._use_count() == 1)


def _float_layout(module: nn.Module) -> frozenset[tuple[torch.dtype, torch.device]]:
    return frozenset((t.dtype, t.device) for t in itertools.chain(module.parameters(),
                                                                   module.buffers())
                     if t.is_floating_point())


class _StateWatch(ModuleWatch):
    """What the step modules copied of ``fast.module`` besides its weights: Python
    attributes, which tensors and submodules sit in its slots. Not the module's owner: the
    ``OptimizedModule``'s own watch counts assignments to it."""

    def _register(self) -> None:
        self._registered = True


class Generator:
    """The decode/prefill graphs of one ``OptimizedModule``: one optimized ``_Step`` module
    per cache structure (batch size, maximum length, dtype), each holding a graph per input
    signature (prefill per prompt length, decode)."""

    def __init__(self, optimized: Any) -> None:
        self._optimized = optimized
        self._steps: dict[Any, Any] = {}
        self._refused = Refusals()  # step graphs refused after a call was served
        self._layout: list[tuple[Any, ...]] = []
        self._layout_of: frozenset[Any] = frozenset()  # the module's dtypes and devices then
        self._weights: tuple[tuple[int, int], ...] = ()  # what the step graphs were built on
        self._state: tuple[_StateWatch, Any] | None = None  # and the rest of the module
        self._asked_static = False  # this call's cache_implementation="static", the user's
        self._asked_length: int | None = None  # and the length transformers sized it to
        self._source_length: int | None = None  # an encoder's output before its padding
        self.stats = GenerationStats()

    def _module_state(self) -> Any:
        """What ``_StateWatch`` does not see: hooks (on submodules and global), which a
        step's copy runs as they were when it was built, and train/eval flags."""
        from torch.nn.modules import module as module_impl

        module = self._optimized.module
        global_hooks = tuple(tuple(getattr(module_impl, name, None) or ())
                             for name in ("_global_forward_hooks", "_global_forward_pre_hooks"))
        return (frozenset(hook_keys(module)), global_hooks,
                training_flags(module.modules()))

    def _drop_steps_on_other_state(self) -> None:
        """Each step module runs a copy of ``fast.module`` taken when it was built: a Python
        attribute set since (``attn.scaling = ...``; also one put back), a hook registered
        or removed, a submodule replaced, a train/eval flag flipped is not seen there, and
        those steps would replay the old model. (``fast(x)`` sees them: the module's own
        watch drops its graphs.) They are dropped and built again from the module as it
        is."""
        module = self._optimized.module
        if self._state is not None:
            watch, other = self._state
            if not (watch.attributes_changed() or watch.replaced()
                    or other != self._module_state()):
                return
            if self._steps:
                log.info("generate: the module's attributes, hooks, submodules or train/eval "
                         "flags changed since the step graphs were built; building them "
                         "again")
            self._steps.clear()
            self._refused.reasons.clear()  # on the module as it is now they may verify
        self._state = (_StateWatch(module), self._module_state())

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
            same_tensors = [a[0] for a in weights] == [b[0] for b in self._weights]
            if self._steps and not (same_tensors and self._follow_moved_memory()):
                log.info("generate: the module's weights moved to other memory since the "
                         "step graphs were built; building them again")
                self._steps.clear()
                self._refused.reasons.clear()
            self._weights = weights

    def _follow_moved_memory(self) -> bool:
        """Point every step module's tensors at the memory ``fast.module``'s tensors moved to,
        where each holds the same values as the step's (the module took memory of its own
        apart from your model's: ``fast(x)`` with gradients enabled, a training call); True
        if done. The steps then see the module's later writes as before (the same memory and
        version counters), with no graph built again: a plain call between generate calls
        dropped both step graphs (7 s to build again) and kept the weights twice."""
        own = _named_tensors(self._optimized.module)
        moves: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for step in self._steps.values():
            copy_of = getattr(step.module, "model", None)
            theirs = _named_tensors(copy_of) if isinstance(copy_of, nn.Module) else {}
            if theirs.keys() != own.keys():
                return False
            for name, mine in own.items():
                held = theirs[name]
                if held.data_ptr() == mine.data_ptr() or id(held) in moves:
                    continue
                if not _same_values(held, mine) or not _swappable(held):
                    return False  # other values (p.data = ...): the graphs' are stale
                moves[id(held)] = (held, mine)
        for held, mine in moves.values():
            alias = mine.detach()  # its memory and its version counter
            if type(held) is nn.Parameter:
                alias = nn.Parameter(alias, requires_grad=held.requires_grad)
            torch._C._swap_tensor_impl(held, alias)  # the Python object and its __dict__ kept
        for step in self._steps.values():
            step.memory_moved()
        return True

    def remember_layout(self, cache: Any) -> None:
        """Record the shapes the model's first step gave each cache layer (heads, head
        sizes, dtype), so the next call's cache is allocated before its prompt step and
        that step runs through a graph too."""
        if allocated(cache) and hasattr(cache, "layers"):
            self._layout = [(type(layer), layer.keys.shape, layer.values.shape,
                             layer.keys.dtype, layer.keys.device) for layer in cache.layers]
            self._layout_of = _float_layout(self._optimized.module)

    def allocate(self, cache: Any, batch: int | None) -> None:
        """Allocate ``cache``'s tensors for ``batch`` sequences with the recorded layout (the
        layout's own batch is the first call's: a call with another batch size has its own
        cache shapes, and graphs)."""
        layers = getattr(cache, "layers", None)
        if not self._layout or not layers or len(layers) != len(self._layout) or batch is None:
            return
        if _float_layout(self._optimized.module) != self._layout_of:
            # ``.to(float64)``, ``.half()``, another device since: the cache's dtype and
            # device are what the model's first step gives them again.
            self._layout = []
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
        prompt = tokens(inputs) != 1
        key = (prompt, spec_key if spec_key is not None else str(spec), name,
               tuple((t.shape, t.dtype, t.device) for t in tensors))
        step = self._steps.get(key)
        if step is None:
            def make() -> OptimizedModule:
                started = time.perf_counter()
                log.info("generate: capturing a %s step graph for a cache of %d tensors",
                         "prompt" if prompt else "decode", len(tensors))
                model = _Step(self._optimized.module, spec, name).eval()
                # int8/int4 measured slower at a prompt's rows: that graph runs fp32, as the
                # decode steps, which decide whether the precision applies, do not.
                setattr(model, PROMPT_STEP, prompt)
                made = build(model, (tensors,), dict(inputs), config=self._optimized.config,
                             training=False, dynamic=prompt)
                log.info("generate: step graph ready in %.1f s", time.perf_counter() - started)
                return made

            step = self._refused.build(key, "prompt" if prompt else "decode", make)
            if step is None:  # refused: the caller runs the step eagerly
                self.stats.note = self._refused.note(key, self.stats.note)
                return None
            self._steps[key] = step
            # Each holds graphs and weight copies. The limit counts cache shapes, not step
            # modules: counting modules kept two shapes of the four (a third batch size threw
            # out the first one's prompt and decode graphs).
            while len({k[1:] for k in self._steps}) > MAX_CACHE_SHAPES:
                oldest = next(iter(self._steps))[1:]
                for k in [k for k in self._steps if k[1:] == oldest]:
                    del self._steps[k]
        else:
            self._steps[key] = self._steps.pop(key)  # most recently used last
        return step

    def _sized(self, prepare: Callable[..., Any]) -> Callable[..., Any]:
        """transformers' static-cache constructor with the length rounded up to a bucket, so
        calls with other prompt lengths or ``max_new_tokens`` share one decode graph."""
        positions = max_positions(self._optimized.module)
        window = sliding_window(self._optimized.module)

        def prepare_bucketed(*args: Any, **kwargs: Any) -> Any:
            length = kwargs.get("max_cache_len")
            self._asked_length = length if isinstance(length, int) else None
            if isinstance(length, int):
                bucket = -(-length // CACHE_BUCKET) * CACHE_BUCKET
                if window is not None and length <= window:
                    # A call that fits the sliding window keeps a cache no longer than it,
                    # whose window never fills: its steps can run through graphs (see
                    # ``slides``).
                    bucket = min(bucket, window)
                kwargs["max_cache_len"] = max(length, min(bucket, positions or bucket))
            return prepare(*args, **kwargs)
        return prepare_bucketed

    def _padded_source(self, encode: Callable[..., Any]) -> Callable[..., Any]:
        """transformers' encoder call for generate, its output and the attention mask padded
        to a multiple of the bucket (the padding masked out): the cross-attention cache is
        sized to the encoder's length, so each new source length had a decode graph of its
        own (1.9-2.7 s each on T5)."""
        module = self._optimized.module
        # A text encoder-decoder's attention_mask is the source's padding mask, which its
        # cross-attention applies (a padded batch needs it): one of ones can be made where
        # the call gave none. (Not for other inputs, audio features: the mask may be theirs.)
        masks = getattr(module, "main_input_name", None) == "input_ids" and \
            "attention_mask" in inspect.signature(module.forward).parameters

        def encode_padded(*args: Any, **kwargs: Any) -> Any:
            model_kwargs = encode(*args, **kwargs)
            outputs = model_kwargs.get("encoder_outputs")
            hidden = getattr(outputs, "last_hidden_state", None)
            mask = model_kwargs.get("attention_mask")
            if mask is None and masks and isinstance(hidden, torch.Tensor) and hidden.dim() == 3:
                mask = torch.ones(hidden.shape[:2], dtype=torch.long, device=hidden.device)
            if not isinstance(hidden, torch.Tensor) or not isinstance(mask, torch.Tensor) or \
                    hidden.dim() != 3 or mask.shape != hidden.shape[:2]:
                return model_kwargs
            length = hidden.shape[1]
            pad = -(-length // CACHE_BUCKET) * CACHE_BUCKET - length
            self._source_length = length
            if pad:
                outputs.last_hidden_state = torch.nn.functional.pad(hidden, (0, 0, 0, pad))
                mask = torch.nn.functional.pad(mask, (0, pad))
            model_kwargs["attention_mask"] = mask
            return model_kwargs
        return encode_padded

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
        started = time.perf_counter()
        reason = eager_reason(module, kwargs)
        if reason is None and kwargs.get("streamer") is not None and \
                sliding_window(module) is not None:
            # Whether the window fills is known at the first step, after the streamer was
            # given the prompt: running the call again would stream it twice.
            reason = "a streamer with a sliding-window model"
        result = None
        self.stats = GenerationStats()
        # What the cache returned with return_dict_in_generate=True is to be.
        self._asked_static = option(module, kwargs, "cache_implementation") == "static"
        if reason is None:
            self._drop_steps_on_other_weights()
            self._drop_steps_on_other_state()
            try:
                result = self._run(module, args, {**kwargs, "cache_implementation": "static"})
                self._refused.served = True
            except RunEagerly as exc:  # raised before any step ran
                reason = str(exc)
        if reason is not None:
            # The user's own arguments (their cache too): what model.generate runs.
            self.stats = GenerationStats(note=f"the call ran eagerly: {reason}")
            result = self._run(module, args, kwargs, eager_only=True)
        self.stats.seconds = time.perf_counter() - started
        if self.stats.eager_steps > 1 and not self.stats.graph_steps and reason is None:
            self.stats.note = (f"every step ran eagerly: the model's cache "
                               f"({self.stats.cache_type}) is not a static cache whose "
                               f"layers autoopt can take apart")
        if self.stats.note:
            warning = f"generate: {self.stats.note}"
            if warning not in self._optimized.report.warnings:
                self._optimized.report.warnings.append(warning)
                log.warning("%s", warning)
        log.info("%s", self.stats)
        return result

    def _run(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
             eager_only: bool = False) -> Any:
        driver = copy.copy(module)  # shares submodules, weights and hooks; its own forward
        stepper = Stepper(self, module, self.stats, eager_only)
        driver.forward = stepper
        # generate calls the driver, whose call would run the model's hooks (its dicts are the
        # model's) around a step that calls the model, which runs them again: twice a step (a
        # forward hook adding a bias to the logits added it twice). nn.Module's call goes
        # straight to ``_compiled_call_impl`` where one is set, past every hook, global
        # ones too; the step's own call of the model runs them once.
        driver._compiled_call_impl = stepper
        prepare = getattr(driver, "_prepare_static_cache", None)
        if callable(prepare) and not eager_only:
            # transformers 5; without it, each length has its own graph
            driver._prepare_static_cache = self._sized(prepare)
        encode = getattr(driver, "_prepare_text_encoder_decoder_kwargs_for_generation", None)
        if callable(encode) and not eager_only:
            driver._prepare_text_encoder_decoder_kwargs_for_generation = \
                self._padded_source(encode)
        self._asked_length = self._source_length = None
        with torch.no_grad():
            try:
                result = driver.generate(*args, **kwargs)
            except (IndexError, RuntimeError, ModelError) as exc:
                # (ModelError: a prompt step's capture ran the model on this prompt)
                clear = beyond_positions(module, args, kwargs)
                if clear is None:
                    raise
                raise clear from exc
            if not eager_only:
                self._return_eager_s_cache(module, result)
        return result

    def _return_eager_s_cache(self, module: nn.Module, result: Any) -> None:
        """Put the cache eager would return in ``result`` (``return_dict_in_generate=True``)
        in place of the static one the steps ran on (see ``autoopt.generation.returned``)."""
        for name in ("cache", "past_key_values"):
            cache = result.get(name) if isinstance(result, Mapping) else None
            if cache is None:
                continue
            length = self._asked_length if self._asked_static else None
            if self._asked_static and length is None:
                return  # no length known to size it to: the steps' own
            rebuilt = returned_cache(cache, module, length, self._source_length)
            if rebuilt is not None:
                result[name] = rebuilt
            return


class GenerativeModule(OptimizedModule):
    """The ``OptimizedModule`` ``autoopt.optimize`` returns for a model that has transformers'
    ``generate``: the same module, plus ``generate``."""

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """``model.generate(...)`` with the same arguments and result, each step through
        autoopt's graphs: a static KV cache, one verified graph for every decode step (see
        ``autoopt.generation.generator``)."""
        generator = self.__dict__.get("_generator")
        if generator is None:
            generator = Generator(self)
            self.__dict__["_generator"] = generator
        with progress.reported("generate"):  # a first call captures its step graphs
            return generator.generate(*args, **kwargs)

    @property
    def generation_stats(self) -> GenerationStats | None:
        """What the last ``generate`` call ran: steps through autoopt's graphs and eagerly,
        its seconds, the cache type, and why steps ran eagerly (None before a first call)."""
        generator = self.__dict__.get("_generator")
        return generator.stats if generator is not None else None

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.pop("_generator", None)  # its step graphs, like the module's own
        return state


def module_class(model: nn.Module) -> type[OptimizedModule]:
    """What ``autoopt.optimize`` makes for ``model``."""
    return GenerativeModule if callable(getattr(model, "generate", None)) else OptimizedModule


def defers_forward(optimized: OptimizedModule, training: bool) -> bool:
    """Whether ``optimize`` leaves the forward graph to the first call: an fp32 inference
    model in transformers' generation loop (``generate`` builds its own step graphs). Under
    ``precision=`` the forward judges next-token agreement; ``backend=`` applies at once."""
    can = getattr(optimized.module, "can_generate", None)
    config = optimized.config
    return (not training and isinstance(optimized, GenerativeModule)
            and config.precision in (None, "fp32") and config.backend is None
            and callable(can) and bool(can())
            and any(c.__name__ == "GenerationMixin" for c in type(optimized.module).__mro__))
