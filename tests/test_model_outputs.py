"""Outputs torch's pytree does not know — transformers' ``DynamicCache`` (``use_cache=True``,
the default), a user's dataclass — are captured as one whole graph and rebuilt as the same
types, with nothing left registered in torch afterwards (``autoopt.capture.objects``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from torch import nn
from torch.utils import _pytree as pytree
from transformers.cache_utils import DynamicCache, DynamicLayer

import autoopt
from autoopt.errors import ConfigError

transformers.logging.set_verbosity_error()

_SMALL = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def _llama(training: bool = False) -> nn.Module:
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**_SMALL))
    return model.train(training)


def _gpt2_config() -> transformers.GPT2Config:
    return transformers.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4,
                                   n_positions=64, bos_token_id=0, eos_token_id=0,
                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def _ids(batch: int = 2, seq: int = 12) -> torch.Tensor:
    return torch.randint(0, 128, (batch, seq))


def _cache_tensors(cache: DynamicCache) -> list[torch.Tensor]:
    return [t for layer in cache.layers for t in (layer.keys, layer.values)]


def _nothing_registered() -> None:
    for kind in (DynamicCache, DynamicLayer):
        assert kind not in pytree.SUPPORTED_NODES, f"{kind.__name__} left registered"


def test_llama_with_cache_is_one_exported_graph_returning_a_dynamic_cache() -> None:
    model, ids = _llama(), _ids()
    with torch.no_grad():
        expected = model(ids)
        fast = autoopt.optimize(model, (ids,))
        actual = fast(ids)
    assert isinstance(expected.past_key_values, DynamicCache)  # the default: use_cache=True
    record = fast.report.captures[0]
    assert record.method == "export", record.attempts
    assert type(actual) is type(expected)
    assert type(actual.past_key_values) is DynamicCache
    assert all(type(layer) is DynamicLayer for layer in actual.past_key_values.layers)
    torch.testing.assert_close(actual.logits, expected.logits)
    for got, want in zip(_cache_tensors(actual.past_key_values),
                         _cache_tensors(expected.past_key_values), strict=True):
        torch.testing.assert_close(got, want)
    _nothing_registered()


def test_the_rebuilt_cache_continues_generation_like_eager_s() -> None:
    """The cache the graph returns is a working DynamicCache: the next token's step reads it."""
    model, ids = _llama(), _ids(batch=1)
    step = _ids(batch=1, seq=1)
    with torch.no_grad():
        fast = autoopt.optimize(model, (ids,))
        rebuilt = fast(ids).past_key_values
        eager = model(ids).past_key_values
        after_rebuilt = model(step, past_key_values=rebuilt).logits
        after_eager = model(step, past_key_values=eager).logits
    torch.testing.assert_close(after_rebuilt, after_eager)
    # Each call's cache is its own object (an update of one does not reach the next call's).
    with torch.no_grad():
        again = fast(ids).past_key_values
    assert again is not rebuilt and again.layers[0] is not rebuilt.layers[0]
    assert again.layers[0].keys.shape[-2] == ids.shape[1]


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_training_with_a_cache_output_applies_a_memory_budget(name: str) -> None:
    if name == "gpt2":
        model = transformers.GPT2Model(_gpt2_config()).train()
    else:
        model = _llama(training=True)
    ids = _ids()
    with pytest.raises(ConfigError, match="memory_budget"):
        autoopt.optimize(model, (ids,), training=True, memory_budget="1KiB")
    roomy = autoopt.optimize(model, (ids,), training=True, memory_budget="1GiB")
    assert roomy.report.captures[0].method == "export", roomy.report.captures[0].attempts
    budget = int(roomy.report.captures[0].memory_plan.unconstrained_bytes * 0.6)
    fast = autoopt.optimize(model, (ids,), training=True, memory_budget=budget)
    record = fast.report.captures[0]
    assert record.method == "export", record.attempts
    plan = record.memory_plan
    assert plan is not None and plan.budget == budget and plan.peak_bytes <= budget
    assert set(plan.modes) - {"keep"}, "a budget below the unplanned bytes changes a segment"

    def step(module: nn.Module, owner: nn.Module) -> tuple[torch.Tensor, list[torch.Tensor]]:
        out = module(ids)
        hidden = out[0] if name == "gpt2" else out.logits
        loss = hidden.float().pow(2).mean()
        grads = torch.autograd.grad(loss, list(owner.parameters()))
        return loss.detach(), list(grads)

    want_loss, want_grads = step(model, model)
    got_loss, got_grads = step(fast, fast.module)  # training: its own copy of the weights
    torch.testing.assert_close(got_loss, want_loss)
    for got, want in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    _nothing_registered()


