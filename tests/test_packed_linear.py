"""packed_linear: fp32 linears (linear, addmm, mm on a constant) onto MKL's or oneDNN's packed
GEMM."""

from __future__ import annotations

import copy
import gc
import importlib
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import GraphModule

import autoopt
from autoopt.capture.graph import export_graph
from autoopt.cost_model import CostCache, CostModel
from autoopt.passes import PassContext, block_kernels, packed_linear
from autoopt.passes.graph import portable, release_packed, restore_packed
from autoopt.passes.packed_kernels import (
    _SHARED,
    KERNELS,
    OWN_GEMV,
    ROWS_KERNEL_MAX,
    PackedLinear,
    available,
    kernels,
    kernels_for,
)

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(not available(CPU),
                                reason="this PyTorch build has no packed linear kernel")
requires_mkl = pytest.mark.skipif("mkl" not in kernels(CPU),
                                  reason="this PyTorch build has no MKL packed linear")
requires_onednn = pytest.mark.skipif("onednn" not in kernels(CPU),
                                     reason="this PyTorch build has no oneDNN linear")
aten = torch.ops.aten


class Before(nn.Module):
    """An MLP block: x ─ linear ─ gelu ─ linear (no bias) ─ y, on a 3-D input."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 48)
        self.down = nn.Linear(48, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Conv1D(nn.Module):
    """GPT-2's Conv1D: ``addmm(b, x, W)`` with ``W`` stored (in, out), and a bias-free ``mm``."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(16, 24) / 4)
        self.bias = nn.Parameter(torch.randn(24))
        self.proj = nn.Parameter(torch.randn(24, 8) / 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.addmm(self.bias, x.view(-1, 16), self.weight)
        return torch.mm(torch.relu(h), self.proj).view(*x.shape[:-1], 8)


def _packed_calls(gm: GraphModule) -> list[PackedLinear]:
    return [n.target for n in gm.graph.nodes if isinstance(n.target, PackedLinear)]


def _targets(gm: GraphModule) -> list[object]:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _rewrite(model: nn.Module, x: torch.Tensor, **ctx_args: object,
             ) -> tuple[GraphModule, dict[str, int]]:
    with torch.no_grad():
        gm = export_graph(model.eval(), (x,), {})
    result = packed_linear(gm, PassContext(**ctx_args))  # no cost model: every eligible one
    return result.graph_module, dict(result.counts)


def _assert_same_gemm(gm: GraphModule, model: nn.Module, shape: tuple[int, ...]) -> None:
    """MKL's packed GEMM is the kernel aten.linear runs, but how it splits the reduction across
    threads differs by CPU (equal on a Sapphire Rapids, one ulp apart on an AMD EPYC at 2
    threads): the same function within fp32 rounding, not bitwise."""
    for _ in range(3):
        x = torch.randn(shape)
        with torch.no_grad():
            torch.testing.assert_close(gm(x), model(x))  # fp32: rtol 1.3e-6, atol 1e-5


@requires_mkl
def test_before_becomes_two_packed_calls() -> None:
    model = Before().eval()
    gm, counts = _rewrite(model, torch.randn(2, 5, 16))
    assert counts["linear"] == 2 and "linear_kept_aten" not in counts
    assert aten.linear.default not in _targets(gm)
    up, down = _packed_calls(gm)
    assert (tuple(up.weight.shape), up.rows) == ((48, 16), 10)
    assert aten.gelu.default in _targets(gm)  # the activation stays its own op
    _assert_same_gemm(gm, model, (2, 5, 16))


@requires_mkl
def test_addmm_and_mm_on_a_constant_right_hand_side() -> None:
    model = Conv1D().eval()
    gm, counts = _rewrite(model, torch.randn(3, 4, 16))
    assert counts["linear"] == 2
    assert not {aten.addmm.default, aten.mm.default} & set(_targets(gm))
    # The weight is bound as a transposed view of the model's own tensor: no copy of it.
    first = _packed_calls(gm)[0]
    assert first.weight.shape == (24, 16)
    assert first.weight.untyped_storage().data_ptr() == model.weight.untyped_storage().data_ptr()
    _assert_same_gemm(gm, model, (3, 4, 16))


@requires_mkl
def test_another_row_count_falls_back_to_the_unpacked_weight() -> None:
    """The packing is for the example's row count; MKL runs aten's GEMM at any other."""
    model = Before().eval()
    gm, _ = _rewrite(model, torch.randn(2, 5, 16))
    kernel = _packed_calls(gm)[0]
    x = torch.randn(7, 16)
    with torch.no_grad():
        torch.testing.assert_close(kernel(x, model.up.bias), model.up(x))


class Unsafe(nn.Module):
    """Linears the pass must leave alone: a weight computed from the input, an addmm with a
    scale, a matmul of two activations, and an fp64 linear."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))
        self.b = nn.Parameter(torch.randn(8))
        self.f64 = nn.Linear(8, 8).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dynamic_weight = F.linear(x, x.t() @ x)
        scaled = torch.addmm(self.b, x, self.w, beta=0.5)
        two_activations = torch.mm(x, x.t())
        f64 = self.f64(x.double()).float()
        return dynamic_weight.sum() + scaled.sum() + two_activations.sum() + f64.sum()


@requires_mkl
def test_does_not_fire_where_the_kernel_would_compute_something_else() -> None:
    model = Unsafe().eval()
    gm, counts = _rewrite(model, torch.randn(8, 8))
    assert counts == {}
    assert _packed_calls(gm) == []


@requires_mkl
def test_does_not_fire_when_training_or_for_a_cuda_target() -> None:
    x = torch.randn(2, 5, 16)
    assert _rewrite(Before(), x, training=True)[1] == {}
    assert _rewrite(Before(), x, device=torch.device("cuda"))[1] == {}


@requires_onednn
@pytest.mark.parametrize("choice", ["onednn_packed", "mkl_packed", None])
def test_symbolic_row_counts_are_measured_as_traced_on_kernels_that_take_any_count(
        choice: str | None) -> None:
    """A graph captured with ``dynamic=`` (a prompt of any length) is measured at the sizes it
    was traced with; MKL's packed GEMM, which serves only the row count it packed for, is not
    offered. The graph stays symbolic: the pass adds no guard on the sizes."""
    model = Before().eval()
    with torch.no_grad():
        gm = export_graph(model, (torch.randn(2, 5, 16),), {}, dynamic=True)
    placeholder = next(n for n in gm.graph.nodes if n.op == "placeholder"
                       and n.meta["val"].dim() == 3)
    env = placeholder.meta["val"].shape[0].node.shape_env
    guards = len(env.guards)
    cost = Chooses(choice) if choice is not None else None
    result = packed_linear(gm, PassContext(cost=cost))
    if cost is not None:
        assert cost.offered == [{"onednn_packed", "aten"}] * 2
        assert [what.split("|")[1] for what, _ in cost.asked] == ["(2, 5, 16)", "(2, 5, 48)"]
        assert all(what.endswith("|dynamic") for what, _ in cost.asked)
    if choice == "mkl_packed":  # not offered: ATen stays
        assert dict(result.counts) == {"linear_kept_aten": 2}
    else:  # measured oneDNN, or no cost model: the kernel for any row count, not MKL's
        assert dict(result.counts) == {"linear": 2, "onednn": 2}
        assert _kernels_called(result.graph_module) == ["onednn", "onednn"]
    assert len(env.guards) == guards  # no size compared, none specialized
    for shape in [(2, 5, 16), (3, 7, 16), (1, 9, 16)]:
        _assert_same_gemm(gm, model, shape)


def test_the_cost_model_chooses_and_remembers(tmp_path: Path) -> None:
    cost = CostModel("cpu", cache=CostCache(tmp_path / "costs.json"))
    gm, counts = _rewrite(Before(), torch.randn(2, 5, 16), cost=cost)
    choices = {k: v for k, v in cost.cache.items() if k.startswith("fastest|linear|")}
    assert len(choices) == 2  # two distinct shapes, each measured every way this build has
    every = {f"{k}_packed" for k in kernels(CPU) if k in kernels_for(torch.float32)} | {"aten"}
    every -= {f"{k}_packed" for k in OWN_GEMV}  # ten rows: more than a decode step's
    assert all(set(v) == every for v in choices.values())
    assert counts.get("linear", 0) + counts.get("linear_kept_aten", 0) == 2
    assert counts.get("mkl", 0) + counts.get("onednn", 0) == counts.get("linear", 0)
    again = CostModel("cpu", cache=CostCache(tmp_path / "costs.json"))
    assert _rewrite(Before(), torch.randn(2, 5, 16), cost=again)[1] == counts


@requires_mkl
def test_each_packed_linear_is_a_matmul_with_its_own_cost_key() -> None:
    from autoopt.cost_model.estimate import op_family, op_name

    gm, _ = _rewrite(Before(), torch.randn(2, 5, 16))
    names = {op_name(k) for k in _packed_calls(gm)}
    assert len(names) == 2 and {op_family(n) for n in names} == {"matmul"}
    if "onednn" in kernels(CPU):  # the same shapes on the other kernel: keyed apart
        gm, _ = _rewrite(Before(), torch.randn(2, 5, 16), options={"kernel": "onednn"})
        onednn = {op_name(k) for k in _packed_calls(gm)}
        assert len(onednn) == 2 and not onednn & names
        assert {op_family(n) for n in onednn} == {"matmul"}


def _small_bert() -> tuple[nn.Module, torch.Tensor]:
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(hidden_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=128,
                                     vocab_size=100)
    torch.manual_seed(0)
    return transformers.BertModel(config).eval(), torch.randint(0, 100, (2, 12))


@requires_mkl
def test_optimize_on_bert_uses_it_and_exports_take_the_portable_graph(tmp_path: Path) -> None:
    model, ids = _small_bert()
    fast = autoopt.optimize(model, (ids,), pass_options={"packed_linear": {"measure": False}})
    record = next(p for p in fast.report.captures[0].passes if p.name == "packed_linear")
    gm = fast.specializations[0].graph
    assert aten.linear.default not in _targets(gm)
    # Every linear of the graph before lowering (Q/K/V merged or not, as measured) is packed.
    linears = _targets(portable(gm)).count(aten.linear.default)
    assert record.status == "applied" and record.counts["linear"] == linears >= 9
    assert not _packed_calls(portable(gm))
    with torch.no_grad():
        expected = model(ids).last_hidden_state
        torch.testing.assert_close(fast(ids).last_hidden_state, expected, rtol=1e-5, atol=1e-5)
        # Packed weights are shared, not copied, by a deep copy.
        torch.testing.assert_close(copy.deepcopy(fast)(ids).last_hidden_state, expected,
                                   rtol=1e-5, atol=1e-5)
    assert autoopt.export_onnx(fast, (ids,), tmp_path / "bert.onnx").ok


@pytest.mark.parametrize("kernel", kernels_for(torch.float32))
def test_packed_weights_are_dropped_and_packed_again_to_the_same_results(kernel: str) -> None:
    """While another backend is built and measured, the aten lowering's packed copies (and
    merged Q/K/V weights, concatenated again from the model's) are dropped; a call, or
    ``restore_packed``, packs them again: the same results. autoopt's GEMV holds the model's
    weight itself: only a merged one is dropped and made again."""
    if kernel not in kernels(CPU):
        pytest.skip(f"this PyTorch build has no {kernel} packed linear")
    if kernel in OWN_GEMV:
        _rows_kernel_drops_only_merged_weights(kernel)
        return
    model, ids = _small_bert()
    fast = autoopt.optimize(model, (ids,), backends=("aten",), pass_options={
        "packed_linear": {"measure": False, "kernel": kernel},
        "merge_linear": {"measure": False}})
    gm = fast.specializations[0].graph
    packed = _packed_calls(gm)
    merged = [k for k in packed if k.source is not None]
    assert len(packed) >= 9 and len(merged) == 2  # Q/K/V of each layer merged
    with torch.no_grad():
        expected = fast(ids).last_hidden_state
        assert release_packed(gm) >= sum(k.weight.numel() * 4 for k in packed)
        assert all(k.packed is None for k in packed) and all(k.weight.is_meta for k in merged)
        assert release_packed(gm) == 0  # nothing left to drop
        assert torch.equal(fast(ids).last_hidden_state, expected)  # packed again as called
        assert all(k.packed is not None for k in packed)
        release_packed(gm)
        restore_packed(gm)
        assert all(k.packed is not None for k in packed)
        assert all(k.weight.is_meta == (kernel == "onednn") for k in merged)
        assert torch.equal(fast(ids).last_hidden_state, expected)


def _rows_kernel_drops_only_merged_weights(kernel: str) -> None:
    if block_kernels.unavailable() is not None:
        pytest.skip(f"autoopt's GEMV needs {block_kernels.unavailable()}")
    model, ids = _small_bert()
    ids = ids[:1, :1]  # one row per linear: a decode step's
    fast = autoopt.optimize(model, (ids,), backends=("aten",), pass_options={
        "packed_linear": {"measure": False, "kernel": kernel},
        "merge_linear": {"measure": False}})
    gm = fast.specializations[0].graph
    packed = _packed_calls(gm)
    merged = [k for k in packed if k.source is not None]
    assert {k.kernel for k in packed} == {kernel} and len(merged) == 2
    own = [k for k in packed if k.source is None]
    assert all(k.packed is k.weight for k in own)  # the model's weight, no copy
    with torch.no_grad():
        expected = fast(ids).last_hidden_state
        torch.testing.assert_close(expected, model(ids).last_hidden_state)
        assert release_packed(gm) == sum(k.weight.numel() * 4 for k in merged)
        assert all(k.weight.is_meta and k.packed is None for k in merged)
        assert all(k.packed is not None for k in own)
        assert torch.equal(fast(ids).last_hidden_state, expected)  # made again as called
        release_packed(gm)
        restore_packed(gm)
        assert all(not k.weight.is_meta and k.packed is k.weight for k in merged)
        assert torch.equal(fast(ids).last_hidden_state, expected)


@requires_mkl
def test_repacks_when_the_thread_count_changes() -> None:
    """MKL packs a weight for the thread count of the moment (packed at 1 thread, the GEMM ran
    on 1 thread at 2), so a call at a new count packs it again, and still computes the same."""
    model = Before().eval()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        gm, _ = _rewrite(model, torch.randn(2, 5, 16))
        kernels = _packed_calls(gm)
        assert {k.threads for k in kernels} == {1}
        first = [k.packed for k in kernels]
        torch.set_num_threads(2)
        _assert_same_gemm(gm, model, (2, 5, 16))
        assert {k.threads for k in kernels} == {2}
        assert all(k.packed is not old for k, old in zip(kernels, first, strict=True))
    finally:
        torch.set_num_threads(threads)


# --- oneDNN's packed linear, and the measured choice among all kernels ----------------------


@requires_onednn
def test_onednn_kernel_on_an_mlp_matches_aten() -> None:
    """oneDNN's GEMM is not aten's (MKL's): equal within fp32 rounding, not bitwise."""
    model = Before().eval()
    gm, counts = _rewrite(model, torch.randn(2, 5, 16), options={"kernel": "onednn"})
    assert counts == {"linear": 2, "onednn": 2}  # packed_mib rounds to 0 at this size
    up, down = _packed_calls(gm)
    assert (up.kernel, down.kernel) == ("onednn", "onednn")
    assert up.__name__ == "onednn_linear" and "onednn" in up.__qualname__
    assert up.packed.is_mkldnn and (tuple(up.weight.shape), up.rows) == ((48, 16), 10)
    _assert_same_gemm(gm, model, (2, 5, 16))
    with torch.no_grad():  # another row count: the same packed weight serves it
        x = torch.randn(7, 16)
        torch.testing.assert_close(up(x, model.up.bias), model.up(x))
    # Shape propagation runs F.linear on meta tensors; a deep copy shares the packed weights.
    assert up(torch.empty(3, 16, device="meta"), None).shape == (3, 48)
    assert _packed_calls(copy.deepcopy(gm))[0] is up
    with torch.no_grad():
        x = torch.randn(2, 5, 16)
        torch.testing.assert_close(copy.deepcopy(gm)(x), model(x))


@requires_onednn
def test_onednn_kernel_on_gpt2_addmm_and_mm_matches_aten() -> None:
    model = Conv1D().eval()
    gm, counts = _rewrite(model, torch.randn(3, 4, 16), options={"kernel": "onednn"})
    assert counts == {"linear": 2, "onednn": 2}
    assert not {aten.addmm.default, aten.mm.default} & set(_targets(gm))
    first = _packed_calls(gm)[0]
    # Bound as a transposed view of the model's own (in, out) tensor; reordered from a copy.
    assert first.weight.shape == (24, 16)
    assert first.weight.untyped_storage().data_ptr() == model.weight.untyped_storage().data_ptr()
    _assert_same_gemm(gm, model, (3, 4, 16))


@requires_onednn
def test_onednn_kernel_is_not_repacked_when_the_thread_count_changes() -> None:
    model = Before().eval()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        gm, _ = _rewrite(model, torch.randn(2, 5, 16), options={"kernel": "onednn"})
        first = [k.packed for k in _packed_calls(gm)]
        torch.set_num_threads(2)
        _assert_same_gemm(gm, model, (2, 5, 16))
        assert all(k.packed is old for k, old in zip(_packed_calls(gm), first, strict=True))
    finally:
        torch.set_num_threads(threads)


class Chooses:
    """A cost model whose ``fastest`` picks ``choice`` (when offered): it records what it was
    offered for each shape, and runs every candidate to check they compute the same."""

    def __init__(self, choice: str) -> None:
        self.choice = choice
        self.offered: list[set[str]] = []
        self.asked: list[tuple[str, bool]] = []  # (what, cold) per choice
        self.sweeps: list[int] = []  # how many copies of the weight a run goes through

    def recorded(self, what: str, names: object) -> None:
        return None

    def fastest(self, what: str, candidates: dict[str, Callable[[], Any]], repeats: int = 3,
                state: object = (), cold: bool = False) -> tuple[str, dict[str, float]]:
        self.offered.append(set(candidates))
        self.asked.append((what, cold))
        with torch.no_grad():
            outputs = {name: run() for name, run in candidates.items()}
        self.sweeps.append(len(outputs["aten"]) if isinstance(outputs["aten"], list) else 1)
        for name, out in outputs.items():
            torch.testing.assert_close(out, outputs["aten"], msg=name)
        best = self.choice if self.choice in candidates else "aten"
        return best, {name: 1.0 if name == best else 2.0 for name in candidates}


def _kernels_called(gm: GraphModule) -> list[str]:
    return [k.kernel for k in _packed_calls(gm)]


@pytest.mark.parametrize("model_cls, shape", [(Before, (2, 5, 16)), (Conv1D, (3, 4, 16)),
                                              (Before, (1, 1, 16)), (Conv1D, (1, 16))])
@pytest.mark.parametrize("choice", ["mkl_packed", "onednn_packed", "fp32_rows_packed",
                                    "fp32_stream_packed", "aten"])
def test_the_measured_choice_offers_every_kernel_and_the_graph_calls_the_chosen(
        choice: str, model_cls: type[nn.Module], shape: tuple[int, ...]) -> None:
    """Each linear is offered ATen and every fp32 packed kernel; autoopt's GEMV only where it
    may serve (a few rows: a decode step's; a weight in (out, in) order, not Conv1D's
    transposed view; the kernels built here)."""
    if choice != "aten" and choice.removesuffix("_packed") not in kernels(CPU):
        pytest.skip(f"this PyTorch build has no {choice}")
    model = model_cls().eval()
    cost = Chooses(choice)
    gm, counts = _rewrite(model, torch.randn(shape), cost=cost)
    every = {f"{k}_packed" for k in kernels(CPU) if k in kernels_for(torch.float32)} | {"aten"}
    if not (model_cls is Before and math.prod(shape[:-1]) <= ROWS_KERNEL_MAX
            and block_kernels.unavailable() is None):
        every -= {f"{k}_packed" for k in OWN_GEMV}
    assert cost.offered == [every, every]  # each linear: aten and every fp32 packed kernel
    if choice not in every:
        choice = "aten"
    if choice == "aten":
        assert counts == {"linear_kept_aten": 2} and _packed_calls(gm) == []
    else:
        kernel = choice.removesuffix("_packed")
        assert counts == {"linear": 2, kernel: 2}
        assert _kernels_called(gm) == [kernel, kernel]
    _assert_same_gemm(gm, model, shape)


def test_without_onednn_the_choice_and_the_default_fall_back_cleanly(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    assert "onednn" not in kernels(CPU)
    model = Before().eval()
    # Asked for oneDNN without measuring: nothing to rewrite it to, and no crash.
    gm, counts = _rewrite(model, torch.randn(2, 5, 16), options={"kernel": "onednn"})
    assert counts == {} and _packed_calls(gm) == []
    if "mkl" not in kernels(CPU):
        assert not available(CPU)
        return
    cost = Chooses("onednn_packed")  # prefers what is not offered: falls back to aten
    gm, counts = _rewrite(model, torch.randn(2, 5, 16), cost=cost)
    assert cost.offered == [{"mkl_packed", "aten"}] * 2
    assert counts == {"linear_kept_aten": 2}
    cost = Chooses("mkl_packed")
    gm, counts = _rewrite(model, torch.randn(2, 5, 16), cost=cost)
    assert counts == {"linear": 2, "mkl": 2} and _kernels_called(gm) == ["mkl", "mkl"]
    _assert_same_gemm(gm, model, (2, 5, 16))


@requires_onednn
def test_without_mkl_the_choice_is_onednn_or_aten_and_the_default_rewrites_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.backends.mkl, "is_available", lambda: False)
    assert "mkl" not in kernels(CPU) and "onednn" in kernels(CPU) and available(CPU)
    model = Conv1D().eval()
    assert _rewrite(model, torch.randn(3, 4, 16))[1] == {}  # the default kernel is MKL's
    cost = Chooses("onednn_packed")
    gm, counts = _rewrite(model, torch.randn(3, 4, 16), cost=cost)
    assert cost.offered == [{"onednn_packed", "aten"}] * 2
    assert counts == {"linear": 2, "onednn": 2}
    _assert_same_gemm(gm, model, (3, 4, 16))


def test_an_unknown_kernel_is_refused() -> None:
    assert KERNELS == ("mkl", "onednn", "fbgemm_fp16", "fp32_rows", "fp32_stream",
                       "bf16_stream")
    with pytest.raises(ValueError, match="no kernel 'cublas'"):
        _rewrite(Before(), torch.randn(2, 5, 16), options={"kernel": "cublas"})
    with pytest.raises(ValueError, match="no kernel"):
        PackedLinear(torch.randn(4, 4), 2, "cublas")


@pytest.mark.parametrize("cache_bytes, cold, sweeps", [(2**40, False, [1, 1]), (1024, True, [1, 1]),
                                                      (4096, True, [2, 2])])
def test_weights_larger_than_the_last_level_cache_are_measured_from_memory(
        monkeypatch: pytest.MonkeyPatch, cache_bytes: int, cold: bool, sweeps: list[int],
) -> None:
    """A decoder step reads every weight once: where the linears' weights outgrow the
    last-level cache, each kernel is timed with its weight out of cache (each run sweeping
    copies of a weight smaller than the cache: 2 x 3 KiB against a 4 KiB cache here), and
    that choice is remembered apart from the in-cache one."""
    module = importlib.import_module("autoopt.passes.packed_linear")
    monkeypatch.setattr(module, "cpu_cache_bytes", lambda last_level=False: cache_bytes)
    cost = Chooses("onednn_packed" if "onednn" in kernels(CPU) else "aten")
    _rewrite(Before(), torch.randn(2, 5, 16), cost=cost)
    assert [c for _, c in cost.asked] == [cold, cold]
    assert cost.sweeps == sweeps
    assert all(what.endswith("|cold") == cold for what, _ in cost.asked)


def test_a_cold_choice_evicts_the_last_level_cache_before_each_timed_run(
        monkeypatch: pytest.MonkeyPatch) -> None:
    cost = CostModel("cpu", cache=CostCache.in_memory())
    evictions: list[bool] = []
    monkeypatch.setattr(cost, "evict_cache", lambda last_level=False: evictions.append(last_level))
    x = torch.randn(4, 8)
    for cold in (False, True):
        evictions.clear()
        cost.fastest(f"mm|cold={cold}", {"a": lambda: x @ x.t(), "b": lambda: x.mm(x.t())},
                     repeats=3, cold=cold)
        assert evictions == [cold] * 6  # two candidates, three rounds


@requires_onednn
def test_onednn_packs_in_its_default_layout_whatever_the_row_count(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The layout oneDNN picks when told one row streams from memory at 2/3 the speed of its
    default (docs/benchmarks.md, LLM decoding): a decode step's weights are packed without the
    hint."""
    calls: list[tuple[Any, ...]] = []
    reorder = torch.ops.mkldnn._reorder_linear_weight
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight",
                        lambda *args: calls.append(args[1:]) or reorder(*args))
    x = torch.randn(1, 16)
    for rows in (1, 32):
        weight = torch.randn(8, 16)  # its own: one weight's copy is shared across row counts
        linear = PackedLinear(weight, rows, "onednn")
        torch.testing.assert_close(linear(x, None), F.linear(x, weight))
    assert calls == [(), ()]


def test_a_linear_over_many_rows_is_measured_warm_even_where_weights_outgrow_the_cache(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Over more than 16 rows a GEMM reuses its weight from cache (bound by compute): where it
    was read from first hardly matters, and sweeping copies would only take longer."""
    module = importlib.import_module("autoopt.passes.packed_linear")
    monkeypatch.setattr(module, "cpu_cache_bytes", lambda last_level=False: 1024)
    cost = Chooses("aten")
    _rewrite(Before(), torch.randn(2, 9, 16), cost=cost)  # 18 rows
    assert [c for _, c in cost.asked] == [False, False] and cost.sweeps == [1, 1]


@requires_onednn
def test_graphs_of_one_model_share_one_onednn_copy_of_each_weight_until_it_is_written() -> None:
    """oneDNN's layout depends on the weight alone: graphs of one model (an example call, a
    decode step, a prompt step) call one packed copy, and a written weight gets a new one."""
    model = Before().eval()
    onednn = {"options": {"kernel": "onednn"}}
    first, _ = _rewrite(model, torch.randn(2, 5, 16), **onednn)
    second, _ = _rewrite(model, torch.randn(3, 4, 16), **onednn)
    up, down = _packed_calls(first)
    assert all(a.packed is b.packed for a, b in zip(_packed_calls(first),
                                                   _packed_calls(second), strict=True))
    with torch.no_grad():
        model.up.weight.add_(1.0)  # in place: a version bump
    third, _ = _rewrite(model, torch.randn(2, 5, 16), **onednn)
    new_up, same_down = _packed_calls(third)
    assert new_up.packed is not up.packed and same_down.packed is down.packed
    model.down.weight.data.mul_(2.0)  # through .data: no version bump, other values
    fourth, _ = _rewrite(model, torch.randn(2, 5, 16), **onednn)
    assert _packed_calls(fourth)[1].packed is not down.packed
    _assert_same_gemm(fourth, model, (2, 5, 16))
    del first, second, third, up, down, new_up, same_down
    gc.collect()
    held = {id(p.packed) for p in _packed_calls(fourth)}
    assert held <= {id(p) for p in _SHARED.values()}  # the live copies are found


@requires_onednn
def test_a_weight_made_under_inference_mode_is_packed_on_its_own() -> None:
    """An inference tensor keeps no version counter, so a write could not be told apart: its
    copy is not shared (and packing it does not fail)."""
    with torch.inference_mode():
        weight = torch.randn(8, 16)
    x = torch.randn(4, 16)
    first, second = PackedLinear(weight, 4, "onednn"), PackedLinear(weight, 4, "onednn")
    assert first.packed is not second.packed
    torch.testing.assert_close(first(x, None), F.linear(x, weight))


@requires_onednn
@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                    reason="oneDNN runs no bf16 on this CPU")
@pytest.mark.parametrize("shape", [(2, 5, 16), (1, 1, 16)])
@pytest.mark.parametrize("choice", ["onednn_packed", "fbgemm_fp16_packed", "bf16_stream_packed",
                                    "aten"])
def test_bf16_linears_are_offered_onednn_fbgemm_and_aten_and_compute_the_same(
        choice: str, shape: tuple[int, ...]) -> None:
    """precision='bf16' stores the linears' weights in bf16, and ATen's bf16 linear ran slower
    than oneDNN's packed one (a decode step's output projection: 9.2 against 7.6 ms from
    memory, 1 thread, Intel Xeon with AMX): bf16 linears are offered oneDNN's kernel and
    FBGEMM's fp16 GEMM beside ATen (MKL's packed sgemm is fp32 only), and at a decode step's
    row count autoopt's bf16 GEMV, with the dtype in the cost model's key, and the packed graph
    computes what ATen's does, within bf16 rounding."""
    if choice == "fbgemm_fp16_packed" and "fbgemm_fp16" not in kernels(CPU):
        pytest.skip("this PyTorch build has no FBGEMM engine")
    rows_kernels = math.prod(shape[:-1]) <= ROWS_KERNEL_MAX and block_kernels.unavailable() is None
    if choice == "bf16_stream_packed" and not rows_kernels:
        pytest.skip("autoopt's GEMVs take a decode step's few rows, on a CPU that builds them")
    model = Before().eval().to(torch.bfloat16)
    x = torch.randn(shape, dtype=torch.bfloat16)
    cost = Chooses(choice)
    gm, counts = _rewrite(model, x, cost=cost)
    offered = {f"{k}_packed" for k in kernels(CPU) if k in kernels_for(torch.bfloat16)}
    if not rows_kernels:
        offered -= {f"{k}_packed" for k in OWN_GEMV}
    assert cost.offered == [offered | {"aten"}] * 2
    assert all("torch.bfloat16" in what for what, _ in cost.asked)
    kernel = choice.removesuffix("_packed")
    if choice == "aten":
        assert counts == {"linear_kept_aten": 2}
    else:
        assert counts == {"linear": 2, kernel: 2} and _kernels_called(gm) == [kernel] * 2
    for _ in range(3):
        x = torch.randn(shape, dtype=torch.bfloat16)
        with torch.no_grad():
            got, want = gm(x), model(x)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    # Unmeasured, the default kernel (MKL's) takes no bf16: oneDNN's does.
    gm, counts = _rewrite(model, x)
    assert counts == {"linear": 2, "onednn": 2}
    # A bf16 linear with an fp32 bias is no kernel's: left as it is.
    mixed = Before().eval()
    mixed.up.weight.data = mixed.up.weight.data.to(torch.bfloat16)
    mixed.down.weight.data = mixed.down.weight.data.to(torch.bfloat16)
    with torch.no_grad():
        gm = export_graph(mixed, (x,), {})
    assert not packed_linear(gm, PassContext()).modified


@pytest.mark.skipif("fbgemm_fp16" not in kernels(CPU), reason="this PyTorch build has no "
                    "FBGEMM engine")
def test_fbgemm_fp16_computes_the_bf16_linear_in_fp32_and_packs_again_alike() -> None:
    """FBGEMM's fp16 GEMM on a bf16 weight (every bf16 value in fp16's normal range held
    exactly): the product of the bf16 weight and the bf16 input in fp32, rounded once, at one
    row (a decode step) and at many; dropped and packed again, the same bits; a weight beyond
    fp16's range is not offered it."""
    torch.manual_seed(0)
    weight = (torch.randn(48, 32) / 4).to(torch.bfloat16)
    bias = torch.randn(48).to(torch.bfloat16)
    kernel = PackedLinear(weight, 1, "fbgemm_fp16")
    for rows in ((1, 1, 32), (3, 7, 32)):
        x = torch.randn(rows).to(torch.bfloat16)
        got = kernel(x, bias)
        exact = (x.double() @ weight.double().t() + bias.double())
        assert got.dtype == torch.bfloat16 and got.shape == (*rows[:-1], 48)
        # One bf16 rounding of an fp32 product: within half a bf16 ulp, plus fp32's sum.
        assert ((got.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-5).all()
        torch.testing.assert_close(got, kernel.reference(x, bias), rtol=2**-7, atol=1e-5)
    expected = kernel(x, bias)
    derived = PackedLinear(weight.clone(), 1, "fbgemm_fp16", derived=True)
    assert derived.weight.is_meta  # the packed copy is all it holds
    torch.testing.assert_close(derived.reference(x, bias), kernel.reference(x, bias))
    assert kernel.release() > 0 and kernel.packed is None
    assert torch.equal(kernel(x, bias), expected)
    from autoopt.passes.packed_kernels import fits_fp16
    assert fits_fp16(weight) and not fits_fp16(torch.full((2, 2), 7e4, dtype=torch.bfloat16))


@pytest.mark.skipif(block_kernels.unavailable() is not None,
                    reason=f"autoopt's GEMVs need {block_kernels.unavailable()}")
def test_a_conv1d_weight_stored_in_bf16_is_streamed_row_by_row() -> None:
    """precision='bf16' stores a weight read only as a matmul's right side ((in, out):
    GPT-2's Conv1D) as its transpose laid out row by row, so that a decode step's GEMV reads
    its (out, in) rows without a second copy: every linear of a one-row Conv1D model can take
    ``bf16_stream``, and the graph computes what the model does within bf16 rounding."""
    torch.manual_seed(0)
    model, x = Conv1D().eval(), torch.randn(1, 1, 16)
    fast = autoopt.optimize(model, (x,), precision="bf16", backends=("aten",), pass_options={
        "packed_linear": {"measure": False, "kernel": "bf16_stream"}})
    gm = fast.specializations[0].graph
    packed = _packed_calls(gm)
    assert [k.kernel for k in packed] == ["bf16_stream"] * 2
    assert all(k.packed.dtype == torch.bfloat16 and k.packed.is_contiguous() for k in packed)
    assert {k.packed.data_ptr() for k in packed} <= {
        t.data_ptr() for t in gm.buffers()}  # the stored weights themselves: no copy
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(1, 1, 16)
            torch.testing.assert_close(fast(x), model(x), rtol=3e-2, atol=3e-2)
    assert model.weight.dtype == torch.float32 and model.weight.is_contiguous()
