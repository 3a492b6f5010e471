"""Training under a memory budget for saved activations (README "Training",
docs/memory.md). A tiny GPT-2 from a config: random weights, nothing downloaded."""

import torch
import transformers

import autoopt

config = transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4,
                                 n_positions=64, use_cache=False)
model = transformers.GPT2LMHeadModel(config).train()
ids = torch.randint(0, 128, (4, 64))
fast = autoopt.optimize(model, (ids,), {"labels": ids}, training=True,
                        memory_budget="2MiB")       # or "8GiB", bytes, 0.5 of the device
fast(ids, labels=ids).loss.backward()   # eager's loss and gradients, fewer bytes saved
print(fast.report)                      # the plan: keep, recompute, selective, offload
