"""Real models from small configs with random weights, for tests. Nothing is downloaded."""

from __future__ import annotations

from typing import Any

import torch
import torchvision
import transformers
from torch import nn

transformers.logging.set_verbosity_error()

_TEXT = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
             intermediate_size=64)


def token_ids(batch: int = 2, seq: int = 16) -> torch.Tensor:
    return torch.randint(0, _TEXT["vocab_size"], (batch, seq))


def resnet18() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    return torchvision.models.resnet18(num_classes=10).eval(), (torch.randn(2, 3, 64, 64),), {}


def mobilenet_v3_small() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    model = torchvision.models.mobilenet_v3_small(num_classes=10).eval()
    return model, (torch.randn(2, 3, 64, 64),), {}


def vit_b_16() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    # The real vit_b_16 architecture (12 layers, width 768) at a small image size.
    return torchvision.models.vit_b_16(image_size=32).eval(), (torch.randn(1, 3, 32, 32),), {}


def bert() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    model = transformers.BertModel(transformers.BertConfig(**_TEXT)).eval()
    ids = token_ids()
    return model, (ids,), {"attention_mask": torch.ones_like(ids)}


def gpt2() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    config = transformers.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=2,
                                     n_positions=64, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2Model(config).eval(), (token_ids(),), {}


def llama() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    config = transformers.LlamaConfig(**_TEXT, num_key_value_heads=1, max_position_embeddings=64)
    return transformers.LlamaModel(config).eval(), (token_ids(),), {}


def llama_lm(vocab: int = 128) -> nn.Module:
    """A Llama-style causal LM with grouped-query attention, for ``generate``."""
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64,
                                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.LlamaForCausalLM(config).eval()


REAL_MODELS = {"resnet18": resnet18, "mobilenet_v3_small": mobilenet_v3_small,
               "vit_b_16": vit_b_16, "bert": bert, "gpt2": gpt2, "llama": llama}
