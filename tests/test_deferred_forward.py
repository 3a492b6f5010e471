"""``optimize`` of a model that generates: the forward graph waits for the first forward call
(``generate`` builds its own step graphs), the example call still checked at ``optimize``."""

from __future__ import annotations

import pytest
import torch
import transformers
from checks import assert_bit_identical, snapshot
from model_zoo import llama_lm
from torch import nn

import autoopt
from autoopt.errors import ModelError

transformers.logging.set_verbosity_error()

_VOCAB = 128


def _gpt2() -> nn.Module:
    config = transformers.GPT2Config(vocab_size=_VOCAB, n_embd=32, n_layer=2, n_head=4,
                                     n_positions=64, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config).eval()


def test_generate_builds_no_forward_graph_and_a_forward_call_builds_it() -> None:
    model = llama_lm(_VOCAB)
    ids = torch.randint(1, _VOCAB, (1, 6))
    before = snapshot(model)
    fast = autoopt.optimize(model, (ids,))
    assert fast.specializations == ()
    assert "forward: the example call's graph is built at the first forward call" \
        in str(fast.report)
    got = fast.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(got, model.generate(ids, max_new_tokens=4, do_sample=False))
    assert fast.specializations == ()  # generate's graphs are its steps', not the forward's
    with torch.no_grad():
        out = fast(ids)
        want = model(ids)
    torch.testing.assert_close(out.logits, want.logits, atol=1e-4, rtol=1e-4)
    (spec,) = fast.specializations
    assert spec.graph is not None and spec.method == "export"
    text = str(fast.report)
    assert "forward:" not in text and "[0] inputs:" in text
    assert fast.report.captures[0].verification is not None
    # A second call replays it; your model is as it was.
    with torch.no_grad():
        torch.testing.assert_close(fast(ids).logits, want.logits, atol=1e-4, rtol=1e-4)
    assert len(fast.specializations) == 1
    assert_bit_identical(model, before)


def test_bad_example_inputs_raise_at_optimize() -> None:
    model = _gpt2()
    with pytest.raises(ModelError, match="when run eagerly on the example inputs"):
        autoopt.optimize(model, (torch.randint(1, _VOCAB, (1, 6)).float(),))
    with pytest.raises(ModelError, match="when run eagerly on the example inputs"):
        autoopt.optimize(model, (torch.full((1, 6), _VOCAB),))  # past the vocabulary


def test_the_example_check_leaves_the_module_and_rng_as_they_were() -> None:
    """The eager check runs in train-mode dropout's absence too; where a model's forward
    draws random numbers (a generating model in eval mode with a sampling layer, here a
    stand-in), the global RNG is put back."""
    model = _gpt2()
    ids = torch.randint(1, _VOCAB, (2, 5))
    draws: list[torch.Tensor] = []
    model.transformer.h[0].register_forward_hook(
        lambda *_: draws.append(torch.rand(3)))  # the forward draws from the global RNG
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    fast = autoopt.optimize(model, (ids,))
    assert len(draws) == 1  # the check ran the forward once
    assert torch.equal(torch.rand(3), expected)
    assert fast.specializations == ()


def test_training_backend_and_models_without_transformers_generate_build_at_optimize() -> None:
    model = _gpt2().train()
    ids = torch.randint(1, _VOCAB, (1, 6))
    fast = autoopt.optimize(model, (ids,))
    assert len(fast.specializations) == 1 and "forward:" not in str(fast.report)
    # backend= applies to the forward or raises, at optimize.
    fast = autoopt.optimize(model.eval(), (ids,), backend="aten")
    assert [s.backend for s in fast.specializations] == ["aten"]

    class Sampler(nn.Module):  # a generate of its own, not transformers' loop
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.proj(x).relu()

        def generate(self, x: torch.Tensor) -> torch.Tensor:
            return self(x).argmax(-1)

    fast = autoopt.optimize(Sampler().eval(), (torch.randn(2, 8),))
    assert len(fast.specializations) == 1
