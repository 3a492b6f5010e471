"""ONNX export checked under ONNX Runtime, and running the file (README "ONNX",
docs/onnx.md). A tiny BERT from a config: random weights, nothing downloaded."""

import shlex

import torch
import transformers

import autoopt
from autoopt.cli import main as autoopt_command  # the `autoopt` program, in this process

config = transformers.BertConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, intermediate_size=128)
model = transformers.BertModel(config).eval()
ids = torch.randint(0, 1000, (2, 32))
mask = torch.ones_like(ids)
report = autoopt.export_onnx(model, (ids,), "bert.onnx", example_kwargs={"attention_mask": mask},
                             dynamic=("batch", "sequence"))
print(report)         # exporter, opset, inputs/outputs, nodes before/after ORT, max error
session = autoopt.onnx_session("bert.onnx")        # device="cuda": TensorRT, CUDA, CPU
hidden, pooled = session(ids, attention_mask=mask)  # torch tensors in and out
print(hidden.shape, pooled.shape)

# The same from the command line (my_model.py is in this folder), then the file run under
# ONNX Runtime on random inputs.
COMMANDS = """
autoopt export my_model.py:Net --input input_ids=2x128:int64 -o net.onnx --dynamic batch
autoopt run net.onnx --input input_ids=8x128 --bench 20
"""
for command in COMMANDS.strip().splitlines():
    print(f"$ {command}", flush=True)
    assert autoopt_command(shlex.split(command)[1:]) == 0, command  # as the shell runs it
