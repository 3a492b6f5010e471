"""A transformers Llama or GPT-2 model written as a GGUF file, for llama.cpp's rows in
``bench/generate.py``: the same weights, at f32, f16, Q8_0 or Q4_0, through the ``gguf``
package (llama.cpp's own writer and quantizers).

What llama.cpp's ``convert_hf_to_gguf.py`` does for these two architectures, reduced to what a
model built in code has: Llama's Q and K rows permuted for llama.cpp's RoPE layout, GPT-2's
``Conv1D`` weights transposed to ``(out, in)`` and its tied head written as ``output``.
Norms and biases stay f32, as the converter keeps them. Quantized files are "pure" (every
matrix, the embedding and head included, in the named type), as ``llama-quantize --pure``
writes them: llama-quantize's default Q4_0 keeps the head in Q6_K. The vocabulary is made-up
tokens (``<0>``, ``<1>``, ...): the bench feeds token ids, never text.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

# The file types the bench writes, by llama.cpp's names.
TYPES = ("f32", "f16", "Q8_0", "Q4_0")


def available() -> str | None:
    """None where llama.cpp's Python binding and the gguf writer import; else why not."""
    try:
        import gguf  # noqa: F401
        import llama_cpp  # noqa: F401
    except ImportError as exc:
        return (f"llama-cpp-python and gguf not installed ({exc.name}): pip install "
                f"llama-cpp-python gguf (builds llama.cpp from source)")
    return None


def write(model: nn.Module, path: Path, kind: str) -> Path:
    """``model`` (a ``LlamaForCausalLM`` or ``GPT2LMHeadModel``) as a GGUF file of ``kind``."""
    import gguf

    config = model.config
    arch = {"llama": "llama", "gpt2": "gpt2"}[config.model_type]
    writer = gguf.GGUFWriter(str(path), arch)
    matrix = {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
              "Q8_0": gguf.GGMLQuantizationType.Q8_0,
              "Q4_0": gguf.GGMLQuantizationType.Q4_0}[kind]
    writer.add_file_type({"f32": gguf.LlamaFileType.ALL_F32,
                          "f16": gguf.LlamaFileType.MOSTLY_F16,
                          "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
                          "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[kind])
    tensors = _llama(model, writer) if arch == "llama" else _gpt2(model, writer)
    _vocabulary(writer, config, arch)
    for name, tensor in tensors.items():
        data = tensor.detach().float().contiguous().numpy()
        if data.ndim == 1 or matrix == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, data.astype(np.float32))
        elif matrix == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(name, data.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(data, matrix), raw_dtype=matrix)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _permute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    # transformers' rotary layout (halves) to llama.cpp's (interleaved pairs), per head.
    return (weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _llama(model: nn.Module, writer: object) -> dict[str, torch.Tensor]:
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_rope_dimension_count(head_dim)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(float(getattr(config, "rope_theta", None) or (
        config.rope_parameters or {}).get("rope_theta", 10000.0)))
    inner = model.model
    tensors = {"token_embd.weight": inner.embed_tokens.weight,
               "output_norm.weight": inner.norm.weight,
               "output.weight": model.lm_head.weight}
    for i, layer in enumerate(inner.layers):
        attn, mlp = layer.self_attn, layer.mlp
        tensors.update({
            f"blk.{i}.attn_norm.weight": layer.input_layernorm.weight,
            f"blk.{i}.attn_q.weight": _permute(attn.q_proj.weight, heads),
            f"blk.{i}.attn_k.weight": _permute(attn.k_proj.weight, kv_heads),
            f"blk.{i}.attn_v.weight": attn.v_proj.weight,
            f"blk.{i}.attn_output.weight": attn.o_proj.weight,
            f"blk.{i}.ffn_norm.weight": layer.post_attention_layernorm.weight,
            f"blk.{i}.ffn_gate.weight": mlp.gate_proj.weight,
            f"blk.{i}.ffn_up.weight": mlp.up_proj.weight,
            f"blk.{i}.ffn_down.weight": mlp.down_proj.weight})
    return tensors


def _gpt2(model: nn.Module, writer: object) -> dict[str, torch.Tensor]:
    config = model.config
    writer.add_context_length(config.n_positions)
    writer.add_embedding_length(config.n_embd)
    writer.add_block_count(config.n_layer)
    writer.add_feed_forward_length(config.n_inner or 4 * config.n_embd)
    writer.add_head_count(config.n_head)
    writer.add_layer_norm_eps(config.layer_norm_epsilon)
    inner = model.transformer
    tensors = {"token_embd.weight": inner.wte.weight, "position_embd.weight": inner.wpe.weight,
               "output_norm.weight": inner.ln_f.weight, "output_norm.bias": inner.ln_f.bias,
               "output.weight": model.lm_head.weight}
    for i, block in enumerate(inner.h):
        # Conv1D stores (in, out): llama.cpp multiplies by (out, in).
        tensors.update({
            f"blk.{i}.attn_norm.weight": block.ln_1.weight,
            f"blk.{i}.attn_norm.bias": block.ln_1.bias,
            f"blk.{i}.attn_qkv.weight": block.attn.c_attn.weight.t(),
            f"blk.{i}.attn_qkv.bias": block.attn.c_attn.bias,
            f"blk.{i}.attn_output.weight": block.attn.c_proj.weight.t(),
            f"blk.{i}.attn_output.bias": block.attn.c_proj.bias,
            f"blk.{i}.ffn_norm.weight": block.ln_2.weight,
            f"blk.{i}.ffn_norm.bias": block.ln_2.bias,
            f"blk.{i}.ffn_up.weight": block.mlp.c_fc.weight.t(),
            f"blk.{i}.ffn_up.bias": block.mlp.c_fc.bias,
            f"blk.{i}.ffn_down.weight": block.mlp.c_proj.weight.t(),
            f"blk.{i}.ffn_down.bias": block.mlp.c_proj.bias})
    return tensors


def _vocabulary(writer: object, config: object, arch: str) -> None:
    import gguf

    size = config.vocab_size
    tokens = [f"<{i}>" for i in range(size)]
    if arch == "llama":
        writer.add_tokenizer_model("llama")
        writer.add_token_scores([0.0] * size)
    else:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("gpt-2")
        writer.add_token_merges(["< 0"])  # llama.cpp's BPE loader needs a merge list
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.NORMAL] * size)
    writer.add_bos_token_id(config.bos_token_id or 0)
    writer.add_eos_token_id(config.eos_token_id or 0)


