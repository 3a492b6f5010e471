"""The cache ``fast.generate`` returns (``return_dict_in_generate=True``): the one eager's
``generate`` would, made from the static cache autoopt's steps filled."""

from __future__ import annotations

from typing import Any

from torch import nn


def returned_cache(cache: Any, module: nn.Module, static_length: int | None,
                    source_length: int | None = None) -> Any:
    """The cache eager's ``generate`` returns for the call, made from the one autoopt's steps
    filled (a static cache the length of a bucket, 256 positions): a ``DynamicCache`` holding
    the tokens fed, or with ``cache_implementation="static"`` a static cache of the length
    transformers sized it to (``static_length``); an encoder-decoder's pair likewise. None
    where the cache is not one this knows how to rebuild (it is then returned as it is).
    ``source_length``: the encoder's output length before it was padded to a bucket."""
    from transformers.cache_utils import DynamicCache, EncoderDecoderCache, StaticCache

    config = module.config.get_text_config(decoder=True)

    def rebuilt(old: Any, length: int | None, fed: int | None = None) -> Any:
        layers = getattr(old, "layers", None)
        new = (StaticCache(config=config, max_cache_len=length) if length is not None
               else DynamicCache(config=config))
        if layers is None or len(new.layers) != len(layers):
            return None
        for a, b in zip(layers, new.layers, strict=True):
            if not getattr(a, "is_initialized", False):
                continue
            # (a graph step wrote the count in place too)
            filled = int(a.get_seq_length()) if fed is None else fed
            b.update(a.keys[:, :, :filled].clone(), a.values[:, :, :filled].clone())
        return new

    if not isinstance(cache, EncoderDecoderCache):
        return rebuilt(cache, static_length) if isinstance(cache, StaticCache) else None
    own, cross = cache.self_attention_cache, cache.cross_attention_cache
    if not isinstance(own, StaticCache) or not isinstance(cross, StaticCache):
        return None
    encoded = source_length if source_length is not None else max(
        (int(layer.get_seq_length()) for layer in cross.layers
         if getattr(layer, "is_initialized", False)), default=0)
    pair = (rebuilt(own, static_length),
            rebuilt(cross, encoded if static_length is not None else None, encoded))
    return EncoderDecoderCache(*pair) if None not in pair else None
