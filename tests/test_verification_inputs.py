"""Verification never writes what the user owns, and never breaks a call (issue 18, item 4).

- Optimized modules made from one model share its tensors' memory and version counters:
  verifying or calling one must not write them, or the others see a write and capture again.
- A fresh random input set that eager itself rejects (an index out of range) says nothing
  about the optimized version: it is replaced or left out, and the record says so. The
  optimized version raising where eager did not is a failed comparison, never a crash.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.fx import GraphModule, symbolic_trace

import autoopt
from autoopt.check.compare import check_all, reference_run
from autoopt.check.inputs import input_sets
from autoopt.compile.dynamo import verify_graph
from autoopt.options.config import OptimizeConfig
from autoopt.passes.base import PassResult

transformers = pytest.importorskip("transformers")

_TEXT = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
             intermediate_size=64)


def _versions(model: nn.Module) -> dict[str, int]:
    return {n: t._version for n, t in [*model.named_parameters(), *model.named_buffers()]}


# --- (a) several optimized modules from one model ---------------------------------------------


def test_optimized_modules_from_one_model_never_recapture_each_other() -> None:
    torch.manual_seed(0)
    bert = transformers.BertModel(transformers.BertConfig(**_TEXT)).eval()
    ids = torch.randint(0, _TEXT["vocab_size"], (2, 16))
    before = _versions(bert)
    with torch.no_grad():
        expected = bert(ids).last_hidden_state
        fast = [autoopt.optimize(bert, (ids,), backends=("aten",)),
                autoopt.optimize(bert, (ids,), precision="bf16", backends=("aten",),
                                 pass_options={"precision": {"force": True}}),
                autoopt.optimize(bert, (ids,), dynamic=True, backends=("aten",))]
        assert _versions(bert) == before  # optimize wrote none of the user's tensors
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                for f in fast:
                    out = f(ids).last_hidden_state
                    tol = 5e-2 if f is fast[1] else 1e-4
                    torch.testing.assert_close(out, expected, rtol=tol, atol=tol)
    assert not [w for w in caught if "written" in str(w.message)]
    for f in fast:
        assert len(f.report.captures) == 1, f.report
        assert not [w for w in f.report.warnings if "written" in w], f.report.warnings
    assert _versions(bert) == before


def test_preserved_writes_back_only_a_changed_value() -> None:
    """A run that writes a tensor back to the value it had, or writes it unseen through
    ``.data``, leaves its version counter as it was: other modules sharing the tensor watch
    that counter."""
    from autoopt.check.state import preserved

    same, hidden, changed = torch.arange(4.0), torch.ones(3), torch.zeros(2)
    versions = same._version, hidden._version, changed._version
    with preserved((same, hidden, changed)):
        same.mul_(1.0)  # a write, to the same value
        hidden.data.fill_(7.0)  # a change no version counter sees
        changed.add_(1.0)  # a real change
    assert torch.equal(same, torch.arange(4.0)) and torch.equal(hidden, torch.ones(3))
    assert torch.equal(changed, torch.zeros(2))
    assert same._version == versions[0] + 1  # the run's own write, not one more
    assert hidden._version == versions[1]  # put back as unseen as it was made
    assert changed._version > versions[2] + 1  # the run's write, and the real restore


# --- (b) random inputs eager rejects ----------------------------------------------------------

_SEQ = 32
_POSITIONS = 4


class CountedPositions(nn.Module):
    """Position ids counted along a 0/1 mask (``mask.cumsum``): with the example's mask of
    three ones they fit the 4-row table, with a random mask of 32 they do not."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(16, 8)
        self.positions = nn.Embedding(_POSITIONS, 8)
        self.proj = nn.Linear(8, 8)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        positions = mask.cumsum(-1)
        h = self.tokens(ids) + self.positions(positions)
        return torch.relu(self.proj(h)) * 1.0 + 0.0


def _counted_inputs(seq: int = _SEQ) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 16, (2, seq))
    mask = torch.zeros(2, seq, dtype=torch.int64)
    mask[:, :3] = 1
    return ids, mask


@pytest.mark.parametrize("capture", [("export",), ("dynamo",)])
def test_random_sets_eager_rejects_are_discarded_and_recorded(
        capture: tuple[str, ...]) -> None:
    torch.manual_seed(0)
    model = CountedPositions().eval()
    ids, mask = _counted_inputs()
    with pytest.raises(IndexError):  # what a random mask does to eager
        model(ids, torch.ones_like(mask))
    with torch.no_grad():
        fast = autoopt.optimize(model, (ids, mask), capture=capture, backends=("aten",))
        torch.testing.assert_close(fast(ids, mask), model(ids, mask))
        other_ids, other_mask = _counted_inputs()
        torch.testing.assert_close(fast(other_ids, other_mask), model(other_ids, other_mask))
    (record,) = fast.report.captures
    assert record.method == capture[0]
    assert record.verification is not None and record.verification.ok
    assert "random input sets discarded: eager raised IndexError" in record.verification.note
    assert record.verification.inputs_checked == 1  # the example alone: no random set fits
    assert "discarded" in str(fast.report)


def test_dynamo_recompile_during_a_call_survives_random_sets_eager_rejects() -> None:
    """A new size makes Dynamo compile again inside the user's call; the subgraph's
    verification must not raise eager's IndexError on its random sets into that call."""
    torch.manual_seed(0)
    model = CountedPositions().eval()
    with torch.no_grad():
        fast = autoopt.optimize(model, _counted_inputs(), capture=("dynamo",),
                                backends=("aten",))
        for seq in (24, 40):
            ids, mask = _counted_inputs(seq)
            torch.testing.assert_close(fast(ids, mask), model(ids, mask))
    assert [c.method for c in fast.report.captures] == ["dynamo"]


