"""Run a model as a pipeline across processes with autoopt's cut (torch.distributed.pipelining).

    torchrun --standalone --nproc-per-node 2 examples/pipeline_torchrun.py [--check]

Each process builds the same small GPT-2 (same seed: same weights); rank 0 profiles the graph
and cuts it into one stage per process; every rank runs its stage. First inference (GPipe over
4 microbatches), then one training step (1F1B) with a mean-squared-error loss. With ``--check``
each rank compares with eager PyTorch (the last rank the output, every rank its parameters'
gradients) and exits non-zero on a mismatch. Uses gloo on CPU, NCCL on GPUs.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
import torch.distributed as dist
import transformers

from autoopt.parallel.distributed import distributed_pipeline


def small_gpt2(layers: int) -> torch.nn.Module:
    config = transformers.GPT2Config(vocab_size=128, n_embd=32, n_layer=layers, n_head=2,
                                     n_positions=64, use_cache=False, bos_token_id=0,
                                     eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0)
    return transformers.GPT2Model(config)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with eager")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4, help="GPT-2 blocks")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else "cpu"
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = small_gpt2(args.layers).eval()
    ids = torch.randint(0, 128, (8, 16))
    target = torch.randn(8, 16, 32)
    failures = []

    # Inference: GPipe over microbatches; the output arrives on the last rank.
    pipe = distributed_pipeline(model, (ids,), microbatches=args.microbatches, device=device)
    if rank == 0:
        print(pipe.plan.table(), flush=True)
    with torch.no_grad():
        out = pipe.step(ids)
        expected = model(ids).last_hidden_state
    if pipe.is_last and args.check:
        error = (out.last_hidden_state.cpu() - expected).abs().max().item()
        print(f"rank {rank}: inference output max abs error {error:.2e}", flush=True)
        if not torch.allclose(out.last_hidden_state.cpu(), expected, rtol=1e-4, atol=1e-5):
            failures.append("inference output")

    # Training: 1F1B; gradients land in this rank's stage module.
    train_model = copy.deepcopy(model).train()
    loss_fn = lambda output, labels: torch.nn.functional.mse_loss(  # noqa: E731
        output.last_hidden_state, labels)
    pipe = distributed_pipeline(train_model, (ids,), microbatches=args.microbatches,
                                device=device, training=True, schedule="1f1b", loss_fn=loss_fn)
    pipe.step(ids, target=target.to(device))
    if args.check:
        reference = copy.deepcopy(train_model)
        torch.nn.functional.mse_loss(reference(ids).last_hidden_state, target).backward()
        grads = dict(reference.named_parameters())
        worst = 0.0
        for name, param in pipe.module.named_parameters():
            if param.grad is None:
                failures.append(f"no gradient for {name}")
                continue
            worst = max(worst, (param.grad.cpu() - grads[name].grad).abs().max().item())
            if not torch.allclose(param.grad.cpu(), grads[name].grad, rtol=1e-4, atol=1e-6):
                failures.append(f"gradient of {name}")
        count = sum(1 for _ in pipe.module.parameters())
        print(f"rank {rank}: {count} parameters, gradient max abs error {worst:.2e}",
              flush=True)
    dist.barrier()
    dist.destroy_process_group()
    if failures:
        print(f"rank {rank}: MISMATCH: {failures[:5]}", flush=True)
        return 1
    if args.check:
        print(f"rank {rank}: matches eager", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
