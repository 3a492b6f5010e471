"""The real-model corpus: torchvision, timm and transformers architectures with random weights
at small sizes. Nothing is downloaded: no pretrained weights, configs built in code.

Each factory returns ``(model, args, kwargs)``. A model in eval mode is optimized for inference;
one in train mode (``TRAINING``, dropout probabilities set to 0 so that eager and the optimized
module compute the same function) is optimized with ``training=True`` and checked with
gradients.
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


def _tv(name: str, size: int = 32, batch: int = 1, **kwargs: Any) -> Factory:
    def make() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
        model = getattr(torchvision.models, name)(weights=None, num_classes=10, **kwargs)
        return model.eval(), (_image(size, batch),), {}
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


def _detection(name: str) -> Factory:
    def make() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
        model = getattr(detection, name)(weights=None, weights_backbone=None, num_classes=3,
                                         min_size=64, max_size=64)
        return model.eval(), ([torch.rand(3, 64, 64)],), {}
    return make


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
    "tv_fasterrcnn_mobilenet_v3_large_320_fpn": _detection("fasterrcnn_mobilenet_v3_large_320_fpn"),
    "tv_retinanet_resnet50_fpn": _detection("retinanet_resnet50_fpn"),
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
    "timm_swin_tiny": _timm("swin_tiny_patch4_window7_224", size=64, img_size=64, window_size=2),
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


def _decoder(model_cls: Any, config: Any, use_cache: bool = False) -> Factory:
    """A decoder-only stack; ``use_cache=True`` leaves the model's default, which returns a
    ``DynamicCache`` with the logits."""
    def make() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
        kwargs = {} if use_cache else {"use_cache": False}
        return model_cls(config).eval(), (_ids(),), kwargs
    return make


def _t5_lm(dropout_rate: float = 0.1) -> Factory:
    """T5 with its LM head and the default ``use_cache``: an ``EncoderDecoderCache`` out."""
    def make() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
        config = transformers.T5Config(vocab_size=_VOCAB, d_model=32, d_kv=16, d_ff=64,
                                       num_layers=2, num_decoder_layers=2, num_heads=2,
                                       decoder_start_token_id=0, dropout_rate=dropout_rate)
        model = transformers.T5ForConditionalGeneration(config).eval()
        return model, (_ids(),), {"decoder_input_ids": _ids(seq=5)}
    return make


def _bart_lm() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    config = transformers.BartConfig(vocab_size=_VOCAB, d_model=32, encoder_layers=2,
                                     decoder_layers=2, encoder_attention_heads=2,
                                     decoder_attention_heads=2, encoder_ffn_dim=64,
                                     decoder_ffn_dim=64, max_position_embeddings=64)
    model = transformers.BartForConditionalGeneration(config).eval()
    return model, (_ids(),), {"decoder_input_ids": _ids(seq=5)}


def _whisper() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    """Whisper encoder-decoder with its LM head and cache."""
    model = transformers.WhisperForConditionalGeneration(_WHISPER).eval()
    return model, (torch.randn(1, 16, 32),), {"decoder_input_ids": _ids(seq=5)}


def _clip() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    """CLIP text and vision towers with the similarity logits."""
    config = transformers.CLIPConfig(text_config=_CLIP_TEXT.to_dict(),
                                     vision_config=_CLIP_VISION.to_dict(), projection_dim=16)
    model = transformers.CLIPModel(config).eval()
    ids = _ids(batch=2)
    return model, (ids,), {"pixel_values": _image(32, batch=2),
                           "attention_mask": torch.ones_like(ids)}


def _vit() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    config = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                    intermediate_size=64, image_size=32, patch_size=8)
    return transformers.ViTModel(config).eval(), (_image(32),), {}


_WHISPER = transformers.WhisperConfig(vocab_size=_VOCAB, d_model=32, encoder_layers=2,
                                      encoder_attention_heads=2, decoder_layers=2,
                                      decoder_attention_heads=2, encoder_ffn_dim=64,
                                      decoder_ffn_dim=64, num_mel_bins=16,
                                      max_source_positions=16, max_target_positions=32,
                                      pad_token_id=0, bos_token_id=0, eos_token_id=0,
                                      decoder_start_token_id=0)


def _whisper_encoder() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    model = transformers.WhisperModel(_WHISPER).get_encoder().eval()
    # The encoder's two convolutions halve the frames: 32 mel frames -> 16 positions.
    return model, (torch.randn(1, 16, 32),), {}


_CLIP_TEXT = transformers.CLIPTextConfig(vocab_size=_VOCAB, hidden_size=32, num_hidden_layers=2,
                                         num_attention_heads=2, intermediate_size=64,
                                         max_position_embeddings=32)
_CLIP_VISION = transformers.CLIPVisionConfig(hidden_size=32, num_hidden_layers=2,
                                             num_attention_heads=2, intermediate_size=64,
                                             image_size=32, patch_size=8)


def _clip_text() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    return _encoder(transformers.CLIPTextModel, _CLIP_TEXT)()


def _clip_vision() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    return transformers.CLIPVisionModel(_CLIP_VISION).eval(), (_image(32),), {}


_GPT2 = transformers.GPT2Config(vocab_size=_VOCAB, n_embd=32, n_layer=2, n_head=2,
                                n_positions=64, bos_token_id=0, eos_token_id=0)
_LLAMA_LIKE = dict(**_TEXT, num_key_value_heads=1, max_position_embeddings=64)
_LLAMA = transformers.LlamaConfig(**_LLAMA_LIKE)
_MISTRAL = transformers.MistralConfig(**_LLAMA_LIKE, sliding_window=8)
_QWEN2 = transformers.Qwen2Config(**_LLAMA_LIKE)
_PHI3 = transformers.Phi3Config(**_LLAMA_LIKE, pad_token_id=0)
_GEMMA = transformers.GemmaConfig(**_LLAMA_LIKE, head_dim=16)
_GEMMA2 = transformers.Gemma2Config(**_LLAMA_LIKE, head_dim=16, sliding_window=8)

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
    "hf_gpt2_lm_head_cache": _decoder(transformers.GPT2LMHeadModel, _GPT2, use_cache=True),
    "hf_llama": _decoder(transformers.LlamaModel, _LLAMA),
    "hf_llama_lm_head_cache": _decoder(transformers.LlamaForCausalLM, _LLAMA, use_cache=True),
    "hf_mistral": _decoder(transformers.MistralModel, _MISTRAL),
    "hf_mistral_lm_head_cache": _decoder(transformers.MistralForCausalLM, _MISTRAL,
                                         use_cache=True),
    "hf_qwen2": _decoder(transformers.Qwen2Model, _QWEN2),
    "hf_qwen2_lm_head_cache": _decoder(transformers.Qwen2ForCausalLM, _QWEN2, use_cache=True),
    "hf_phi3": _decoder(transformers.Phi3Model, _PHI3),
    "hf_phi3_lm_head_cache": _decoder(transformers.Phi3ForCausalLM, _PHI3, use_cache=True),
    "hf_gemma_lm_head_cache": _decoder(transformers.GemmaForCausalLM, _GEMMA, use_cache=True),
    "hf_gemma2_lm_head_cache": _decoder(transformers.Gemma2ForCausalLM, _GEMMA2,
                                        use_cache=True),
    "hf_t5": _t5,
    "hf_t5_lm_head_cache": _t5_lm(),
    "hf_t5_encoder": _t5_encoder,
    "hf_bart": _bart,
    "hf_bart_lm_head_cache": _bart_lm,
    "hf_vit": _vit,
    "hf_whisper_encoder": _whisper_encoder,
    "hf_whisper_cache": _whisper,
    "hf_clip_text": _clip_text,
    "hf_clip_vision": _clip_vision,
    "hf_clip": _clip,
}


# --- train mode -----------------------------------------------------------------------------


def _train(factory: Factory) -> Factory:
    """The same model in train mode (its config has every dropout probability at 0)."""
    def make() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
        model, args, kwargs = factory()
        return model.train(), args, kwargs
    return make


_NO_DROPOUT_GPT2 = transformers.GPT2Config(**{**_GPT2.to_dict(), "resid_pdrop": 0.0,
                                              "embd_pdrop": 0.0, "attn_pdrop": 0.0})

TRAINING: dict[str, Factory] = {
    # GPT-2 with its cache (the default: a DynamicCache out of a train-mode model) and without.
    "train_hf_gpt2_lm_head_cache": _train(_decoder(transformers.GPT2LMHeadModel,
                                                   _NO_DROPOUT_GPT2, use_cache=True)),
    "train_hf_gpt2": _train(_decoder(transformers.GPT2Model, _NO_DROPOUT_GPT2)),
    "train_hf_llama_lm_head_cache": _train(_decoder(transformers.LlamaForCausalLM, _LLAMA,
                                                    use_cache=True)),
    "train_hf_t5_lm_head_cache": _train(_t5_lm(dropout_rate=0.0)),
    "train_hf_bert": _train(_encoder(transformers.BertModel, transformers.BertConfig(
        **_TEXT, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))),
    "train_hf_distilbert": _train(_encoder(transformers.DistilBertModel,
                                           transformers.DistilBertConfig(
        vocab_size=_VOCAB, dim=32, n_layers=2, n_heads=2, hidden_dim=64, dropout=0.0,
        attention_dropout=0.0))),
    "train_hf_vit": _train(_vit),  # ViTConfig's dropouts are 0 by default
    # BatchNorm in train mode: batch statistics (a batch of 2), running statistics updated.
    "train_tv_resnet18": _train(_tv("resnet18", size=64, batch=2)),
}


def corpus() -> dict[str, Factory]:
    """Every model, by name; timm's only when timm is installed."""
    models = {**TORCHVISION, **TRANSFORMERS}
    try:
        import timm  # noqa: F401
    except ImportError:
        return {**models, **TRAINING}
    return {**models, **TIMM, **TRAINING}
