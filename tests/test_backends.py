"""The backend stage: aten, Inductor and ONNX Runtime lowerings, verified, measured, cached.

Every test names its backends (the suite's default is ``aten`` alone, see conftest). No test
asserts which backend is fastest: that is this machine's measurement; tests that check the
choice's logic pin the measurement instead.
"""

from __future__ import annotations

import copy
import gc
import pickle
import threading
import weakref
from typing import Any

import pytest
import torch
import transformers
from torch import nn

import autoopt
from autoopt.backends import choice as choice_lib
from autoopt.backends import inductor
from autoopt.backends import onnxruntime as ort
from autoopt.backends.choice import Lowering, choose_backend
from autoopt.check.compare import VerifyResult
from autoopt.cost_model import CostCache, CostModel
from autoopt.errors import ConfigError

from .checks import assert_same_function
from .model_zoo import bert, token_ids

pytestmark = pytest.mark.filterwarnings("ignore")


def cnn() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.Conv2d(8, 8, 3, padding=1), nn.GELU(), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(8, 10))
    return model.eval(), (torch.randn(2, 3, 16, 16),), {}


def gpt2(dropout: float = 0.1) -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    config = transformers.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=2,
                                     n_positions=64, resid_pdrop=dropout, embd_pdrop=dropout,
                                     attn_pdrop=dropout)
    return transformers.GPT2LMHeadModel(config).eval(), (token_ids(),), {"use_cache": False}


MODELS = {"cnn": cnn, "bert": bert, "gpt2": gpt2}


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["inductor", "onnxruntime"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_each_backend_computes_the_models_function(name: str, backend: str) -> None:
    model, args, kwargs = MODELS[name]()
    fast = autoopt.optimize(model, args, kwargs, backend=backend)
    assert fast.specializations[0].backend == backend
    (choice,) = fast.report.backends
    assert (choice.graph, choice.chosen, choice.skipped) == ("whole graph", backend, {})
    assert f"backend {backend} for the whole graph" in str(fast.report)
    assert_same_function(model, fast, args, kwargs)


def _train_step(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                ) -> tuple[Any, list[torch.Tensor]]:
    out = module(*args, **kwargs)
    logits = out if isinstance(out, torch.Tensor) else out["logits"]
    logits.float().square().mean().backward()
    return logits.detach(), [p.grad.clone() for p in module.parameters()]


@pytest.mark.parametrize("name", ["cnn", "gpt2"])
def test_inductor_trains_with_eagers_gradients(name: str) -> None:
    model, args, kwargs = cnn() if name == "cnn" else gpt2(dropout=0.0)
    model.train()
    reference = copy.deepcopy(model)
    fast = autoopt.optimize(model, args, kwargs, training=True, backend="inductor")
    assert fast.specializations[0].backend == "inductor"
    for _ in range(2):  # a second step: BatchNorm's statistics moved, gradients accumulate
        expected, expected_grads = _train_step(reference, args, kwargs)
        actual, grads = _train_step(fast, args, kwargs)
        torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5)
        for g, e in zip(grads, expected_grads, strict=True):
            torch.testing.assert_close(g, e, rtol=1e-3, atol=1e-5)
    for name_, b in reference.named_buffers():
        torch.testing.assert_close(dict(fast.module.named_buffers())[name_], b)


class TwoHeads(nn.Module):
    """A trunk and a head: ``head`` reaches the second output only (BERT's pooler)."""

    def __init__(self, shared_head: bool = False) -> None:
        super().__init__()
        self.trunk, self.head = nn.Linear(8, 8), nn.Linear(8, 8)
        self.shared_head = shared_head

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.trunk(x))
        y = self.head(h)
        return (h + 0 * y, y) if self.shared_head else (h, y)


def test_inductor_is_not_used_where_a_parameter_reaches_only_some_outputs() -> None:
    """A compiled backward is one autograd node: a loss on the first output hands it zeros
    for the second, so the head would get zero gradients where eager leaves them None (and an
    optimizer with weight decay would move it)."""
    model, x = TwoHeads().train(), torch.randn(4, 8)
    fast = autoopt.optimize(model, (x,), training=True, backends=("aten", "inductor"))
    (choice,) = fast.report.backends
    assert choice.chosen == "aten" and "reach only some" in choice.skipped["inductor"]
    assert "head.weight" in choice.skipped["inductor"]
    fast(x)[0].sum().backward()
    model(x)[0].sum().backward()
    assert fast.module.head.weight.grad is None and model.head.weight.grad is None
    torch.testing.assert_close(fast.module.trunk.weight.grad, model.trunk.weight.grad)
    with pytest.raises(ConfigError, match="reach only some"):
        autoopt.optimize(TwoHeads().train(), (x,), training=True, backend="inductor")
    # Where every parameter reaches every output, Inductor is a candidate.
    fast = autoopt.optimize(TwoHeads(shared_head=True).train(), (x,), training=True,
                            backend="inductor")
    assert fast.specializations[0].backend == "inductor"


