"""Decoding with a causal LM through autoopt's graphs (README "Generation", docs/generation.md).

A tiny Llama-style model from a config: random weights, nothing downloaded.
"""

import shlex

import torch
import transformers

import autoopt
from autoopt.cli import main as autoopt_command  # the `autoopt` program, in this process

config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, max_position_embeddings=256)
llm = transformers.LlamaForCausalLM(config).eval()      # or from_pretrained(...)
prompt_ids = torch.randint(0, 128, (1, 16))
fast = autoopt.optimize(llm, (prompt_ids,))             # precision="int8": int8 weights
tokens = fast.generate(prompt_ids, max_new_tokens=32, do_sample=False)
eager = llm.generate(prompt_ids, max_new_tokens=32, do_sample=False)
print(tokens.shape, "the same tokens as eager:", torch.equal(tokens, eager))

# eager model.generate against fast.generate from the command line: time to first token,
# decode tokens/s, whether the tokens are eager's.
COMMANDS = """
autoopt generate tiny_lm.py:make_model --prompt-len 16 --new 32 --rounds 1
"""
for command in COMMANDS.strip().splitlines():
    print(f"$ {command}", flush=True)
    assert autoopt_command(shlex.split(command)[1:]) == 0, command  # as the shell runs it
