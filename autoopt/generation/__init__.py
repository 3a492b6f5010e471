"""``fast.generate``: autoregressive decoding with one graph per step shape, a static KV cache,
and the precision the user asked for, checked by next-token agreement (``generator``)."""

from autoopt.generation.generator import GenerationStats, GenerativeModule, Generator, module_class

__all__ = ["GenerationStats", "GenerativeModule", "Generator", "module_class"]