class _Smooth(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(8), nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(self.norm(x))
        return x + self.down(h * torch.sigmoid(h) + torch.sin(h) * 0.1 + torch.tanh(h * h))


def test_inductor_training_takes_a_second_backward_and_a_gradient_penalty() -> None:
    """``loss.backward(retain_graph=True)`` then another backward (several losses, a GAN)
    raised AOTAutograd's "compiled with non-empty donated buffers" once Inductor was chosen
    for the training graph; a gradient penalty (``create_graph=True`` with respect to the
    input, then backward) raised "does not currently support double backward". Eager runs
    both: the first now runs too, and a call whose input requires grad is not lowered by
    Inductor (the report says why)."""
    torch.manual_seed(0)
    model, x = _Smooth().train(), torch.randn(4, 8)
    reference = copy.deepcopy(model)

    def twice(module: nn.Module) -> torch.Tensor:
        loss = module(x).pow(2).mean()
        loss.backward(retain_graph=True)
        loss.backward()
        return getattr(module, "module", module).up.weight.grad

    def penalty(module: nn.Module) -> torch.Tensor:
        xi = x.clone().requires_grad_()
        (g,) = torch.autograd.grad(module(xi).pow(2).sum(), xi, create_graph=True)
        g.pow(2).sum().backward()
        return getattr(module, "module", module).up.weight.grad

    fast = autoopt.optimize(model, (x,), training=True, backend="inductor")
    assert fast.specializations[0].backend == "inductor"
    torch.testing.assert_close(twice(fast), twice(reference), rtol=1e-4, atol=1e-6)
    with pytest.raises(ConfigError, match="an input requires grad"):
        penalty(fast)  # inductor required, and it cannot serve this call
    fast = autoopt.optimize(model, (x,), training=True, backends=("inductor", "aten"))
    for p in (*fast.parameters(), *reference.parameters()):
        p.grad = None
    torch.testing.assert_close(penalty(fast), penalty(reference), rtol=1e-4, atol=1e-6)


def test_inductor_trains_with_dropout_drawing_eagers_masks() -> None:
    """A training graph with dropout: Inductor draws the masks with ATen's random ops
    (``fallback_random``), so its step is eager's on the same RNG and verification keeps it
    (with its own masks it differed from eager, and BERT and GPT-2 never got Inductor)."""
    model, args, kwargs = gpt2(dropout=0.1)
    model.train()
    reference = copy.deepcopy(model)
    fast = autoopt.optimize(model, args, kwargs, training=True, backend="inductor")
    assert fast.specializations[0].backend == "inductor"
    torch.manual_seed(1)
    expected, expected_grads = _train_step(reference, args, kwargs)
    torch.manual_seed(1)
    actual, grads = _train_step(fast, args, kwargs)
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5)
    for g, e in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-3, atol=1e-5)


def test_onnxruntime_is_skipped_for_training_and_forcing_it_raises() -> None:
    model, args, kwargs = cnn()
    model.train()
    fast = autoopt.optimize(model, args, kwargs, training=True,
                            backends=("aten", "onnxruntime"))
    (choice,) = fast.report.backends
    assert choice.chosen == "aten"
    assert "inference only" in choice.skipped["onnxruntime"]
    with pytest.raises(ConfigError, match="inference only"):
        autoopt.optimize(model, args, kwargs, training=True, backend="onnxruntime")


def test_a_missing_backend_is_skipped_with_its_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ort, "available", lambda: "onnxruntime is not installed (pip install "
                                                  "onnxruntime)")
    model, args, kwargs = cnn()
    fast = autoopt.optimize(model, args, kwargs, backends=("aten", "onnxruntime"))
    (choice,) = fast.report.backends
    assert choice.chosen == "aten" and choice.seconds == {}
    assert choice.skipped == {"onnxruntime": "onnxruntime is not installed (pip install "
                                             "onnxruntime)"}
    assert "not onnxruntime: onnxruntime is not installed" in str(fast.report)
    assert_same_function(model, fast, args, kwargs)
    with pytest.raises(ConfigError, match="not installed"):
        autoopt.optimize(model, args, kwargs, backend="onnxruntime")


def test_a_backend_that_fails_or_differs_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*_: Any, **__: Any) -> Any:
        raise RuntimeError("no kernel for this op")

    real = ort.lower

    def wrong(*a: Any, **k: Any) -> Any:
        session = real(*a, **k)
        return lambda *x, **y: session(*x, **y) + 1.0  # off by one: verification must see it

    monkeypatch.setattr(inductor, "lower", broken)
    monkeypatch.setattr(ort, "lower", wrong)
    model, args, kwargs = cnn()
    fast = autoopt.optimize(model, args, kwargs,
                            backends=("aten", "inductor", "onnxruntime"))
    (choice,) = fast.report.backends
    assert choice.chosen == "aten"
    assert choice.skipped["inductor"] == "failed to lower: RuntimeError: no kernel for this op"
    assert choice.skipped["onnxruntime"].startswith("differs from eager")
    assert_same_function(model, fast, args, kwargs)
    with pytest.raises(ConfigError, match="differs from eager"):
        autoopt.optimize(model, args, kwargs, backend="onnxruntime")


