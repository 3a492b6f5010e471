"""The ``hybrid`` backend: Inductor generates the regions between autoopt's own kernels, which
it calls as opaque ops (``autoopt.backends.hybrid``)."""

from __future__ import annotations

import copy
import gc
import importlib
import weakref

import pytest
import torch
from torch import nn

import autoopt
from autoopt.backends import hybrid
from autoopt.errors import ConfigError

from .checks import assert_same_function
from .model_zoo import llama_lm
from .test_backends import Branchy

packed_linear_module = importlib.import_module("autoopt.passes.packed_linear")

pytestmark = [pytest.mark.filterwarnings("ignore"), pytest.mark.skipif(
    "onednn" not in packed_linear_module.kernels(torch.device("cpu")),
    reason="needs oneDNN's packed linear in this build")]

# The linears onto oneDNN without measuring, so that the graph has autoopt kernels to keep.
ONEDNN = {"packed_linear": {"measure": False, "kernel": "onednn"}}


class Block(nn.Module):
    """A pre-norm MLP block: the norm, GELU and residual add are what Inductor fuses."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def test_inductor_runs_the_regions_between_autoopts_kernels() -> None:
    model, x = Block().eval(), torch.randn(2, 8, 32)
    fast = autoopt.optimize(model, (x,), backend="hybrid", pass_options=ONEDNN)
    (spec,) = fast.specializations
    assert spec.backend == "hybrid"
    (choice,) = fast.report.backends
    assert choice.chosen == "hybrid"
    assert choice.regions == "autoopt's kernels: onednn_linear ×2; 3 region(s) generated " \
                             "by Inductor"  # the norm; GELU; the residual add
    assert "backend hybrid for the whole graph (autoopt's kernels" in str(fast.report)
    # The graph kept is the one whose kernels run (with the packed weights), not the
    # portable one the other backends are lowered from.
    assert len(hybrid.opaque_nodes(spec.graph)) == 2
    assert_same_function(model, fast, (x,), {})
    with torch.no_grad():  # every call after the first, and other values
        for _ in range(3):
            y = torch.randn(2, 8, 32)
            torch.testing.assert_close(fast(y), model(y), rtol=1e-5, atol=1e-5)


def test_where_hybrid_does_not_apply_it_is_skipped_or_forcing_it_raises() -> None:
    model, x = Block().eval(), torch.randn(2, 8, 32)
    plain = autoopt.optimize(model, (x,), backends=("aten", "hybrid"),
                             disable=("packed_linear",))
    assert "no autoopt kernel" in plain.report.backends[0].skipped["hybrid"]
    with pytest.raises(ConfigError, match="no autoopt kernel"):
        autoopt.optimize(model, (x,), backend="hybrid", disable=("packed_linear",))
    training = autoopt.optimize(Block().train(), (x.requires_grad_(),),
                                backends=("aten", "hybrid"), training=True)
    loss = training(x).square().mean()
    loss.backward()
    assert "inference only" in training.report.backends[0].skipped["hybrid"]


def test_weights_written_after_lowering_are_used() -> None:
    model, x = Block().eval(), torch.randn(2, 8, 32)
    fast = autoopt.optimize(model, (x,), backend="hybrid", pass_options=ONEDNN)
    with torch.no_grad():
        fast(x)
        fast.module.up.weight.mul_(-2.0)  # the packed copy is stale now
        fast.module.norm.bias.add_(0.5)  # a weight the generated code reads as it is
        torch.testing.assert_close(fast(x), copy.deepcopy(fast.module)(x), rtol=1e-5,
                                   atol=1e-5)


def test_a_dropped_module_releases_its_kernels_and_generated_code() -> None:
    from torch._inductor.codecache import PyCodeCache

    model, x = Block().eval(), torch.randn(2, 8, 32)
    gc.collect()
    code = {id(m) for m in PyCodeCache.modules}
    with torch.no_grad():
        fast = autoopt.optimize(model, (x,), backend="hybrid", pass_options=ONEDNN)
        fast(x)
    ours = {id(m) for m in PyCodeCache.modules} - code
    assert ours
    kernels = [weakref.ref(n.target) for n in hybrid.opaque_nodes(fast.specializations[0].graph)]
    assert len(kernels) == 2
    alive = weakref.ref(fast)
    del fast
    gc.collect()
    assert alive() is None
    assert all(k() is None for k in kernels)  # the packed weights with them
    assert not ours & {id(m) for m in PyCodeCache.modules}


def test_decoding_writes_the_cache_in_place_through_the_generated_code() -> None:
    """The decode step writes the static KV cache (graph inputs) in place; Inductor
    functionalizes the writes and must copy them back, or the next step reads stale keys."""
    model = llama_lm()
    ids = torch.randint(1, 128, (1, 6))
    fast = autoopt.optimize(model, (ids,), backends=("hybrid", "aten"), pass_options=ONEDNN)
    got = fast.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(got, model.generate(ids, max_new_tokens=8, do_sample=False))
    (choice,) = fast._generator.reports[0].backends  # the decode step's (the first captured)
    # Built and verified against eager (measured, or chosen), whichever was faster here.
    assert "hybrid" not in choice.skipped, choice.skipped
    assert choice.chosen == "hybrid" or "hybrid" in choice.seconds


def test_int8_kernels_with_packed_params_objects_are_kept_opaque() -> None:
    """int8 linears read a packed-params object (no tensor: fake tensors cannot meet it), so
    their result on fake tensors comes from the graph's record."""
    model = llama_lm()
    ids = torch.randint(1, 128, (1, 6))
    fast = autoopt.optimize(model, (ids,), backends=("hybrid", "aten"), precision="int8",
                            pass_options={"precision": {"force": True}})  # small: slower
    got = fast.generate(ids, max_new_tokens=4, do_sample=False)
    assert got.shape == (1, 10)
    (choice,) = fast._generator.reports[0].backends
    assert "hybrid" not in choice.skipped, choice.skipped
    assert choice.chosen == "hybrid" or "hybrid" in choice.seconds
    if choice.chosen == "hybrid":
        assert "quantized.linear_dynamic ×" in choice.regions


