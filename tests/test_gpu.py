"""The same guarantees on a CUDA device (skipped with a reason where there is none)."""

from __future__ import annotations

import pytest
import torch
from checks import assert_same_function
from model_zoo import REAL_MODELS

import autoopt


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["resnet18", "bert", "gpt2"])
def test_optimize_on_cuda_matches_eager(name: str) -> None:
    model, args, kwargs = REAL_MODELS[name]()
    model = model.cuda()
    args = tuple(a.cuda() for a in args)
    kwargs = {k: v.cuda() for k, v in kwargs.items()}
    fast = autoopt.optimize(model, args, kwargs)
    assert fast.report.captures[0].verification.ok
    # TF32 convolutions move a folded BatchNorm's output by more than fp32's tolerance:
    # verification allows TF32's, so no pass is rolled back on a GPU.
    assert fast.report.rolled_back == [], fast.report
    assert next(fast.parameters()).device.type == "cuda"
    assert_same_function(model, fast, args, kwargs)


@pytest.mark.gpu
def test_device_argument_moves_the_private_copy_only() -> None:
    model, args, _ = REAL_MODELS["resnet18"]()
    fast = autoopt.optimize(model, args, device="cuda")
    assert next(model.parameters()).device.type == "cpu"
    out = fast(args[0].cuda())
    torch.testing.assert_close(out.cpu(), model(*args), rtol=1e-3, atol=1e-3)


@pytest.mark.gpu
def test_cuda_graph_replays_static_inference_and_matches_eager() -> None:
    model, args, _ = REAL_MODELS["resnet18"]()
    model = model.cuda().eval()
    x = args[0].cuda()
    fast = autoopt.optimize(model, (x,))
    assert fast.report.captures[0].cuda_graph == "recorded", fast.report
    with torch.no_grad():
        x1, x2 = torch.randn_like(x), torch.randn_like(x)
        out1 = fast(x1)
        out2 = fast(x2)  # must not overwrite out1 (outputs are copies of the replay's buffers)
        torch.testing.assert_close(out1, model(x1), rtol=1e-3, atol=1e-3)
        torch.testing.assert_close(out2, model(x2), rtol=1e-3, atol=1e-3)
    plain = autoopt.optimize(model, (x,), cuda_graphs=False)
    assert plain.report.captures[0].cuda_graph == ""


@pytest.mark.gpu
def test_cuda_inference_shares_weights_and_a_replay_sees_loaded_ones() -> None:
    """On CUDA too: the inference module reads the model's weights in place, and after a load
    the recorded CUDA graph (which holds folded copies and fixed addresses) is not replayed."""
    model, args, _ = REAL_MODELS["resnet18"]()
    other, _, _ = REAL_MODELS["resnet18"]()
    model, other = model.cuda().eval(), other.cuda().eval()
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(0.5)
    x = args[0].cuda()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fast = autoopt.optimize(model, (x,))
    assert all(p.data_ptr() == q.data_ptr()
               for p, q in zip(fast.module.parameters(), model.parameters(), strict=True))
    with torch.no_grad():
        fast(x)
        fast.module.load_state_dict(other.state_dict())
        torch.testing.assert_close(fast(x), other(x), rtol=1e-3, atol=1e-3)
    # Yours was not written: fast took its own memory before the load.
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


@pytest.mark.gpu
def test_a_cuda_graph_copies_what_it_writes_into_its_inputs_back() -> None:
    """The replay writes into the recorded input buffers; a function that writes its inputs
    in place (a static KV cache) must leave the caller's tensors written, call after call."""
    from autoopt.runtime import cuda_graphs

    def step(cache: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        cache.add_(x)
        return cache * 2

    cache, x = torch.zeros(4, device="cuda"), torch.ones(4, device="cuda")
    with torch.no_grad():
        runner, why = cuda_graphs.record(step, (cache.clone(), x), {})
        assert not why, why
        for calls in (1, 2, 3):
            out = runner(cache, x)
            torch.testing.assert_close(cache, torch.full((4,), float(calls), device="cuda"))
            torch.testing.assert_close(out, 2 * cache)


@pytest.mark.gpu
def test_decode_steps_replay_a_cuda_graph_with_eager_s_tokens() -> None:
    import transformers

    config = transformers.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4,
                                     n_positions=64, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config).cuda().eval()
    ids = torch.randint(1, 128, (2, 6), device="cuda")
    fast = autoopt.optimize(model, (ids,))
    options = dict(max_new_tokens=8, do_sample=False)
    for _ in range(2):  # the second call's prompt step runs through a graph too
        assert torch.equal(fast.generate(ids, **options), model.generate(ids, **options))
    decode = fast._generator.reports[0].captures[0]
    assert decode.cuda_graph == "recorded", fast._generator.reports[0]