def test_a_measured_choice_is_cached_and_keyed(monkeypatch: pytest.MonkeyPatch,
                                               tmp_path: Any) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # a cache no other test wrote
    built: list[str] = []
    real = ort.lower

    def counting(*a: Any, **k: Any) -> Any:
        built.append("onnxruntime")
        return real(*a, **k)

    monkeypatch.setattr(ort, "lower", counting)
    model, args, kwargs = cnn()

    def choose() -> Any:
        built.clear()
        fast = autoopt.optimize(model, args, kwargs, backends=("aten", "onnxruntime"))
        assert_same_function(model, fast, args, kwargs)
        return fast.report.backends[0]

    first = choose()
    assert not first.cached and set(first.seconds) == {"aten", "onnxruntime"}
    assert built == ["onnxruntime"]
    again = choose()
    assert again.cached and again.seconds == first.seconds and again.chosen == first.chosen
    assert built == (["onnxruntime"] if first.chosen == "onnxruntime" else [])  # the winner
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads != 1 else 2)
        assert not choose().cached  # measured at another thread count: not reused
    finally:
        torch.set_num_threads(threads)
    assert choose().cached
    monkeypatch.setattr("autoopt.cost_model.model.library_versions", lambda: "torch=0.0")
    assert not choose().cached  # another torch
    monkeypatch.undo()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(ort, "version", lambda: "0.0")
    assert not choose().cached  # another ONNX Runtime


class _PinnedCost(CostModel):
    """A cost model whose measurements are given, to check the choice without a clock."""

    def __init__(self, seconds: dict[str, float]) -> None:
        super().__init__("cpu", CostCache.in_memory())
        self.seconds = seconds
        self.timed: list[list[str]] = []

    def fastest(self, what: str, candidates: dict[str, Any], *_: Any, cache_as: Any = None,
                **__: Any) -> tuple[str, dict[str, float]]:
        self.timed.append(sorted(candidates))
        seconds = {name: self.seconds[name] for name in candidates}
        self.cache.put(self._fastest_key(what, cache_as or candidates), seconds)
        return min(seconds, key=seconds.__getitem__), seconds


def test_the_fastest_verified_candidate_wins_and_only_it_is_rebuilt() -> None:
    builds: list[str] = []

    def lowering(name: str, ok: bool = True) -> Lowering:
        def build() -> Any:
            builds.append(name)
            return lambda: name if ok else "wrong"
        return Lowering(name, build)

    def verify(run: Any) -> VerifyResult:
        return VerifyResult(run() != "wrong", detail="" if run() != "wrong" else "outputs differ")

    cost = _PinnedCost({"aten": 3.0, "inductor": 1.0, "onnxruntime": 2.0})
    candidates = [lowering("aten"), lowering("inductor"), lowering("onnxruntime", ok=False)]

    def choose() -> Any:
        builds.clear()
        return choose_backend("whole graph", candidates, {}, verify=verify,
                              timer=lambda run: run, cost_model=cost, what="g",
                              required=False, gradients=False)

    run, choice = choose()
    assert run() == "inductor" and choice.chosen == "inductor" and not choice.cached
    assert cost.timed == [["aten", "inductor"]]  # the candidate that differs is not timed
    assert choice.skipped == {"onnxruntime": "differs from eager (outputs differ)"}
    run, choice = choose()
    assert (run(), choice.cached, builds) == ("inductor", True, ["inductor"])
    # Not tried again (it computes another function), and not hidden: its reason stays.
    assert choice.skipped["onnxruntime"].startswith("differs from eager (outputs differ)")
    with pytest.raises(ConfigError, match="no backend of"):
        choose_backend("whole graph", [lowering("onnxruntime", ok=False)], {}, verify=verify,
                       timer=lambda run: run, cost_model=cost, what="h", required=True,
                       gradients=False)


class _DriftingCost(CostModel):
    """Given seconds, each measuring session slower than the last by ``drift``, as a machine
    whose load changes between sessions (within one, interleaved rounds slow all alike)."""

    def __init__(self, seconds: dict[str, float], drift: float) -> None:
        super().__init__("cpu", CostCache.in_memory())
        self.base, self.drift, self.timed = seconds, drift, []

    def fastest(self, what: str, candidates: dict[str, Any], *_: Any, **__: Any,
                ) -> tuple[str, dict[str, float]]:
        factor = self.drift ** len(self.timed)
        self.timed.append(sorted(candidates))
        seconds = {name: self.base[name] * factor for name in candidates}
        return min(seconds, key=seconds.__getitem__), seconds


