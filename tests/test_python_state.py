"""Python state a graph can own: what a forward writes once, on its first call.

A forward that caches values computed from its parameters (timm's LeViT attention biases), sets
a flag, or installs hooks for itself on its first call (transformers' output capturing) leaves
later calls computing the same function: the capture keeps that state on autoopt's copy, as
eager's first call would, and takes the model as one graph. State written on every call (a
counter that changes what the next call computes) still keeps the graph out, with the reason
in the capture record. The user's model is never written, Python state included.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import autoopt
from autoopt.check.state import has_hooks, python_state


class Flagged(nn.Module):
    """Sets a flag on its first call (lazy initialization done, a message logged once)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self._initialized = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._initialized:
            self._initialized = True
        return torch.relu(self.linear(x))


class CachedScale(nn.Module):
    """Caches a value computed from its parameters on its first call, per device."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.cache: dict[str, torch.Tensor] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        key = str(x.device)
        if key not in self.cache:
            self.cache[key] = self.linear.weight.detach().abs().sum(0)
        return self.linear(x) * self.cache[key]


class Counting(nn.Module):
    """Counts its calls in a Python int that changes what each call computes."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.linear(x) * self.calls


class WarmsUp(nn.Module):
    """Sets a flag on its first call and computes differently once it is set."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.warm = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        if not self.warm:
            self.warm = True
            return y
        return y * 2


class FirstInputCache(nn.Module):
    """Caches a value computed from its first input, reused for every later input."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.center: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.center is None:
            self.center = x.mean(0)
        return self.linear(x - self.center)


def _check(model: nn.Module, x: torch.Tensor, calls: int = 3) -> autoopt.OptimizedModule:
    """Optimize ``model`` and call it next to an eager copy: same outputs, and the user's
    model's Python state and hooks as they were, after optimize and after the calls."""
    state = python_state(model)
    eager = copy.deepcopy(model)
    fast = autoopt.optimize(model, (x,))
    assert python_state(model) == state
    with torch.no_grad():
        for i in range(calls):
            inputs = x if i == 0 else torch.randn_like(x)
            torch.testing.assert_close(fast(inputs), eager(inputs))
    assert python_state(model) == state
    assert not has_hooks(model)
    return fast


@pytest.mark.parametrize("model", [Flagged, CachedScale], ids=["flag", "cache"])
def test_a_first_call_write_is_kept_and_the_model_captured_whole(model: type) -> None:
    fast = _check(model().eval(), torch.randn(4, 8))
    capture = fast.report.captures[0]
    assert capture.method == "export", capture.attempts
    assert len(fast.report.captures) == 1  # the kept flag is no change of the graph's state
    with torch.no_grad():  # another shape: captured whole as well
        fast(torch.randn(2, 8))
    assert [c.method for c in fast.report.captures] == ["export", "export"]


def test_the_kept_state_is_on_autoopts_copy_as_eager_leaves_it() -> None:
    model = Flagged().eval()
    fast = autoopt.optimize(model, (torch.randn(4, 8),))
    assert fast.module._initialized and not model._initialized


def test_state_written_on_every_call_still_keeps_the_graph_out() -> None:
    fast = _check(Counting().eval(), torch.randn(4, 8))
    capture = fast.report.captures[0]
    assert capture.method == "dynamo"
    reasons = [why for method, why in capture.attempts if method == "export"]
    assert reasons and "Python state (calls) on every call" in reasons[0], reasons


def test_a_first_call_that_computes_differently_keeps_the_graph_out() -> None:
    fast = _check(WarmsUp().eval(), torch.randn(4, 8))
    capture = fast.report.captures[0]
    assert capture.method == "dynamo"
    reasons = [why for method, why in capture.attempts if method == "export"]
    assert reasons and "computes differently" in reasons[0], reasons


def test_a_first_call_that_caches_its_inputs_keeps_the_graph_out() -> None:
    """Calls with the example inputs alone cannot tell this from a cache of parameters: a
    first call on other inputs writes other values."""
    model = FirstInputCache().eval()
    state = python_state(model)
    fast = autoopt.optimize(model, (torch.randn(4, 8),))
    capture = fast.report.captures[0]
    assert capture.method == "dynamo"
    reasons = [why for method, why in capture.attempts if method == "export"]
    assert reasons and "from its inputs" in reasons[0], reasons
    assert python_state(model) == state