class Runner:
    """llama.cpp on one GGUF file, called as ``bench/generate.py`` calls every runner:
    ``generate(ids, max_new_tokens=..., logits_processor=...)``, greedy, batch 1. Each step's
    logits go through the logits processors (the first-token mark, teacher forcing) as in
    transformers' loop; ``eval`` of one token is llama.cpp's decode step."""

    def __init__(self, path: Path, threads: int, context: int) -> None:
        import llama_cpp

        self.llm = llama_cpp.Llama(model_path=str(path), n_ctx=context, n_threads=threads,
                                   n_threads_batch=threads, n_batch=512, verbose=False)

    def generate(self, ids: torch.Tensor, max_new_tokens: int, logits_processor: object = None,
                 **_: object) -> torch.Tensor:
        if ids.shape[0] != 1:
            raise ValueError("the llama.cpp runner decodes batch 1 only")
        llm = self.llm
        llm.reset()
        tokens = ids[0].tolist()
        llm.eval(tokens)
        for step in range(max_new_tokens):
            # The last token's logits, read from the context (llama-cpp-python 0.3 copies
            # them into ``scores`` only with logits_all, which computes every row's).
            scores = torch.from_numpy(np.ctypeslib.as_array(
                llm._ctx.get_logits(), shape=(llm.n_vocab(),)).copy())[None]
            for processor in logits_processor or ():
                scores = processor(torch.tensor([tokens]), scores)
            tokens.append(int(scores.argmax()))
            if step + 1 < max_new_tokens:
                llm.eval(tokens[-1:])
        return torch.tensor([tokens])