@pytest.mark.parametrize("onnxruntime_s, winner", [(1.8, "onnxruntime"), (3.9, "hybrid")])
def test_candidates_are_timed_against_eager_with_the_packed_weights_dropped_meanwhile(
        onnxruntime_s: float, winner: str) -> None:
    events: list[str] = []

    def lowering(name: str, memory: int = 0, packed: bool = False) -> Lowering:
        def build() -> Any:
            events.append(f"build {name}")
            return lambda: name
        return Lowering(name, build, verified=True, memory=memory,
                        release=(lambda: events.append("release") or 100) if packed else None,
                        restore=(lambda: events.append("restore")) if packed else None)

    candidates = [lowering("aten", packed=True), lowering("hybrid", packed=True),
                  lowering("inductor", memory=10), lowering("onnxruntime", memory=10)]
    # Each later session runs 3x slower: compared by their own times, the first measured
    # would always win; by their time over eager's, the fastest does.
    cost = _DriftingCost({"eager": 4.0, "aten": 2.0, "hybrid": 1.9, "inductor": 3.0,
                          "onnxruntime": onnxruntime_s}, drift=3.0)

    def eager() -> str:
        return "eager"

    def choose() -> Any:
        events.clear()
        return choose_backend("whole graph", candidates, {}, verify=None,
                              timer=lambda run: run, cost_model=cost, what="g",
                              required=False, gradients=False, reference=eager)

    run, choice = choose()
    assert (run(), choice.chosen) == (winner, winner)
    assert cost.timed == [["aten", "eager"], ["eager", "hybrid"], ["eager", "inductor"],
                          ["eager", "onnxruntime"]]
    # Dropped before each candidate with copies of its own is built; packed again at the end
    # when the winner reads them.
    assert events == ["build aten", "build hybrid", "release", "build inductor", "release",
                      "build onnxruntime"] + (["restore"] if winner == "hybrid" else [])
    ratios = {name: seconds / choice.seconds["aten"] for name, seconds in choice.seconds.items()}
    assert ratios == pytest.approx({"aten": 1.0, "hybrid": 0.95, "inductor": 1.5,
                                    "onnxruntime": onnxruntime_s / 2})
    # Eager's time of the first session, the scale of every candidate's seconds.
    assert choice.eager_s == 4.0 and "; eager 4e+03 ms" in choice.describe()
    run, again = choose()  # cached: the winner alone is built, nothing timed
    assert (run(), again.cached, again.seconds) == (winner, True, choice.seconds)
    assert again.eager_s == 4.0
    assert events == [f"build {winner}"] and len(cost.timed) == 4


