"""The cost model: device facts, estimates vs measurements, the disk cache, predictions."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from autoopt.capture.graph import export_graph
from autoopt.cost_model import CostCache, CostModel, device_info
from autoopt.cost_model.estimate import count_flops, is_view, op_family

aten = torch.ops.aten


class Block(nn.Module):
    """x ─ linear(256→256) ─ gelu ─ linear ─ + x"""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(256, 256), nn.Linear(256, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.nn.functional.gelu(self.fc1(x))) + x


def _model(tmp_path: Path) -> CostModel:
    return CostModel("cpu", cache=CostCache(tmp_path / "costs.json"))


def test_cpu_device_facts_and_measured_ceilings(tmp_path: Path) -> None:
    info = device_info("cpu", cache=CostCache(tmp_path / "c.json"))
    assert info.device == "cpu" and info.name
    assert info.memory_total > info.memory_free > 0
    assert info.threads == torch.get_num_threads()
    c = info.ceilings
    assert c is not None
    assert 1e8 < c.matmul_flops < 1e14 and 1e8 < c.memory_bandwidth < 1e13
    assert 1e-8 < c.op_overhead_s < 1e-3


def test_a_ceiling_measured_too_low_is_measured_again_and_only_goes_up(tmp_path: Path) -> None:
    from autoopt.cost_model.device import raise_ceilings
    from autoopt.cost_model.dtype_speed import matmul_flops, raise_matmul_flops

    path = tmp_path / "c.json"
    threads = torch.get_num_threads()
    measured = device_info("cpu", cache=CostCache(path)).ceilings
    assert measured is not None
    assert torch.get_num_threads() == threads  # the one-thread GEMM floor puts it back
    key = next(k for k, _ in CostCache(path).items() if k.startswith("ceilings|"))
    # A figure cached by the old measurement (median of five runs, no "method"), taken on a
    # loaded machine: 1 kFLOP/s. It is measured again, not believed.
    stale = {**CostCache(path).get(key), "matmul_flops": 1e3, "memory_bandwidth": 1e3}
    del stale["method"]
    CostCache(path).put(key, stale)
    again = device_info("cpu", cache=CostCache(path)).ceilings
    assert again is not None and again.matmul_flops > 1e8 and again.memory_bandwidth > 1e8
    # A current entry that is too low is raised by measuring again ...
    CostCache(path).put(key, {**CostCache(path).get(key), "matmul_flops": 1e3})
    assert device_info("cpu", cache=CostCache(path)).ceilings.matmul_flops == 1e3  # cached
    raised = device_info("cpu", cache=CostCache(path), remeasure=True).ceilings
    assert raised is not None and raised.matmul_flops > 1e8
    # ... and measuring again never lowers one: the cache keeps the most the device reached.
    CostCache(path).put(key, {**CostCache(path).get(key), "matmul_flops": 1e30})
    assert device_info("cpu", cache=CostCache(path), remeasure=True).ceilings.matmul_flops \
        == 1e30
    # A throughput seen elsewhere (a model step) above a ceiling raises it, on disk too.
    CostCache(path).put(key, {**CostCache(path).get(key), "matmul_flops": 1e3})
    assert raise_ceilings("cpu", CostCache(path), matmul_flops=5e9).matmul_flops == 5e9
    assert raise_ceilings("cpu", CostCache(path), matmul_flops=1e3).matmul_flops == 5e9
    assert CostCache(path).get(key)["matmul_flops"] == 5e9
    # Other dtypes (fp16 on a CPU) keep their own figure, by the same rules.
    fp16 = matmul_flops("cpu", torch.float16, CostCache(path))
    assert raise_matmul_flops("cpu", torch.float16, fp16 * 10 + 1, CostCache(path)) \
        == fp16 * 10 + 1
    assert matmul_flops("cpu", torch.float16, CostCache(path), remeasure=True) == fp16 * 10 + 1


def test_flops_and_views() -> None:
    a, b = torch.randn(64, 32), torch.randn(32, 16)
    assert count_flops(torch.mm, (a, b), {}) == 2 * 64 * 32 * 16
    assert is_view(aten.view.default) and is_view(aten.t.default)
    assert not is_view(aten.relu.default) and not is_view(aten.relu_.default)
    assert op_family("aten.convolution.default") == "conv"
    assert op_family("aten.addmm.default") == "matmul"
    assert op_family("aten.relu.default") == "other"


def test_profile_measures_every_compute_node(tmp_path: Path) -> None:
    x = torch.randn(64, 256)
    gm = export_graph(Block().eval(), (x,), {})
    cm = _model(tmp_path)
    profile = cm.profile(gm, [x])
    compute = [c for c in profile.nodes if c.op.startswith("aten.")]
    assert {c.op for c in compute} == {"aten.linear.default", "aten.gelu.default",
                                       "aten.add.Tensor"}
    assert all(c.measured and c.latency_s > 0 for c in compute)
    linear = next(c for c in compute if c.op == "aten.linear.default")
    assert linear.flops == 2 * 64 * 256 * 256
    assert linear.bytes == (64 * 256 + 256 * 256 + 256 + 64 * 256) * 4
    assert profile.parameter_bytes == (2 * 256 * 256 + 2 * 256) * 4
    assert profile.peak_activation_bytes >= 2 * 64 * 256 * 4
    assert profile.measured_fraction > 0.99


def test_estimate_reads_measurements_and_estimates_the_rest(tmp_path: Path) -> None:
    x = torch.randn(64, 256)
    gm = export_graph(Block().eval(), (x,), {})
    cm = _model(tmp_path)
    before = {n.name: cm.estimate(n, gm) for n in gm.graph.nodes}
    assert not any(c.measured for c in before.values())
    linear = next(n for n in gm.graph.nodes if n.target is aten.linear.default)
    assert before[linear.name].latency_s > 0 and before[linear.name].flops == 2 * 64 * 256 * 256
    profile = cm.profile(gm, [x])
    after = cm.estimate(linear, gm)
    assert after.measured
    assert after.latency_s == profile.by_node[linear.name].latency_s
    # A shape never measured is estimated, calibrated by what was measured.
    other = export_graph(Block().eval(), (torch.randn(8, 256),), {})
    small = next(n for n in other.graph.nodes if n.target is aten.linear.default)
    estimate = cm.estimate(small, other)
    assert not estimate.measured and estimate.latency_s > 0
    assert "matmul" in cm.calibration()


def test_roofline_estimates_track_measurements_for_large_matmuls(tmp_path: Path) -> None:
    cm = _model(tmp_path)
    x = torch.randn(512, 1024)
    model = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024)).eval()
    gm = export_graph(model, (x,), {})
    estimated = cm.predict(gm).latency_s
    measured = cm.profile(gm, [x]).latency_s
    # Uncalibrated roofline from a measured matmul ceiling: same order of magnitude.
    assert 0.25 < estimated / measured < 4


def test_cache_round_trip_and_second_profile_is_read_from_disk(tmp_path: Path) -> None:
    x = torch.randn(32, 256)
    gm = export_graph(Block().eval(), (x,), {})
    first = _model(tmp_path).profile(gm, [x])
    data = json.loads((tmp_path / "costs.json").read_text())
    assert data["format"] == 1
    keys = [k for k in data["entries"] if k.startswith("node|aten.linear.default")]
    assert keys and "float32[32,256]" in keys[0] and "threads=" in keys[0]
    assert "torch=" in keys[0]
    second = _model(tmp_path).profile(gm, [x])
    assert [c.latency_s for c in second.nodes] == [c.latency_s for c in first.nodes]


def test_corrupt_cache_is_ignored_with_a_warning_and_rebuilt(tmp_path: Path) -> None:
    path = tmp_path / "costs.json"
    path.write_text("{ this is not json")
    with pytest.warns(UserWarning, match="corrupt"):
        cache = CostCache(path)
    assert len(cache) == 0
    cache.put("k", {"latency_s": 1.0})
    assert json.loads(path.read_text())["entries"]["k"] == {"latency_s": 1.0}


def test_unwritable_cache_degrades_to_memory(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    cache = CostCache(blocker / "sub" / "costs.json")  # a folder under a file cannot exist
    with pytest.warns(UserWarning, match="not writable"):
        cache.put("k", {"latency_s": 1.0})
    assert cache.get("k") == {"latency_s": 1.0}


_WRITER = """
import sys, time
from autoopt.cost_model import CostCache
while time.time() < float(sys.argv[3]):  # start together, so the writes interleave
    time.sleep(0.001)
