"""What one ``generate`` call asks of the model, read as transformers reads it: the tokens and
sequences each step feeds, the options set by keyword or generation config, the positions the
model has, and why a call runs eagerly or is refused."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from autoopt.errors import ConfigError


def fed(inputs: Mapping[str, Any]) -> torch.Tensor | None:
    """What this step feeds the model, (sequences, tokens, ...), or None."""
    for name in ("input_ids", "decoder_input_ids", "inputs_embeds"):
        value = inputs.get(name)
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            return value
    return None


def tokens(inputs: Mapping[str, Any]) -> int:
    """Tokens per sequence this step feeds (1 for a decode step)."""
    value = fed(inputs)
    return value.shape[1] if value is not None else 1


def batch(inputs: Mapping[str, Any]) -> int | None:
    """Sequences this step feeds (beams and returned sequences counted), or None."""
    value = fed(inputs)
    return value.shape[0] if value is not None else None


def max_positions(module: nn.Module) -> int | None:
    config = getattr(module, "config", None)
    for name in ("max_position_embeddings", "n_positions"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def sliding_window(module: nn.Module) -> int | None:
    value = getattr(getattr(module, "config", None), "sliding_window", None)
    return value if isinstance(value, int) and value > 0 else None


def length_dependent_rope(module: nn.Module) -> str | None:
    """The rope type of a rotary embedding whose frequencies depend on the sequence length at
    run time, or None: transformers' ``dynamic_rope_update`` recomputes "dynamic" frequencies
    in Python once the positions pass the original maximum (and keeps them, so eager's result
    depends on earlier calls too), and switches "longrope" between its short and long factors
    by length, writing the buffer in place."""
    for m in module.modules():
        kinds = getattr(m, "rope_type", None)
        kinds = kinds.values() if isinstance(kinds, Mapping) else [kinds]
        for kind in kinds:
            if isinstance(kind, str) and ("dynamic" in kind or kind == "longrope"):
                return kind
    return None


def option(module: nn.Module, kwargs: Mapping[str, Any], name: str) -> Any:
    """A generation option as the call sets it: the keyword, else the call's
    ``generation_config``, else the model's."""
    if name in kwargs:
        return kwargs[name]
    for config in (kwargs.get("generation_config"), getattr(module, "generation_config", None)):
        if config is not None and hasattr(config, name):
            return getattr(config, name)
    return None


def eager_reason(module: nn.Module, kwargs: Mapping[str, Any]) -> str | None:
    """Why autoopt's graphs cannot serve this call (it runs eagerly, as ``model.generate``
    does), or None."""
    if option(module, kwargs, "use_cache") is False:
        return "use_cache=False: no cache to keep static, each step runs the whole sequence"
    for name in ("output_hidden_states", "output_attentions"):
        if option(module, kwargs, name):
            return f"{name}=True: the step graphs return the logits alone"
    device = next((p.device.type for p in module.parameters()), "cpu")
    if device in ("cpu", "cuda") and torch.is_autocast_enabled(device):
        return ("under torch.autocast: the step graphs and the cache's dtype are the "
                "module's own")
    rope = length_dependent_rope(module)
    if rope is not None:
        return (f"rope_type {rope!r}: the rotary frequencies depend on the sequence length "
                f"at run time (transformers' dynamic_rope_update), which a graph would replay "
                f"as captured")
    return None


def beyond_positions(module: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any],
                      ) -> ConfigError | None:
    """The clear error for a call whose prompt, or prompt and new tokens, need more positions
    than the model has (a learned position table then fails with a bare index error, or the
    prompt step's capture with one on its example inputs), or None. The lengths are the
    call's as generate reads them: ``max_new_tokens``, else ``max_length``, each from the
    keyword, the call's ``generation_config`` or the model's."""
    ids = args[0] if args and isinstance(args[0], torch.Tensor) else kwargs.get("input_ids")
    positions = max_positions(module)
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or positions is None or \
            getattr(getattr(module, "config", None), "is_encoder_decoder", False):
        return None  # an encoder-decoder's prompt is the encoder's, not the decoder's positions
    name, prompt = type(module).__name__, ids.shape[1]
    if prompt > positions:
        return ConfigError(f"generate: the prompt is {prompt} tokens, longer than the "
                           f"{positions} positions {name} has (its config's "
                           f"max_position_embeddings or n_positions). Shorten the prompt to "
                           f"at most {positions} tokens, fewer to leave room for new ones.")
    new = option(module, kwargs, "max_new_tokens")
    where = "" if "max_new_tokens" in kwargs else " (from the generation config)"
    if isinstance(new, int):
        if prompt + new <= positions:
            return None
        return ConfigError(f"generate: a prompt of {prompt} tokens and max_new_tokens={new}"
                           f"{where} need {prompt + new} positions; {name} has {positions}. "
                           f"Shorten the prompt or max_new_tokens.")
    length = option(module, kwargs, "max_length")
    if not isinstance(length, int) or length <= positions:
        return None
    where = "" if "max_length" in kwargs else " (from the generation config)"
    return ConfigError(f"generate: max_length={length}{where} needs {length} positions; "
                       f"{name} has {positions}. Pass max_length={positions} or less, or "
                       f"max_new_tokens.")