def test_onnxruntime_is_built_with_the_aten_lowerings_packed_weights_dropped(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # measured here, not read back
    from autoopt.backends import whole_graph
    from autoopt.passes.packed_linear import PackedLinear

    graphs: list[Any] = []
    real_release, real_lower = whole_graph.release_packed, ort.lower

    def release(gm: Any) -> int:
        graphs.append(gm)
        return real_release(gm)

    def kernels() -> list[PackedLinear]:
        return [n.target for gm in graphs for n in gm.graph.nodes
                if isinstance(n.target, PackedLinear)]

    packed_while_built: list[bool] = []

    def lower(*a: Any, **k: Any) -> Any:
        packed_while_built.extend(kernel.packed is not None for kernel in kernels())
        return real_lower(*a, **k)

    monkeypatch.setattr(whole_graph, "release_packed", release)
    monkeypatch.setattr(ort, "lower", lower)
    model, args, kwargs = bert()
    fast = autoopt.optimize(model, args, kwargs, backends=("aten", "onnxruntime"),
                            pass_options={"packed_linear": {"measure": False}})
    (choice,) = fast.report.backends
    assert set(choice.seconds) == {"aten", "onnxruntime"}  # both built, verified, timed
    assert packed_while_built and not any(packed_while_built)
    # The winner runs the calls; aten's weights are packed again where it won.
    assert all(kernel.packed is not None for kernel in kernels()) == (choice.chosen == "aten")
    assert_same_function(model, fast, args, kwargs)


@pytest.mark.parametrize("reference", [lambda: "eager", None], ids=["against eager", "pairs"])
def test_a_candidate_within_the_margin_does_not_replace_an_earlier_one(reference: Any) -> None:
    """1% faster is within the noise of interleaved medians: the earlier, cheaper candidate
    stays, now and when the record is read back; 5% faster replaces it."""
    builds: list[str] = []

    def lowering(name: str) -> Lowering:
        return Lowering(name, lambda: builds.append(name) or (lambda: name), verified=True)

    cost = _DriftingCost({"eager": 4.0, "aten": 2.0, "hybrid": 1.98, "inductor": 1.97,
                          "onnxruntime": 1.9}, drift=1.0)

    def choose(names: list[str]) -> Any:
        builds.clear()
        return choose_backend("whole graph", [lowering(n) for n in names], {}, verify=None,
                              timer=lambda run: run, cost_model=cost, what="+".join(names),
                              required=False, gradients=False, reference=reference)

    run, choice = choose(["aten", "hybrid", "inductor"])
    assert (run(), choice.chosen, choice.cached) == ("aten", "aten", False)
    assert "aten kept, earlier in the order of preference: inductor measured only 1.5% " \
           "faster" in choice.describe()
    if reference is not None:  # the record (this stub stores only what is timed on eager)
        run, again = choose(["aten", "hybrid", "inductor"])
        assert (run(), again.chosen, again.cached, builds) == ("aten", "aten", True, ["aten"])
    run, choice = choose(["aten", "hybrid", "inductor", "onnxruntime"])
    assert (run(), choice.chosen) == ("onnxruntime", "onnxruntime")
    assert "kept" not in choice.describe()
    if reference is not None:
        run, again = choose(["aten", "hybrid", "inductor", "onnxruntime"])
        assert (run(), again.cached, builds) == ("onnxruntime", True, ["onnxruntime"])
    assert choice_lib.decided(["hybrid", "aten"], {"aten": 2.0, "hybrid": 2.03}) == "hybrid"


@pytest.mark.parametrize("hybrid_ok", [True, False])
def test_a_dominated_candidate_is_skipped_once_what_dominates_it_is_built(
        hybrid_ok: bool) -> None:
    """inductor, dominated by hybrid: not built (nor aten's packed weights dropped for it)
    once hybrid is built and verified; built and measured where hybrid failed to verify."""
    events: list[str] = []

    def lowering(name: str, **extra: Any) -> Lowering:
        def build() -> Any:
            events.append(f"build {name}")
            return lambda: name if hybrid_ok or name != "hybrid" else "wrong"
        return Lowering(name, build, **extra)

    def verify(run: Any) -> VerifyResult:
        return VerifyResult(run() != "wrong", detail="outputs differ")

    packed = {"release": lambda: events.append("release") or 100,
              "restore": lambda: events.append("restore")}
    candidates = [lowering("aten", verified=True, **packed), lowering("hybrid", **packed),
                  lowering("inductor", memory=10, dominated_by=("hybrid", "hybrid covers it")),
                  lowering("onnxruntime", memory=10)]
    cost = _DriftingCost({"eager": 4.0, "aten": 2.0, "hybrid": 1.9, "inductor": 1.0,
                          "onnxruntime": 3.0}, drift=1.0)
    run, choice = choose_backend("whole graph", candidates, {}, verify=verify,
                                 timer=lambda run: run, cost_model=cost, what="g",
                                 required=False, gradients=False, reference=lambda: "eager")
    if hybrid_ok:
        assert choice.skipped == {"inductor": "hybrid covers it"}
        assert events == ["build aten", "build hybrid", "release", "build onnxruntime",
                          "restore"]
        assert (run(), set(choice.seconds)) == ("hybrid", {"aten", "hybrid", "onnxruntime"})
        # The record of that choice does not serve one asked to measure every candidate.
        candidates[2].dominated_by = None
        run, choice = choose_backend("whole graph", candidates, {}, verify=verify,
                                     timer=lambda run: run, cost_model=cost, what="g",
                                     required=False, gradients=False,
                                     reference=lambda: "eager")
        assert (run(), choice.cached, choice.skipped) == ("inductor", False, {})
    else:
        assert choice.skipped == {"hybrid": "differs from eager (outputs differ)"}
        assert "build inductor" in events and run() == "inductor"


def test_inductor_is_dominated_by_hybrid_only_on_a_cpu_with_the_default_candidates() -> None:
    from autoopt.backends.inductor import dominated as _inductor_dominated
    from autoopt.options.config import OptimizeConfig

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert _inductor_dominated(OptimizeConfig(), cpu)[0] == "hybrid"
    assert _inductor_dominated(OptimizeConfig(), cuda) is None  # Triton's GEMMs
    for config in (OptimizeConfig(backends=("aten", "hybrid", "inductor")),
                   OptimizeConfig(backend_options={"inductor": {"mode": "max-autotune"}}),
                   OptimizeConfig(disable=("packed_linear",)),
                   OptimizeConfig(disable=("onednn_conv",))):
        assert _inductor_dominated(config, cpu) is None


def test_a_lone_candidate_is_not_timed() -> None:
    cost = _DriftingCost({"eager": 1.0, "aten": 1.0}, drift=1.0)
    run, choice = choose_backend(
        "whole graph", [Lowering("aten", lambda: "a", verified=True)],
        {"onnxruntime": "not installed"}, verify=None, timer=lambda run: run, cost_model=cost,
        what="x", required=False, gradients=False, reference=lambda: "eager")
    assert (run, choice.chosen, choice.seconds, cost.timed) == ("a", "aten", {}, [])


def test_a_candidate_skipped_when_the_choice_was_cached_is_measured_once_it_applies() -> None:
    """A record of a choice made while a backend did not apply (not installed, or a kind of
    graph it skipped then) does not hide it once it does: the choice is measured again."""
    cost = _DriftingCost({"eager": 4.0, "aten": 2.0, "inductor": 3.0, "onnxruntime": 1.0},
                         drift=1.0)

    def choose(names: list[str], skipped: dict[str, str]) -> Any:
        return choose_backend(
            "whole graph", [Lowering(n, lambda n=n: n, verified=True) for n in names], skipped,
            verify=None, timer=lambda run: run, cost_model=cost, what="x", required=False,
            gradients=False, reference=lambda: "eager")[1]

    first = choose(["aten", "inductor"], {"onnxruntime": "not installed"})
    assert (first.chosen, first.cached) == ("aten", False)
    again = choose(["aten", "inductor"], {"onnxruntime": "not installed"})
    assert (again.chosen, again.cached) == ("aten", True)  # the record serves
    now = choose(["aten", "inductor", "onnxruntime"], {})
    assert (now.chosen, now.cached) == ("onnxruntime", False)
    assert choose(["aten", "inductor", "onnxruntime"], {}).cached


class Branchy(nn.Module):
    """Two linears with a data-dependent branch between them: two Dynamo subgraphs."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.a(x))
        if y.sum() > 0:  # data-dependent: Dynamo breaks the graph here
            y = y * 2
        return self.b(y).softmax(-1)


def test_dynamo_subgraphs_choose_their_backends() -> None:
    model, x = Branchy().eval(), torch.randn(4, 16)
    fast = autoopt.optimize(model, (x,), backends=("aten", "inductor", "onnxruntime"))
    assert fast.report.capture_method == "dynamo"
    choices = fast.report.backends
    assert [c.graph for c in choices] == ["subgraph 1", "subgraph 2"]
    assert all(c.chosen in ("aten", "inductor") and "onnxruntime" in c.skipped
               for c in choices)
    assert_same_function(model, fast, (x,), {})
    with pytest.raises(ConfigError, match="Dynamo subgraph"):
        autoopt.optimize(model, (x,), backend="onnxruntime")


@pytest.mark.parametrize("backend", ["inductor", "onnxruntime"])
def test_weights_written_after_lowering_are_used(backend: str) -> None:
    # Both backends hold the weights as constants of their own (Inductor's freezing, the
    # ONNX file's initializers): a write must not be answered from the stale copy.
    model, args, kwargs = cnn()
    fast = autoopt.optimize(model, args, kwargs, backend=backend)
    with torch.no_grad():
        fast.module[0].weight.mul_(-2.0)
        fast.module[1].running_mean.add_(0.5)
        torch.testing.assert_close(fast(*args), copy.deepcopy(fast.module)(*args))


def test_onnxruntime_from_threads_and_on_new_shapes() -> None:
    model, args, kwargs = bert()
    fast = autoopt.optimize(model, args, kwargs, backends=("onnxruntime",))
    assert fast.specializations[0].backend == "onnxruntime"
    inputs = [(token_ids(2, 16),), (token_ids(3, 8),)]  # the second: a new signature
    with torch.no_grad():
        expected = [model(*a, attention_mask=torch.ones_like(a[0])) for a in inputs]
    results: dict[int, Any] = {}

    def call(i: int) -> None:
        with torch.no_grad():
            a = inputs[i % 2]
            results[i] = fast(*a, attention_mask=torch.ones_like(a[0]))

    threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, out in results.items():
        torch.testing.assert_close(out.last_hidden_state, expected[i % 2].last_hidden_state,
                                   rtol=1e-4, atol=1e-4)
    assert [s.backend for s in fast.specializations] == ["onnxruntime", "onnxruntime"]


@pytest.mark.parametrize("backend", ["inductor", "onnxruntime"])
def test_a_dynamic_graph_is_lowered_once_and_serves_every_size(backend: str) -> None:
    """ONNX Runtime's file keeps the graph's symbolic sizes as dynamic axes, as Inductor's
    code does: one lowering, measured at the traced sizes, serves every batch."""
    if backend == "onnxruntime":
        pytest.importorskip("onnxruntime")
    model, args, kwargs = cnn()
    fast = autoopt.optimize(model, args, kwargs, dynamic=True, backend=backend)
    (choice,) = fast.report.backends
    assert choice.chosen == backend and not choice.skipped
    for batch in (3, 5, 7):  # (export specializes a size of 1)
        x = torch.randn(batch, 3, 16, 16)
        with torch.no_grad():
            torch.testing.assert_close(fast(x), model(x), rtol=1e-4, atol=1e-5)
    assert len(fast.specializations) == 1


def test_backend_options_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    model, args, kwargs = cnn()
    with pytest.raises(ConfigError, match="not a backend"):
        autoopt.optimize(model, args, kwargs, backend="tvm")
    with pytest.raises(ConfigError, match="not both"):
        autoopt.optimize(model, args, kwargs, backend="aten", backends=("aten",))
    with pytest.raises(ConfigError, match="unknown backend"):
        autoopt.optimize(model, args, kwargs, backends=("aten", "xla"))
    with pytest.raises(ConfigError, match="backends is empty"):
        autoopt.optimize(model, args, kwargs, backends=())
    with pytest.raises(ConfigError, match="pipeline stage on aten"):
        autoopt.optimize(model, args, kwargs, devices=["cpu", "cpu"], backend="inductor")
    assert autoopt.OptimizeConfig(devices=("cpu",)).candidate_backends == ("aten",)
    monkeypatch.setenv("AUTOOPT_BACKENDS", "aten,tensorrt")
    with pytest.raises(ConfigError, match="AUTOOPT_BACKENDS"):
        autoopt.optimize(model, args, kwargs)
    monkeypatch.setenv("AUTOOPT_BACKENDS", "onnxruntime")
    fast = autoopt.optimize(model, args, kwargs)
    assert fast.report.backends[0].chosen == "onnxruntime"


def test_measuring_failure_keeps_a_verified_candidate(monkeypatch: pytest.MonkeyPatch) -> None:
    cost = CostModel("cpu", CostCache.in_memory())

    def broken(*_: Any, **__: Any) -> Any:
        raise RuntimeError("timer crashed")

    monkeypatch.setattr(cost, "fastest", broken)
    run, choice = choice_lib.choose_backend(
        "whole graph", [Lowering("aten", lambda: "a", verified=True),
                        Lowering("inductor", lambda: "i", verified=True)], {},
        verify=None, timer=lambda run: run, cost_model=cost, what="x", required=False,
        gradients=False)
    assert (run, choice.chosen) == ("a", "aten")
    assert "timer crashed" in choice.skipped["inductor"]


@pytest.mark.parametrize("backends", [("aten",), ("inductor",), ("onnxruntime",)])
def test_a_dropped_module_frees_its_graphs_and_generated_code(backends: tuple[str, ...]) -> None:
    # Inductor keeps every module it loads in process-wide lists, and with freezing those hold
    # the frozen weights; an optimized module must not outlive its last reference either.
    from torch._inductor.codecache import PyCodeCache

    model, args, kwargs = cnn()
    gc.collect()
    before = {id(m) for m in PyCodeCache.modules}
    with torch.no_grad():
        fast = autoopt.optimize(model, args, kwargs, backends=backends)
        fast(*args)
    ours = {id(m) for m in PyCodeCache.modules} - before
    assert bool(ours) == (backends == ("inductor",))
    alive = weakref.ref(fast)
    run = weakref.ref(fast.specializations[0].graph)
    del fast
    gc.collect()
    assert alive() is None and run() is None
    assert not ours & {id(m) for m in PyCodeCache.modules}


def test_dynamo_subgraphs_with_gradients_measure_inductor_without_breaking_the_compile(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    # Timing a candidate's backward inside Dynamo's compilation of the frame made AOTAutograd
    # compile Inductor's backward nested in it, and Dynamo then failed the whole frame.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # measured here, not read from a cache

    model, x = Branchy().train(), torch.randn(4, 16)
    reference = copy.deepcopy(model)
    fast = autoopt.optimize(model, (x,), training=True, backends=("aten", "inductor"))
    assert fast.report.capture_method == "dynamo"
    assert all(c.seconds for c in fast.report.backends)  # both candidates were timed
    expected, expected_grads = _train_step(reference, (x,), {})
    actual, grads = _train_step(fast, (x,), {})
    torch.testing.assert_close(actual, expected)
    for g, e in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-6)


class _RunningMean(nn.Module):
    """A running statistic kept in a parameter (an older idiom than a buffer), updated in
    place by the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.mean = nn.Parameter(torch.zeros(8), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)
        with torch.no_grad():
            self.mean.mul_(0.9).add_(0.1 * h.mean(0))
        return h - self.mean


def test_dynamo_subgraphs_that_write_parameters_write_them_once(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """A Dynamo subgraph takes its parameters as inputs (or reads them, and an optimizer's
    momentum, as attributes, after another compile in the process), which measuring runs did
    not copy (nor put back):
    ``torch.compile(backend="autoopt")`` over a step ending in ``optimizer.step()``, or a
    statistic kept in a parameter, applied the update once per candidate run (SGD with
    momentum: parameters 7.2 off after one step, 42,623 after three)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # measured here: several runs
    options = {"backends": ("aten", "inductor")}
    torch.manual_seed(0)
    model = _RunningMean().eval()
    twin = copy.deepcopy(model)
    compiled = torch.compile(model, backend="autoopt", options=options)
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(4, 8)
            torch.testing.assert_close(compiled(x), twin(x))
            torch.testing.assert_close(model.mean, twin.mean)

    torch._dynamo.reset()
    model = nn.Linear(8, 4)
    twin = copy.deepcopy(model)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sgd_twin = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9)

    @torch.compile(backend="autoopt", options=options)
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        sgd.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        sgd.step()
        return loss

    for _ in range(2):
        x, y = torch.randn(16, 8), torch.randn(16, 4)
        step(x, y)
        sgd_twin.zero_grad()
        torch.nn.functional.mse_loss(twin(x), y).backward()
        sgd_twin.step()
        for p, q in zip(model.parameters(), twin.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("training", [False, True])
def test_backends_on_a_gpu(training: bool) -> None:
    # Inductor generates Triton kernels here; ONNX Runtime runs where onnxruntime-gpu is
    # installed (otherwise skipped with the reason), tensors bound on the device.
    model, args, kwargs = cnn()
    model = model.cuda().train(training)
    args = (args[0].cuda(),)
    reference = copy.deepcopy(model)
    fast = autoopt.optimize(model, args, kwargs, training=training,
                            backends=("aten", "inductor", "onnxruntime"))
    (choice,) = fast.report.backends
    assert "inductor" in choice.seconds, choice.describe()
    if training:
        assert "inference only" in choice.skipped["onnxruntime"]
        expected, expected_grads = _train_step(reference, args, kwargs)
        actual, grads = _train_step(fast, args, kwargs)
        torch.testing.assert_close(actual, expected, rtol=1e-3, atol=1e-3)
        for g, e in zip(grads, expected_grads, strict=True):
            torch.testing.assert_close(g, e, rtol=1e-2, atol=1e-3)
    else:
        assert "onnxruntime" in choice.seconds or "provider" in choice.skipped.get(
            "onnxruntime", "provider")
        with torch.no_grad():
            torch.testing.assert_close(fast(*args), reference(*args), rtol=1e-3, atol=1e-3)


def test_inductor_settings_reach_the_compile_and_key_the_cache(
        monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[dict[str, Any]] = []
    real = torch.compile

    def spy(model: Any, **kwargs: Any) -> Any:
        seen.append(kwargs)
        return real(model, backend="inductor", fullgraph=True, dynamic=kwargs["dynamic"],
                    options={"freezing": True})  # compiled as usual: no autotuning here

    monkeypatch.setattr(torch, "compile", spy)
    model, args, kwargs = cnn()
    fast = autoopt.optimize(model, args, kwargs, backend="inductor", backend_options={
        "inductor": {"mode": "max-autotune", "options": {"coordinate_descent_tuning": False}}})
    options = seen[-1]["options"]
    assert options["max_autotune"] is True and options["freezing"] is True
    assert options["coordinate_descent_tuning"] is False  # the user's option wins
    assert "triton.cudagraphs" not in options  # replays would reuse held outputs' memory
    assert fast.specializations[0].backend == "inductor"
    assert_same_function(model, fast, args, kwargs)
    with pytest.raises(ConfigError, match="settable are"):
        autoopt.optimize(model, args, kwargs, backend_options={"inductor": {"modes": "x"}})


@pytest.mark.parametrize("backend", ["inductor", "onnxruntime"])
def test_a_saved_module_captures_again_and_trains_after_inference(backend: str) -> None:
    # What a user does after the first call: save and load it (generated code and sessions
    # belong to this process, so the loaded module captures anew), then switch to training.
    model, args, kwargs = cnn()
    fast = autoopt.optimize(model, args, kwargs, backend=backend)
    loaded = pickle.loads(pickle.dumps(fast))
    assert loaded.specializations == ()
    with torch.no_grad():
        torch.testing.assert_close(loaded(*args), model(*args), rtol=1e-4, atol=1e-5)
    assert loaded.specializations[0].backend == backend
    fast.train()
    reference = copy.deepcopy(model).train()
    if backend == "onnxruntime":  # inference only: a call with gradients needs another one
        with pytest.raises(ConfigError, match="inference only"):
            _train_step(fast, args, kwargs)
        return
    expected, expected_grads = _train_step(reference, args, kwargs)
    actual, grads = _train_step(fast, args, kwargs)
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5)
    for g, e in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-3, atol=1e-5)


class _Lookup(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(50, 16), nn.Linear(16, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids).relu())


@pytest.mark.skipif(bool(inductor.available()), reason="needs Inductor in this build")
def test_an_error_in_inductors_code_reaches_the_caller_as_itself() -> None:
    """A token id past the vocabulary, under Inductor with symbolic sizes, raised Dynamo's
    'Attempt to trace generator' (the graph module's own error report, traced) instead of the
    out-of-bounds index the generated code found."""
    model = _Lookup().eval()
    ids = torch.randint(0, 50, (2, 6))
    fast = autoopt.optimize(model, (ids,), backend="inductor", dynamic=True)
    with torch.no_grad():
        torch.testing.assert_close(fast(ids[:, :5]), model(ids[:, :5]))
        with pytest.raises(Exception, match="index out of bounds") as raised:
            fast(torch.full((2, 6), 60))
    assert "generator" not in str(raised.value)