def test_verify_graph_replaces_a_rejected_set_and_says_so() -> None:
    model = CountedPositions().eval()
    gm = symbolic_trace(model)
    inputs = list(_counted_inputs())
    result = verify_graph(gm, symbolic_trace(model), inputs, OptimizeConfig(random_inputs=2))
    assert result.ok
    assert result.inputs_checked == 1
    assert "eager raised IndexError" in result.note


def test_random_sets_with_non_finite_eager_outputs_are_discarded() -> None:
    def sqrt_of_excess(x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(x - 1.0)  # finite for the example, NaN below 1

    x = 1.0 + torch.rand(4, 8) * 0.01  # random draws (mean 1, small spread) go below 1
    gm = symbolic_trace(sqrt_of_excess)
    result = verify_graph(gm, symbolic_trace(sqrt_of_excess), [x],
                          OptimizeConfig(random_inputs=2))
    assert result.ok
    assert "non-finite" in result.note


def test_integers_are_drawn_within_the_observed_range() -> None:
    ids = torch.tensor([[3, 7, 5], [4, 4, 6]])
    top = torch.tensor([torch.iinfo(torch.int64).max - 1, torch.iinfo(torch.int64).max])
    for a, _ in input_sets((ids, top), {}, 20)[1:]:
        assert int(a[0].min()) >= 3 and int(a[0].max()) <= 7
        assert int(a[1].min()) >= top[0] and int(a[1].max()) <= top[1]


def test_an_integer_mask_of_ones_is_verified_with_padding_too() -> None:
    """A tokenizer's attention_mask (int64, all ones in the example): drawn within its range
    it stayed all ones, and padded positions were never verified (ONNX Runtime's attention
    differed from eager's there). It gets 0/1 patterns with zeros; all-zero token type ids and
    a 1-D 0/1 index stay within their range."""
    mask, types, index = torch.ones(2, 16, dtype=torch.int64), torch.zeros(2, 16,
                                                                           dtype=torch.int64), \
        torch.tensor([0, 1, 1])
    sets = input_sets((mask, types, index), {}, 4)[1:]
    for (m, t, i), _ in sets:
        assert m.dtype == torch.int64 and set(m.unique().tolist()) <= {0, 1}
        assert not t.any() and set(i.unique().tolist()) <= {0, 1}
    assert all((m == 0).any() for (m, _, _), _ in sets)


def test_the_first_random_set_has_a_row_with_every_position_masked() -> None:
    """An empty text padded into a batch: ONNX Runtime's attention gave such a row other
    values than eager's, unverified. The first fresh set has one (integer and float 0/1
    masks of a batch of two or more); the later sets and a batch of one do not."""
    masks = (torch.ones(3, 8, dtype=torch.int64), torch.ones(2, 1, 4, 4))
    sets = input_sets(masks + (torch.ones(1, 8, dtype=torch.int64),), {}, 3)
    (ints, floats, single), _ = sets[1]
    assert not ints[0].any() and not floats[0].any() and single.any()
    assert ints[1:].any() and floats[1:].any()
    assert all(m[0].any() for set_ in sets[2:] for m in set_[0][:2])
    redrawn, _ = sets.draw()
    assert redrawn[0][0].any()


# --- the optimized version raising -------------------------------------------------------------


class _RaisesOffExample(nn.Module):
    """Doubles its input, but raises on any input other than the example."""

    def __init__(self, example: torch.Tensor) -> None:
        super().__init__()
        self.example = example.clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.equal(x, self.example):
            raise RuntimeError("kernel rejects this input")
        return x * 2


def test_candidate_raising_where_eager_succeeds_is_a_failed_verification() -> None:
    x = torch.randn(3, 4)

    def double(t: torch.Tensor) -> torch.Tensor:
        return t * 2

    result = verify_graph(symbolic_trace(double), _RaisesOffExample(x), [x],  # type: ignore[arg-type]
                          OptimizeConfig(random_inputs=2))
    assert not result.ok
    assert "random input set 1" in result.detail and "RuntimeError" in result.detail

    def run_pair(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        with reference_run():
            expected = double(*args)
        return expected, _RaisesOffExample(x)(*args)

    sets = input_sets((x,), {}, 2)
    assert not check_all(run_pair, sets).ok
    assert len(sets) == 3  # nothing discarded: eager accepted every set


def _rejects_off_example(t: torch.Tensor) -> torch.Tensor:
    if float(t.detach().abs().sum()) != _rejects_off_example.total:  # type: ignore[attr-defined]
        raise RuntimeError("kernel rejects this input")
    return t


torch.fx.wrap("_rejects_off_example")


def _strict_pass(gm: GraphModule, ctx: Any) -> PassResult:
    """A broken pass: its graph raises on every input but the example's."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    (value,) = output.args
    with gm.graph.inserting_before(output):
        checked = gm.graph.call_function(_rejects_off_example, (value,))
    output.args = (checked,)
    return PassResult(gm, True, {"strict": 1})


def test_a_pass_whose_graph_raises_on_random_inputs_is_rolled_back() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU()).eval()
    x = torch.randn(2, 4)
    with torch.no_grad():
        _rejects_off_example.total = float(model(x).abs().sum())  # type: ignore[attr-defined]
        fast = autoopt.optimize(model, (x,), pipeline=(("strict", _strict_pass),),
                                capture=("symbolic_trace",), backends=("aten",))
        torch.testing.assert_close(fast(x), model(x))
    (record,) = fast.report.captures
    (strict,) = [p for p in record.passes if p.name == "strict"]
    assert strict.status == "rolled_back" and "RuntimeError" in strict.reason
