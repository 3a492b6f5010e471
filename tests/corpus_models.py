"""The real-model corpus: torchvision, timm and transformers architectures with random weights
at small sizes. Nothing is downloaded: no pretrained weights, configs built in code.

Each factory returns ``(model in eval mode, args, kwargs)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torchvision
import transformers
from torch import nn
from torchvision.models import detection, segmentation

transformers.logging.set_verbosity_error()

Factory = Callable[[], tuple[nn.Module, tuple[Any, ...], dict[str, Any]]]

_VOCAB = 96
_TEXT = dict(vocab_size=_VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
             intermediate_size=64)


def _image(size: int = 32, batch: int = 1) -> torch.Tensor:
    return torch.randn(batch, 3, size, size)


def _ids(batch: int = 1, seq: int = 12) -> torch.Tensor:
    return torch.randint(1, _VOCAB, (batch, seq))


# --- torchvision ----------------------------------------------------------------------------


def _tv(name: str, size: int = 32, **kwargs: Any) -> Factory:
    def make() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
        model = getattr(torchvision.models, name)(weights=None, num_classes=10, **kwargs)
        return model.eval(), (_image(size),), {}
    return make


def _segmentation(name: str, size: int = 64) -> Factory:
    def make() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
        model = getattr(segmentation, name)(weights=None, weights_backbone=None, num_classes=5)
        return model.eval(), (_image(size),), {}
    return make


def _fpn(backbone: str) -> Factory:
    def make() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
        model = detection.backbone_utils.resnet_fpn_backbone(
            backbone_name=backbone, weights=None, trainable_layers=5)
        return model.eval(), (_image(64),), {}
    return make


def _mobilenet_fpn() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    model = detection.backbone_utils.mobilenet_backbone(
        backbone_name="mobilenet_v3_large", weights=None, fpn=True, trainable_layers=6)
    return model.eval(), (_image(64),), {}


TORCHVISION: dict[str, Factory] = {
    "tv_resnet18": _tv("resnet18"),
    "tv_resnet50": _tv("resnet50"),
    "tv_resnext50_32x4d": _tv("resnext50_32x4d"),
    "tv_mobilenet_v2": _tv("mobilenet_v2"),
    "tv_mobilenet_v3_small": _tv("mobilenet_v3_small"),
    "tv_mobilenet_v3_large": _tv("mobilenet_v3_large"),
    "tv_efficientnet_b0": _tv("efficientnet_b0"),
    "tv_regnet_y_400mf": _tv("regnet_y_400mf"),
    "tv_regnet_x_400mf": _tv("regnet_x_400mf"),
    "tv_shufflenet_v2_x0_5": _tv("shufflenet_v2_x0_5"),
    "tv_squeezenet1_1": _tv("squeezenet1_1"),
    "tv_densenet121": _tv("densenet121", size=32),
    "tv_mnasnet0_5": _tv("mnasnet0_5"),
    "tv_googlenet": _tv("googlenet", aux_logits=False, init_weights=False),
    "tv_convnext_tiny": _tv("convnext_tiny", size=32),
    "tv_vit_b_16": _tv("vit_b_16", size=32, image_size=32),
    "tv_swin_t": _tv("swin_t", size=32),
    "tv_fcn_resnet50": _segmentation("fcn_resnet50"),
    "tv_deeplabv3_mobilenet_v3_large": _segmentation("deeplabv3_mobilenet_v3_large"),
    "tv_lraspp_mobilenet_v3_large": _segmentation("lraspp_mobilenet_v3_large"),
    "tv_resnet18_fpn_backbone": _fpn("resnet18"),
    "tv_mobilenet_v3_fpn_backbone": _mobilenet_fpn,
}


# --- timm -----------------------------------------------------------------------------------


def _timm(name: str, size: int = 32, **kwargs: Any) -> Factory:
    def make() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
        import timm

        model = timm.create_model(name, pretrained=False, num_classes=10, **kwargs)
        return model.eval(), (_image(size),), {}
    return make


TIMM: dict[str, Factory] = {
    "timm_resnet18d": _timm("resnet18d"),
    "timm_efficientnet_b0": _timm("efficientnet_b0"),
    "timm_mobilenetv3_small_050": _timm("mobilenetv3_small_050"),
    "timm_convnext_atto": _timm("convnext_atto"),
    "timm_vit_tiny_patch16": _timm("vit_tiny_patch16_224", size=32, img_size=32),
    "timm_deit_tiny": _timm("deit_tiny_patch16_224", size=32, img_size=32),
    "timm_regnetx_002": _timm("regnetx_002"),
    "timm_ghostnet_100": _timm("ghostnet_100"),
    "timm_mixer_s32": _timm("mixer_s32_224", img_size=32),
    "timm_levit_128s": _timm("levit_128s", size=64, img_size=64),
}


# --- transformers ---------------------------------------------------------------------------


def _encoder(model_cls: Any, config: Any, mask: bool = True) -> Factory:
    def make() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
        model = model_cls(config).eval()
        ids = _ids()
        kwargs = {"attention_mask": torch.ones_like(ids)} if mask else {}
        return model, (ids,), kwargs
    return make


def _t5() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    config = transformers.T5Config(vocab_size=_VOCAB, d_model=32, d_kv=16, d_ff=64,
                                   num_layers=2, num_decoder_layers=2, num_heads=2,
                                   decoder_start_token_id=0, use_cache=False)
    model = transformers.T5Model(config).eval()
    return model, (_ids(),), {"decoder_input_ids": _ids(seq=5)}


def _t5_encoder() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    config = transformers.T5Config(vocab_size=_VOCAB, d_model=32, d_kv=16, d_ff=64,
                                   num_layers=2, num_heads=2)
    return transformers.T5EncoderModel(config).eval(), (_ids(),), {}


def _bart() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    config = transformers.BartConfig(vocab_size=_VOCAB, d_model=32, encoder_layers=2,
                                     decoder_layers=2, encoder_attention_heads=2,
                                     decoder_attention_heads=2, encoder_ffn_dim=64,
                                     decoder_ffn_dim=64, max_position_embeddings=64,
                                     use_cache=False)
    model = transformers.BartModel(config).eval()
    return model, (_ids(),), {"decoder_input_ids": _ids(seq=5)}


def _decoder(model_cls: Any, config: Any) -> Factory:
    def make() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
        return model_cls(config).eval(), (_ids(),), {"use_cache": False}
    return make


def _vit() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    config = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                    intermediate_size=64, image_size=32, patch_size=8)
    return transformers.ViTModel(config).eval(), (_image(32),), {}


def _whisper_encoder() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    config = transformers.WhisperConfig(vocab_size=_VOCAB, d_model=32, encoder_layers=2,
                                        encoder_attention_heads=2, decoder_layers=2,
                                        decoder_attention_heads=2, encoder_ffn_dim=64,
                                        decoder_ffn_dim=64, num_mel_bins=16,
                                        max_source_positions=16, pad_token_id=0,
                                        bos_token_id=0, eos_token_id=0,
                                        decoder_start_token_id=0)
    model = transformers.WhisperModel(config).get_encoder().eval()
    # The encoder's two convolutions halve the frames: 32 mel frames -> 16 positions.
    return model, (torch.randn(1, 16, 32),), {}


def _clip_text() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    config = transformers.CLIPTextConfig(vocab_size=_VOCAB, hidden_size=32, num_hidden_layers=2,
                                         num_attention_heads=2, intermediate_size=64,
                                         max_position_embeddings=32)
    return _encoder(transformers.CLIPTextModel, config)()


def _clip_vision() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    config = transformers.CLIPVisionConfig(hidden_size=32, num_hidden_layers=2,
                                           num_attention_heads=2, intermediate_size=64,
                                           image_size=32, patch_size=8)
    return transformers.CLIPVisionModel(config).eval(), (_image(32),), {}


_GPT2 = transformers.GPT2Config(vocab_size=_VOCAB, n_embd=32, n_layer=2, n_head=2,
                                n_positions=64, bos_token_id=0, eos_token_id=0)
_LLAMA_LIKE = dict(**_TEXT, num_key_value_heads=1, max_position_embeddings=64)

TRANSFORMERS: dict[str, Factory] = {
    "hf_bert": _encoder(transformers.BertModel, transformers.BertConfig(**_TEXT)),
    "hf_roberta": _encoder(transformers.RobertaModel,
                           transformers.RobertaConfig(**_TEXT, pad_token_id=0)),
    "hf_distilbert": _encoder(transformers.DistilBertModel, transformers.DistilBertConfig(
        vocab_size=_VOCAB, dim=32, n_layers=2, n_heads=2, hidden_dim=64)),
    "hf_albert": _encoder(transformers.AlbertModel, transformers.AlbertConfig(
        **_TEXT, embedding_size=16)),
    "hf_electra": _encoder(transformers.ElectraModel, transformers.ElectraConfig(
        **_TEXT, embedding_size=16)),
    "hf_gpt2": _decoder(transformers.GPT2Model, _GPT2),
    "hf_gpt2_lm_head": _decoder(transformers.GPT2LMHeadModel, _GPT2),
    "hf_llama": _decoder(transformers.LlamaModel, transformers.LlamaConfig(**_LLAMA_LIKE)),
    "hf_mistral": _decoder(transformers.MistralModel,
                           transformers.MistralConfig(**_LLAMA_LIKE, sliding_window=8)),
    "hf_qwen2": _decoder(transformers.Qwen2Model, transformers.Qwen2Config(**_LLAMA_LIKE)),
    "hf_t5": _t5,
    "hf_t5_encoder": _t5_encoder,
    "hf_bart": _bart,
    "hf_vit": _vit,
    "hf_whisper_encoder": _whisper_encoder,
    "hf_clip_text": _clip_text,
    "hf_clip_vision": _clip_vision,
}


def corpus() -> dict[str, Factory]:
    """Every model, by name; timm's only when timm is installed."""
    models = {**TORCHVISION, **TRANSFORMERS}
    try:
        import timm  # noqa: F401
    except ImportError:
        return models
    return {**models, **TIMM}