@pytest.mark.slow
def test_levit_attention_bias_cache_is_captured_by_export() -> None:
    """timm's LeViT caches its attention biases in a dict attribute on its first eval call."""
    timm = pytest.importorskip("timm")
    model = timm.create_model("levit_128s", pretrained=False, num_classes=10, img_size=64)
    fast = _check(model.eval(), torch.randn(1, 3, 64, 64))
    capture = fast.report.captures[0]
    assert capture.method == "export", capture.attempts
    assert len(fast.report.captures) == 1
    caches = [m.attention_bias_cache for m in model.modules()
              if hasattr(m, "attention_bias_cache")]
    assert caches and all(c == {} for c in caches)  # the user's model: never called


@pytest.mark.slow
def test_segformer_hooks_installed_on_first_call_are_captured_by_export() -> None:
    """transformers installs its output-capturing hooks on a model's first call and sets
    ``_output_capturing_hooks_installed``."""
    transformers = pytest.importorskip("transformers")
    config = transformers.SegformerConfig(
        num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32],
        patch_sizes=[7, 3], strides=[4, 2], num_attention_heads=[1, 2], mlp_ratios=[2, 2],
        decoder_hidden_size=32, num_labels=5)
    model = transformers.SegformerForSemanticSegmentation(config).eval()
    x = torch.randn(1, 3, 64, 64)
    state, eager = python_state(model), copy.deepcopy(model)
    fast = autoopt.optimize(model, (x,))
    with torch.no_grad():
        for inputs in (x, torch.randn(1, 3, 64, 64), torch.randn(2, 3, 64, 64)):
            torch.testing.assert_close(fast(inputs).logits, eager(inputs).logits)
    assert [c.method for c in fast.report.captures] == ["export", "export"]
    assert python_state(model) == state and not has_hooks(model)


class _Memory:
    """A state object the caller passes in (not a pytree node): an RNN's hidden state."""

    def __init__(self, h: torch.Tensor) -> None:
        self.h = h


class _Cell(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, memory: _Memory) -> torch.Tensor:
        memory.h = torch.tanh(self.linear(x) + memory.h)  # advances once per call
        return memory.h * 2


@torch.no_grad()
def test_objects_passed_as_inputs_are_written_by_calls_not_by_capture() -> None:
    """Capture copied the tensors of its inputs but not an object holding them: its runs
    advanced the user's state object (the example's attribute was left an fx ``Proxy``) and a
    transformers cache (a decode step's first call grew the cache by 5 instead of 1: logits
    0.59 off at that step and after)."""
    torch.manual_seed(0)
    model, x = _Cell().eval(), torch.randn(2, 8)
    example = _Memory(torch.zeros(2, 8))
    fast = autoopt.optimize(model, (x, example))
    assert torch.equal(example.h, torch.zeros(2, 8))
    mine, theirs = _Memory(torch.zeros(2, 8)), _Memory(torch.zeros(2, 8))
    for _ in range(3):
        torch.testing.assert_close(fast(x, mine), model(x, theirs))
        torch.testing.assert_close(mine.h, theirs.h)

    import transformers

    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2,
                                     n_positions=64)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 64, (2, 8))
    fast = autoopt.optimize(model, (ids,))
    mine, theirs = fast(ids), model(ids)
    token = theirs.logits[:, -1].argmax(-1, keepdim=True)
    for _ in range(2):  # the first decode step is a new signature: captured in this call
        mine = fast(token, past_key_values=mine.past_key_values)
        theirs = model(token, past_key_values=theirs.past_key_values)
        assert mine.past_key_values.get_seq_length() == theirs.past_key_values.get_seq_length()
        torch.testing.assert_close(mine.logits, theirs.logits, rtol=1e-4, atol=1e-5)
        token = theirs.logits[:, -1].argmax(-1, keepdim=True)