for i in range(200):  # a fresh cache object each time: every write must merge with the file
    CostCache(sys.argv[1]).put(f"{sys.argv[2]}{i}", {"latency_s": float(i)})
"""


def test_two_processes_writing_at_once_lose_nothing(tmp_path: Path) -> None:
    path = str(tmp_path / "costs.json")
    start = str(time.time() + 8)
    writers = [subprocess.Popen([sys.executable, "-c", _WRITER, path, prefix, start])
               for prefix in ("a", "b")]
    assert [w.wait(120) for w in writers] == [0, 0]
    entries = json.loads(Path(path).read_text())["entries"]
    assert {f"{p}{i}" for p in "ab" for i in range(200)} <= entries.keys()


def test_pynvml_missing_is_a_note_not_a_crash(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml now raises ImportError
    if not torch.cuda.is_available():
        info = device_info("cpu", measure=False)
        assert info.device == "cpu" and info.ceilings is None
        with pytest.raises(RuntimeError, match="torch.cuda.is_available"):
            device_info("cuda:0", measure=False)
        return
    info = device_info("cuda:0", measure=False)
    assert any("pynvml not installed" in n for n in info.notes)


def test_training_profile_measures_saved_activations(tmp_path: Path) -> None:
    x = torch.randn(16, 256)
    gm = export_graph(Block(), (x,), {})
    profile = _model(tmp_path).profile(gm, [x], training=True)
    gelu = next(c for c in profile.nodes if c.op == "aten.gelu.default")
    assert gelu.saved_bytes == 16 * 256 * 4  # gelu keeps its input for backward


@pytest.mark.gpu
def test_cuda_events_and_nvml_facts(tmp_path: Path) -> None:
    info = device_info("cuda:0", cache=CostCache(tmp_path / "c.json"))
    assert info.memory_total > 0 and info.threads > 0
    assert info.ceilings is not None and info.ceilings.host_link_bandwidth > 0
    x = torch.randn(256, 256, device="cuda")
    gm = export_graph(Block().cuda().eval(), (x,), {})
    cm = CostModel("cuda:0", cache=CostCache(tmp_path / "costs.json"))
    profile = cm.profile(gm, [x])
    assert all(c.measured for c in profile.nodes if c.op.startswith("aten."))
    measured = cm.measure(gm, [x])
    assert 0.2 < profile.latency_s / measured < 5


def test_out_of_memory_while_timing_a_node_warns_and_estimates(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from autoopt.cost_model import profiler as profiler_lib

    real_time = profiler_lib.NodeProfiler._time

    def oom_on_matmuls(self: object, n: torch.fx.Node, args: tuple, kwargs: dict) -> float:
        if "linear" in str(n.target):
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real_time(self, n, args, kwargs)

    monkeypatch.setattr(profiler_lib.NodeProfiler, "_time", oom_on_matmuls)
    mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    x = torch.randn(4, 8)
    with torch.no_grad():
        gm = export_graph(mlp, (x,), {})
    with pytest.warns(UserWarning, match=r"out of memory on cpu timing linear.*estimate"):
        profile = _model(tmp_path).profile(gm, [x])
    linears = [c for c in profile.by_node.values() if "linear" in c.op]
    assert len(linears) == 2 and not any(c.measured for c in linears)
    assert all(c.latency_s > 0 for c in linears)
    assert profile.by_node["relu"].measured


def test_in_model_times_each_node_inside_whole_graph_runs(tmp_path: Path) -> None:
    mlp = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8)).eval()
    x = torch.randn(16, 32)
    with torch.no_grad():
        gm = export_graph(mlp, (x,), {})
    cm = _model(tmp_path)
    plain = cm.profile(gm, [x])
    assert all(c.in_model_s is None and c.stage_s == c.latency_s for c in plain.nodes)
    timed = cm.profile(gm, [x], in_model=True)
    ops = [n.name for n in gm.graph.nodes if n.op == "call_function"]
    assert ops and all(timed.by_node[n].in_model_s > 0 for n in ops)
    assert all(timed.by_node[n].stage_s == timed.by_node[n].in_model_s for n in ops)
    # The node's own (isolated) figure is unchanged: in-model times are extra, not a
    # replacement, and never reach the cache (they hold for this graph only).
    assert [timed.by_node[n].latency_s for n in ops] == [plain.by_node[n].latency_s for n in ops]


def test_the_last_level_cache_counts_what_one_process_holds(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """sysfs gives the whole shared L3 (260 MiB in a 2-vCPU VM, where weights past 32-64 MiB
    stream from memory): a decoder's weights are measured cold past 32 MiB."""
    from autoopt.cost_model import device as device_module

    def sysfs(*caches: tuple[int, str, str]) -> None:
        root = tmp_path / str(len(list(tmp_path.iterdir())))
        for i, (level, kind, size) in enumerate(caches):
            (root / f"index{i}").mkdir(parents=True)
            for name, text in (("level", str(level)), ("type", kind), ("size", size)):
                (root / f"index{i}" / name).write_text(text + "\n")
        monkeypatch.setattr(device_module, "_SYSFS_CACHES", root)

    sysfs((1, "Data", "48K"), (1, "Instruction", "32K"), (2, "Unified", "2048K"),
          (3, "Unified", "266240K"))
    assert device_module.cpu_cache_bytes() == 2 * 2**20
    assert device_module.cpu_cache_bytes(last_level=True) == 32 * 2**20
    sysfs((2, "Unified", "1024K"), (3, "Unified", "16384K"))
    assert device_module.cpu_cache_bytes(last_level=True) == 16 * 2**20
    monkeypatch.setattr(device_module, "_SYSFS_CACHES", tmp_path / "none")
    assert device_module.cpu_cache_bytes() == 2 * 2**20
    assert device_module.cpu_cache_bytes(last_level=True) == 32 * 2**20


def test_estimating_a_graph_with_a_no_grad_region_leaves_gradients_on(tmp_path: Path) -> None:
    """A training graph holds ``wrap_with_set_grad_enabled(False, ...)`` for a ``no_grad``
    block; counting its FLOPs on meta tensors once left gradients off for the whole process."""
    from .test_tricky_models import NoGradBlock

    gm = torch.export.export(NoGradBlock(), (torch.randn(2, 4),)).module()
    cost = CostModel(cache=CostCache(tmp_path / "costs.json"))
    assert torch.is_grad_enabled()
    cost.predict(gm)
    assert torch.is_grad_enabled()
    with torch.no_grad():
        cost.predict(gm)
        assert not torch.is_grad_enabled()
