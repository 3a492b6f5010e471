"""The causal LM the ``autoopt generate`` example names as ``tiny_lm.py:make_model`` (see
generation.py): a tiny Llama-style decoder from a config, random weights."""

import transformers


def make_model() -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=256)
    return transformers.LlamaForCausalLM(config).eval()


if __name__ == "__main__":
    print(type(make_model()).__name__)