def test_dynamo_subgraphs_say_why_not_hybrid() -> None:
    model, x = Branchy().eval(), torch.randn(4, 16)
    fast = autoopt.optimize(model, (x,), backends=("aten", "hybrid"), pass_options=ONEDNN)
    assert fast.report.capture_method == "dynamo"
    assert all(c.chosen == "aten" and "weights are inputs" in c.skipped["hybrid"]
               for c in fast.report.backends)


class WritesItsInputs(nn.Module):
    """A step that writes a cache at a position and advances the position, as a decode step
    does: each run reads what the run before wrote."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, cache: torch.Tensor, position: torch.Tensor,
                ) -> torch.Tensor:
        cache.index_copy_(0, position, self.proj(x))
        position.add_(1)
        return torch.nn.functional.layer_norm(cache.sum(0), (8,))


def test_candidates_that_write_their_inputs_are_timed_from_the_same_start() -> None:
    """Timing ran each candidate a dozen times on one copy of the inputs, so the position
    advanced past the cache's end and the measurement raised (a decode graph's prompt step:
    'index 256 is out of bounds'); each run now starts from the same inputs."""
    model = WritesItsInputs().eval()
    args = (torch.randn(1, 8), torch.zeros(6, 8), torch.tensor([2]))
    mine = copy.deepcopy(args)
    fast = autoopt.optimize(model, args, backends=("aten", "hybrid"), pass_options=ONEDNN)
    (choice,) = fast.report.backends
    assert set(choice.seconds) == {"aten", "hybrid"}, choice.skipped
    for a, b in zip(args, mine, strict=True):  # optimize left the caller's inputs as they were
        assert torch.equal(a, b)
    expected = copy.deepcopy(args)
    with torch.no_grad():
        torch.testing.assert_close(fast(*args), model(*expected))
    for a, b in zip(args, expected, strict=True):
        torch.testing.assert_close(a, b)


def test_calls_from_threads_compute_each_callers_result() -> None:
    """The generated code and the kernels' handle table are shared by every thread."""
    import threading

    model = Block().eval()
    fast = autoopt.optimize(model, (torch.randn(2, 8, 32),), backend="hybrid",
                            pass_options=ONEDNN)
    inputs = [torch.randn(2, 8, 32) for _ in range(4)]
    results: dict[int, torch.Tensor] = {}

    def call(i: int) -> None:
        with torch.no_grad():
            for _ in range(20):
                results[i] = fast(inputs[i])

    threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with torch.no_grad():
        for i, x in enumerate(inputs):
            torch.testing.assert_close(results[i], model(x), rtol=1e-5, atol=1e-5)


class ResidualCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.conv = nn.Conv2d(16, 16, 3, padding=1)
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.stem(x)
        y = torch.relu(self.conv(y) + y)
        return self.head(torch.nn.functional.hardswish(y).mean((2, 3)))