@pytest.mark.parametrize("use_cache", [True, False])
@pytest.mark.parametrize("name", ["gpt2_lm_head", "llama"])
def test_bf16_precision_applies_with_and_without_the_cache(name: str, use_cache: bool) -> None:
    model = (transformers.GPT2LMHeadModel(_gpt2_config()) if name == "gpt2_lm_head"
             else _llama()).eval()
    ids = _ids()
    kwargs = {"use_cache": use_cache}
    with torch.no_grad():
        expected = model(ids, **kwargs)
        # Forced: on a CPU without a fast bf16 matmul (a Skylake Xeon) the pass is turned off.
        fast = autoopt.optimize(model, (ids,), kwargs, precision="bf16",
                                pass_options={"precision": {"force": True}})
        actual = fast(ids, **kwargs)
    record = fast.report.captures[0]
    assert record.method == "export", record.attempts
    precision = next(p for p in record.passes if p.name == "precision")
    assert precision.status == "applied", precision
    assert (actual.past_key_values is None) == (not use_cache)
    torch.testing.assert_close(actual.logits, expected.logits, atol=0.05, rtol=0.05)


@pytest.mark.parametrize("use_cache", [True, False])
@pytest.mark.parametrize("name", ["gpt2_lm_head", "llama"])
def test_onnx_export_with_and_without_the_cache(name: str, use_cache: bool,
                                                tmp_path: Path) -> None:
    model = (transformers.GPT2LMHeadModel(_gpt2_config()) if name == "gpt2_lm_head"
             else _llama()).eval()
    ids = _ids()
    report = autoopt.export_onnx(model, (ids,), tmp_path / "model.onnx",
                                 example_kwargs={"use_cache": use_cache})
    assert report.ok
    layers = 2
    assert len(report.outputs) == 1 + (2 * layers if use_cache else 0), report.outputs
    _nothing_registered()


def test_onnxruntime_backend_returns_the_cache() -> None:
    model, ids = _llama(), _ids()
    with torch.no_grad():
        expected = model(ids)
        fast = autoopt.optimize(model, (ids,), backend="onnxruntime")
        actual = fast(ids)
    assert fast.report.backends[0].chosen == "onnxruntime"
    assert type(actual.past_key_values) is DynamicCache
    torch.testing.assert_close(actual.logits, expected.logits, atol=1e-5, rtol=1e-4)
    for got, want in zip(_cache_tensors(actual.past_key_values),
                         _cache_tensors(expected.past_key_values), strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    _nothing_registered()


@dataclasses.dataclass
class _Result:
    """A user's output type that nobody registered with torch's pytree."""
    scores: torch.Tensor
    extras: dict[str, torch.Tensor]
    label: str = "mlp"


class _ReturnsDataclass(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> _Result:
        h = self.fc(x)
        return _Result(h.relu(), {"norm": h.norm(dim=-1)})


def test_an_unregistered_dataclass_output_is_captured_whole() -> None:
    model, x = _ReturnsDataclass().eval(), torch.randn(4, 8)
    with torch.no_grad():
        expected = model(x)
        fast = autoopt.optimize(model, (x,))
        actual = fast(x)
        second = fast(torch.randn(4, 8))
    assert fast.report.captures[0].method == "export", fast.report.captures[0].attempts
    assert type(actual) is _Result and actual.label == "mlp"
    torch.testing.assert_close(actual.scores, expected.scores)
    torch.testing.assert_close(actual.extras["norm"], expected.extras["norm"])
    assert second.extras is not actual.extras  # constants are not shared between calls
    assert _Result not in pytree.SUPPORTED_NODES


class _Pair:
    def __init__(self, a: torch.Tensor, b: torch.Tensor) -> None:
        self.a, self.b = a, b


class _ReturnsPair(nn.Module):
    def forward(self, x: torch.Tensor) -> Any:
        return _Pair(x + 1, x * 2)


def test_a_type_the_user_registered_keeps_the_user_s_rules() -> None:
    pytree.register_pytree_node(_Pair, lambda p: ([p.b, p.a], None),
                                lambda values, _: _Pair(values[1], values[0]))
    try:
        x = torch.randn(3)
        fast = autoopt.optimize(_ReturnsPair(), (x,))
        out = fast(x)
        assert fast.report.captures[0].method == "export"
        assert pytree.SUPPORTED_NODES[_Pair].flatten_fn(out)[0][0] is out.b
        torch.testing.assert_close(out.a, x + 1)
        torch.testing.assert_close(out.b, x * 2)
    finally:
        pytree._deregister_pytree_node(_Pair)


class _Holder:
    """An object of the user's with tensors in attributes set out of name order."""

    def __init__(self, *tensors: torch.Tensor) -> None:
        self.zeta, self.alpha, self.mid = tensors[0], tensors[1], {"k": tensors[2]}
        self.flag = True


@dataclasses.dataclass
class _Fields:
    later: torch.Tensor
    earlier: torch.Tensor


def test_objects_are_taken_apart_in_the_order_verification_walks_them() -> None:
    """Export's output spec and verification (and so ONNX output names) walk an object's
    attributes in one order: a dataclass by its fields, anything else by sorted names."""
    from autoopt.capture import objects
    from autoopt.check.inputs import leaves

    tensors = [torch.full((1,), float(i)) for i in range(5)]
    value = (_Holder(*tensors[:3]), _Fields(tensors[3], tensors[4]))
    flat, _ = objects.flatten(value)
    walked = [leaf for _, leaf in leaves(value, "out") if isinstance(leaf, torch.Tensor)]
    assert [t.item() for t in flat] == [t.item() for t in walked] == [1.0, 2.0, 0.0, 3.0, 4.0]
