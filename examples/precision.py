"""Reduced precision: bf16 and int8 where the error stays within a tolerance and the
measurement says faster (README "Precision", docs/precision.md).

On a CPU without a fast bf16 matmul (AMX, AVX-512 BF16) or int8 kernels (VNNI), optimize
raises a ConfigError that says so, instead of returning an fp32 module.
"""

import torch
import transformers

import autoopt

config = transformers.BertConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, intermediate_size=256)
model = transformers.BertModel(config).eval()
ids = torch.randint(0, 1000, (2, 32))
for precision in ("bf16", "int8"):
    try:
        fast = autoopt.optimize(model, (ids,), precision=precision)
    except autoopt.ConfigError as refused:     # not faster, or not within the tolerance here
        print(f"{precision}: {refused}")
    else:
        print(fast.report)                     # ops in low precision, ops kept and why, error
