"""A transformers cache as ``fast.generate`` reads it: its layered caches, whether a step would
leave its Python state as it is (so a graph can replay it), the sliding-window count a graph
step must keep in Python, and how static caches are sized."""

from __future__ import annotations

from typing import Any

import torch


def caches(cache: Any) -> list[Any]:
    """The layered caches inside ``cache``: itself, or an encoder-decoder cache's two."""
    if hasattr(cache, "layers"):
        return [cache]
    return [getattr(cache, name) for name in ("self_attention_cache", "cross_attention_cache")
            if hasattr(getattr(cache, name, None), "layers")]


def slides(cache: Any) -> bool:
    """Whether a sliding-window layer of the cache may fill its window: past that, its update
    and the attention mask branch on its Python count of tokens (``cumulative_length_int``),
    which a captured graph replays as it was at capture. A window as long as the whole
    cache (``_is_croppable``) never fills, and those branches never change."""
    return any(getattr(layer, "is_sliding", False) and not getattr(layer, "_is_croppable", False)
               for c in caches(cache) for layer in getattr(c, "layers", ()))


def count_tokens(cache: Any, tokens: int) -> None:
    """Count a graph step's tokens on the cache's sliding-window layers, as their own update
    does in Python (the graph updates the copies it unflattens): ``get_seq_length`` reads
    that count, and generate slices the next step's inputs by it (it stayed at the prompt
    step's 0, and the steps after it fed the wrong tokens)."""
    own = getattr(cache, "self_attention_cache", cache)  # not an encoder's cross-attention
    for layer in getattr(own, "layers", ()):
        if isinstance(getattr(layer, "cumulative_length_int", None), int):
            layer.cumulative_length_int += tokens


def allocated(cache: Any) -> bool:
    """Whether a step would leave the cache's Python state as it is, so a graph can replay
    it: every layer holds its tensors (the first update of a transformers ``StaticLayer``
    allocates them) and an encoder-decoder cache has its cross-attention keys (its first
    decoder step computes them and sets ``is_updated``)."""
    layered = caches(cache)
    if not layered or not all(c.layers for c in layered):
        return False
    updated = getattr(cache, "is_updated", None)
    if isinstance(updated, dict) and not all(updated.values()):
        return False
    return all(getattr(layer, "is_initialized", False)
               and isinstance(getattr(layer, "keys", None), torch.Tensor)
               for c in layered for layer in c.layers)


CACHE_BUCKET = 256  # static cache lengths are rounded up to a multiple of this
# Cache structures (batch size, length bucket, dtype) whose step modules are kept, the least
# recently used dropped; each has two step modules, the prompt step's and the decode step's.
MAX_CACHE_SHAPES = 4
