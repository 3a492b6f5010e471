"""optimize() on real architectures (random weights, small inputs) matches eager."""

from __future__ import annotations

import pytest
import torch
from checks import assert_bit_identical, assert_same_function, snapshot
from model_zoo import REAL_MODELS

import autoopt

# Every one is one whole graph, GPT-2 and Llama with the KV cache they return by default
# (a transformers DynamicCache: see autoopt.capture.objects).
EXPECTED_CAPTURE = {"resnet18": "export", "mobilenet_v3_small": "export", "vit_b_16": "export",
                    "bert": "export", "gpt2": "export", "llama": "export"}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(REAL_MODELS))
def test_real_model_is_verified_and_matches_eager(name: str) -> None:
    model, args, kwargs = REAL_MODELS[name]()
    before = snapshot(model)
    fast = autoopt.optimize(model, args, kwargs)
    capture = fast.report.captures[0]
    assert capture.method == EXPECTED_CAPTURE[name], str(fast.report)
    assert capture.verification is not None and capture.verification.ok
    assert fast.report.rolled_back == []
    assert_same_function(model, fast, args, kwargs)
    assert_bit_identical(model, before)
    # Every whole-graph node that produces a value carries its shape and dtype.
    if capture.method == "export":
        gm = fast.specializations[0].graph
        for node in gm.graph.nodes:
            if node.op in ("placeholder", "call_function", "get_attr") and node.users:
                assert "val" in node.meta, node.format_node()


@pytest.mark.slow
def test_structured_outputs_keep_their_types() -> None:
    model, args, kwargs = REAL_MODELS["bert"]()
    fast = autoopt.optimize(model, args, kwargs)
    out, ref = fast(*args, **kwargs), model(*args, **kwargs)
    assert type(out) is type(ref)
    assert out.keys() == ref.keys()
    torch.testing.assert_close(out.last_hidden_state, ref.last_hidden_state)

    model, args, kwargs = REAL_MODELS["gpt2"]()
    fast = autoopt.optimize(model, args, kwargs)
    out, ref = fast(*args), model(*args)
    assert type(out.past_key_values) is type(ref.past_key_values)
    for got, want in zip(out.past_key_values.layers, ref.past_key_values.layers, strict=True):
        torch.testing.assert_close(got.keys, want.keys)
        torch.testing.assert_close(got.values, want.values)