def test_convolutions_answering_in_channels_last_keep_their_layout() -> None:
    """oneDNN's convolutions return channels-last tensors where the graph recorded
    contiguous ones; the generated code asserted the recorded layout and failed."""
    model, x = ResidualCNN().eval(), torch.randn(2, 3, 16, 16)
    fast = autoopt.optimize(model, (x,), backend="hybrid", pass_options={
        "onednn_conv": {"measure": False}, **ONEDNN})
    (choice,) = fast.report.backends
    assert choice.chosen == "hybrid" and "onednn_conv2d ×2" in choice.regions, choice
    assert_same_function(model, fast, (x,), {})


@torch.no_grad()
def test_inputs_laid_out_unlike_the_example_run_the_aten_graph() -> None:
    """The static graph's generated code asserts each input's strides, which the call's
    signature does not name: a channels-last image, a transposed, sliced or expanded input of
    the example's shape raised Inductor's "expected size 3==3, stride 1==256"."""
    model, x = ResidualCNN().eval(), torch.randn(2, 3, 16, 16)
    fast = autoopt.optimize(model, (x,), backend="hybrid", pass_options={
        "onednn_conv": {"measure": False}, **ONEDNN})
    for other in (torch.randn(2, 3, 16, 16).to(memory_format=torch.channels_last),
                  torch.randn(2, 3, 16, 16).transpose(2, 3),
                  torch.randn(4, 3, 16, 16)[::2],
                  torch.randn(1, 3, 16, 16).expand(2, 3, 16, 16)):
        torch.testing.assert_close(fast(other), model(other), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(fast(x), model(x), rtol=1e-4, atol=1e-5)
    assert len(fast.specializations) == 1 and fast.specializations[0].backend == "hybrid"


def test_convolutions_in_a_graph_with_symbolic_sizes_keep_their_layout() -> None:
    """With ``dynamic=True`` the op's shape function ran the convolution on fake tensors,
    which answer contiguous; the generated code asserted that against oneDNN's channels-last
    result, and hybrid was never built for such a graph."""
    model, x = ResidualCNN().eval(), torch.randn(2, 3, 16, 16)
    fast = autoopt.optimize(model, (x,), backend="hybrid", dynamic=True, pass_options={
        "onednn_conv": {"measure": False}, **ONEDNN})
    (choice,) = fast.report.backends
    assert choice.chosen == "hybrid" and "onednn_conv2d ×2" in choice.regions, choice
    for shape in ((3, 3, 16, 16), (5, 3, 16, 16)):
        y = torch.randn(shape)
        with torch.no_grad():
            torch.testing.assert_close(fast(y), model(y))
    assert len(fast.report.captures) == 1  # one graph served every size


def test_lowering_a_graph_that_writes_statistics_writes_them_once() -> None:
    """A train-mode call (under inference_mode: no gradients) captures a graph that updates
    BatchNorm's statistics. The lowering's own run of the graph (to see the kernels'
    layouts) wrote them too, so the module's statistics moved twice for one call."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).eval()
    x = torch.randn(2, 3, 6, 6)
    fast = autoopt.optimize(model, (x,), backends=("hybrid", "aten"),
                            pass_options={"onednn_conv": {"measure": False}})
    reference = copy.deepcopy(model)
    for caller, m in ((fast, fast.module), (reference, reference)):
        m.train()
        with torch.inference_mode():
            caller(x + 1)
        m.eval()
    train_graph = fast.report.captures[-1].backends[0]
    assert "hybrid" not in train_graph.skipped, train_graph.skipped
    for name, value in reference[1].named_buffers():
        torch.testing.assert_close(fast.module[1].get_buffer(name), value)
    with torch.no_grad():
        torch.testing.assert_close(fast(x), reference(x))


def test_a_new_shape_and_a_saved_module_run_hybrid_again() -> None:
    import pickle

    model, x = Block().eval(), torch.randn(2, 8, 32)
    fast = autoopt.optimize(model, (x,), backend="hybrid", pass_options=ONEDNN)
    with torch.no_grad():
        y = torch.randn(3, 5, 32)  # another signature: captured and lowered on its own
        torch.testing.assert_close(fast(y), model(y), rtol=1e-5, atol=1e-5)
        assert [s.backend for s in fast.specializations] == ["hybrid", "hybrid"]
        loaded = pickle.loads(pickle.dumps(fast))  # generated code is this process's
        assert loaded.specializations == ()
        torch.testing.assert_close(loaded(x), model(x), rtol=1e-5, atol=1e-5)
        assert loaded.specializations[0].backend == "hybrid"
