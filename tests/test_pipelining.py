"""Pipeline stages and runtimes (autoopt/pipelining.py, autoopt/distributed.py): composed
stages equal eager, training gives eager's gradients, torch.distributed runs the same cut."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torchvision
import transformers
from checks import assert_bit_identical, snapshot
from model_zoo import bert
from test_partition import Inception
from torch import nn
from torch.utils import _pytree as pytree

import autoopt
from autoopt.capture import export_graph
from autoopt.cli import main
from autoopt.cost_model import CostModel
from autoopt.errors import ConfigError, InputError
from autoopt.passes.partition import DeviceSpec, partition
from autoopt.pipelining import (
    Pipeline,
    device_specs,
    emit_stages,
    gpipe_order,
    one_f_one_b_order,
    pipeline_from_graph,
    split_microbatches,
)

ROOT = Path(__file__).resolve().parent.parent


def gpt2() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    config = transformers.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=2,
                                     n_positions=64, use_cache=False, bos_token_id=0,
                                     eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0)
    return transformers.GPT2Model(config).eval(), (torch.randint(0, 128, (4, 16)),), {}


MODELS = {
    "resnet50": lambda: (torchvision.models.resnet50(num_classes=10).eval(),
                         (torch.randn(2, 3, 32, 32),), {}),
    "inception": lambda: (Inception().eval(), (torch.randn(2, 3, 16, 16),), {}),
    "bert": bert,
    "gpt2": gpt2,
}


def microbatch(args: tuple[Any, ...], kwargs: dict[str, Any], n: int) -> tuple[Any, Any]:
    """The first of n microbatches of (args, kwargs): the shapes a pipeline is captured at."""
    return pytree.tree_map_only(torch.Tensor, lambda t: t[: t.shape[0] // n], (args, kwargs))


@pytest.mark.parametrize("name", MODELS)
def test_stages_composed_equal_eager(name: str) -> None:
    model, args, kwargs = MODELS[name]()
    with torch.no_grad():
        gm = export_graph(model, args, kwargs)
        plan = partition(gm, CostModel("cpu").predict(gm), [DeviceSpec()] * 4)
        stages = emit_stages(gm, plan)
        values = pytree.tree_leaves((args, kwargs))
        for stage in stages:
            values = list(stage(*values))
        expected = pytree.tree_leaves(model(*args, **kwargs))
    assert len(stages) == 4
    original = dict(model.named_parameters()) | dict(model.named_buffers())
    for stage in stages:
        named = dict(stage.named_parameters())
        assert named and set(named) <= set(original)  # names traceable to the model
        assert all(named[n] is original[n] for n in named)
    assert len(values) == len(expected)
    for actual, wanted in zip(values, expected, strict=True):
        torch.testing.assert_close(actual, wanted)


def test_optimize_with_devices_returns_a_verified_pipeline() -> None:
    model, args, kwargs = bert()
    before = snapshot(model)
    pipe = autoopt.optimize(model, args, kwargs, devices=["cpu", "cpu"], microbatches=2)
    assert isinstance(pipe, Pipeline) and len(pipe.stages) == 2
    assert pipe.report.captures and pipe.plan is not None
    fresh = torch.randint(0, 128, args[0].shape)
    with torch.no_grad():
        expected = model(fresh, attention_mask=kwargs["attention_mask"])
        actual = pipe(fresh, attention_mask=kwargs["attention_mask"])
    torch.testing.assert_close(actual.last_hidden_state, expected.last_hidden_state)
    torch.testing.assert_close(actual.pooler_output, expected.pooler_output)
    assert_bit_identical(model, before)


def test_backward_through_the_pipeline_gives_eager_gradients() -> None:
    model, args, kwargs = gpt2()
    model.train()
    reference = copy.deepcopy(model)
    micro_args, micro_kwargs = microbatch(args, kwargs, 2)
    gm = export_graph(model, micro_args, micro_kwargs)
    plan = partition(gm, CostModel("cpu").predict(gm), [DeviceSpec()] * 3)
    pipe = pipeline_from_graph(gm, plan, microbatches=2)
    pipe(*args, **kwargs).last_hidden_state.pow(2).mean().backward()
    reference(*args, **kwargs).last_hidden_state.pow(2).mean().backward()
    expected = dict(reference.named_parameters())
    grads = dict(pipe.named_stage_parameters())
    assert len(grads) == len(expected)
    for name, param in grads.items():
        torch.testing.assert_close(param.grad, expected[name].grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_train_step_gives_eager_gradients(schedule: str) -> None:
    model, args, _ = gpt2()
    model.train()
    target = torch.randn(4, 16, 32)
    pipe = autoopt.optimize(model, args, devices=["cpu"] * 3, microbatches=4, training=True)

    def loss_fn(output: Any, labels: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(output.last_hidden_state, labels)

    loss = pipe.train_step(args, target, loss_fn, schedule=schedule)
    reference = copy.deepcopy(model)
    expected_loss = loss_fn(reference(*args), target)
    expected_loss.backward()
    torch.testing.assert_close(loss, expected_loss.detach(), rtol=1e-5, atol=1e-6)
    expected = dict(reference.named_parameters())
    for name, param in pipe.named_stage_parameters():
        torch.testing.assert_close(param.grad, expected[name].grad, rtol=1e-4, atol=1e-6)
    assert all(p.grad is None for p in model.parameters())  # the user's model is untouched


def test_schedules_respect_dependencies_and_bound_activations() -> None:
    stages, microbatches = 4, 6
    for order in (gpipe_order(stages, microbatches), one_f_one_b_order(stages, microbatches)):
        assert sorted(order) == sorted({(k, s, m) for k in "FB" for s in range(stages)
                                        for m in range(microbatches)})
        done = set()
        for kind, s, m in order:
            if kind == "F":
                assert s == 0 or ("F", s - 1, m) in done
            else:
                assert ("F", s, m) in done and (s == stages - 1 or ("B", s + 1, m) in done)
            done.add((kind, s, m))
    # 1F1B keeps at most stages - s microbatches alive on stage s; GPipe keeps all of them.
    alive = [0] * stages
    for kind, s, _ in one_f_one_b_order(stages, microbatches):
        alive[s] += 1 if kind == "F" else -1
        assert alive[s] <= stages - s


# --- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("options", "message"), [
    ({"devices": ["cpu"], "microbatches": 0}, "microbatches must be an integer >= 1; got 0"),
    ({"devices": []}, "devices is empty; list one device per pipeline stage"),
    ({"devices": ["cpu", "meta"]}, "'meta' is a meta device; pipelines run on 'cpu'"),
    ({"devices": ["gpu:7"]}, "'gpu:7' is not a device name"),
])
def test_bad_pipeline_options_are_config_errors(options: dict[str, Any], message: str) -> None:
    model, args, kwargs = MODELS["inception"]()
    with pytest.raises(ConfigError, match=message):
        autoopt.optimize(model, args, kwargs, **options)


def test_more_devices_than_nodes_is_a_config_error() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU()).eval()
    with pytest.raises(ConfigError, match="cannot cut a graph of 2 compute nodes into 3 stages"):
        autoopt.optimize(model, (torch.randn(2, 4),), devices=["cpu"] * 3)


def test_calls_that_do_not_split_into_the_built_microbatches_are_input_errors() -> None:
    model, args, kwargs = MODELS["inception"]()
    pipe = autoopt.optimize(model, args, kwargs, devices=["cpu", "cpu"], microbatches=2)
    with pytest.raises(InputError, match=r"batch \(3\) does not split into 2 equal"):
        pipe(torch.randn(3, 3, 16, 16))
    with pytest.raises(InputError, match=r"microbatches of shape \(2, 3, 16, 16\), but the "
                                         r"pipeline was built for \(1, 3, 16, 16\)"):
        pipe(torch.randn(4, 3, 16, 16))


# --- the command line ----------------------------------------------------------------------------


def test_cli_prints_the_stage_table_and_plots(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    plot = tmp_path / "stages.png"
    code = main(["partition", f"{ROOT / 'tests' / 'test_partition.py'}:Inception", "--input",
                 "1x3x8x8", "--stages", "3", "--memory", "1GiB", "--plot", str(plot)])
    out = capsys.readouterr().out
    assert code == 0
    assert "balance" in out and len([line for line in out.splitlines()
                                     if line.strip().startswith(("0 ", "1 ", "2 "))]) == 3
    assert plot.stat().st_size > 0


def test_cli_rejects_an_unreadable_memory_size(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["partition", f"{ROOT / 'tests' / 'test_partition.py'}:Inception", "--input",
                 "1x3x8x8", "--stages", "2", "--memory", "lots"])
    assert code == 2
    assert "--memory 'lots' is not a size; write e.g. 16GiB" in capsys.readouterr().err


# --- torch.distributed ---------------------------------------------------------------------------


def test_stage_outputs_sent_between_processes_are_contiguous_whatever_the_metadata() -> None:
    """A cut after a transpose whose node carries no trace metadata (as a node a pass adds
    may not): the stage still sends, and sizes gradient buffers from, contiguous outputs."""
    from autoopt.distributed import _contiguous_boundaries

    class Cut(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x.transpose(0, 1) * 2, x[:1].expand(3, 4, 5)

    with torch.no_grad():
        gm = export_graph(Cut(), (torch.randn(2, 4, 5),), {})
    for node in gm.graph.nodes:
        node.meta.pop("val", None)
    stage = _contiguous_boundaries(gm)
    for device in ("cpu", "meta"):  # PipelineStage infers its buffers with a run of its own
        x = torch.randn(2, 4, 5, device=device)
        outputs = stage(x)
        assert all(out.is_contiguous() for out in outputs), [o.stride() for o in outputs]
    torch.testing.assert_close(stage(x := torch.randn(2, 4, 5)), Cut()(x))


def test_stage_input_gradients_sent_back_are_contiguous() -> None:
    """A stage that transposes its input (as attention does with the output of the stage
    before) gets a strided gradient from autograd; sent back, and used to size the previous
    stage's receive buffer, it must be contiguous (gloo refused it in CI)."""
    from autoopt.distributed import _contiguous_boundaries

    class Attends(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(6, 5))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.transpose(1, 2) @ self.w

    shape = (2, 6, 3)
    with torch.enable_grad():
        gm = export_graph(Attends(), (torch.randn(shape, requires_grad=True),), {})
    x = torch.randn(shape, requires_grad=True)
    (strided,) = torch.autograd.grad(gm(x).sum(), x)
    assert not strided.is_contiguous()  # what the stage sent before
    stage = _contiguous_boundaries(gm)
    for device in ("cpu", "meta"):
        x = torch.randn(shape, device=device, requires_grad=True)
        (grad,) = torch.autograd.grad(stage(x).sum(), x)
        assert grad.is_contiguous(), grad.stride()
    x = torch.randn(shape, requires_grad=True)
    torch.testing.assert_close(torch.autograd.grad(stage(x).sum(), x)[0], strided)


@pytest.mark.slow
def test_two_process_gloo_pipeline_matches_eager() -> None:
    """The example, run by torchrun on 2 CPU processes: inference output and every rank's
    gradients after a 1F1B training step match eager."""
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(ROOT / "examples" / "pipeline_torchrun.py"), "--check", "--microbatches", "2",
         "--layers", "2"],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    output = done.stdout + done.stderr
    # torchrun's summary names only the first rank that failed: show that rank's own lines.
    first = "\n".join(line for line in output.splitlines() if line.startswith("[rank0]"))
    assert done.returncode == 0, f"{first[-3000:]}\n...\n{output[-2000:]}"
    assert output.count("matches eager") == 2, output[-3000:]
    assert "inference output max abs error" in output


# --- CUDA ----------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("devices", [["cuda:0", "cuda:0"], ["cpu", "cuda:0"]])
def test_cuda_pipeline_with_overlapped_copies_matches_eager(devices: list[str]) -> None:
    model, args, kwargs = bert()
    pipe = autoopt.optimize(model, args, kwargs, devices=devices, microbatches=2)
    with torch.no_grad():
        expected = model(*args, **kwargs).last_hidden_state
        actual = pipe(*args, **kwargs).last_hidden_state
    torch.testing.assert_close(actual.cpu(), expected, rtol=1e-4, atol=1e-5)



class ConvBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.bn = nn.BatchNorm2d(8)
        self.head = nn.Conv2d(8, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.bn(self.conv(x))))


def test_a_model_whose_function_depends_on_the_split_is_a_model_error() -> None:
    model = ConvBN().train()  # BatchNorm normalises by the statistics of what it is given
    with pytest.raises(autoopt.ModelError, match="differs from eager .*BatchNorm batch "
                                                 "statistics.*Use microbatches=1"):
        autoopt.optimize(model, (torch.randn(4, 3, 8, 8),), devices=["cpu", "cpu"],
                         microbatches=2, training=True)


def test_bad_schedules_and_inputs_are_clear_errors() -> None:
    model, args, kwargs = MODELS["inception"]()
    pipe = autoopt.optimize(model, args, kwargs, devices=["cpu", "cpu"])
    with pytest.raises(ConfigError, match="schedule must be 'gpipe' or '1f1b'; got 'zb'"):
        pipe.train_step(args, torch.zeros(2, 10), nn.functional.mse_loss, schedule="zb")
    with pytest.raises(InputError, match="no input tensor has a batch dimension to split"):
        split_microbatches([3, torch.tensor(1.0)], 2)
    with pytest.raises(ConfigError, match="speeds has 1 entries for 2 devices"):
        device_specs(["cpu", "cpu"], speeds=[1.0])


def test_distributed_pipeline_needs_an_initialised_process_group_and_a_loss() -> None:
    from autoopt.distributed import distributed_pipeline

    model, args, _ = MODELS["inception"]()
    with pytest.raises(ConfigError, match="schedule must be one of \\['1f1b', 'gpipe'\\]"):
        distributed_pipeline(model, args, schedule="looped")
    with pytest.raises(ConfigError, match="training needs loss_fn"):
        distributed_pipeline(model, args, training=True)
    with pytest.raises(ConfigError, match="torch.distributed is not initialised; start the "
                                          "script with torchrun"):
        distributed_pipeline(model, args)


def test_cli_wants_one_device_per_stage(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["partition", f"{ROOT / 'tests' / 'test_partition.py'}:Inception", "--input",
                 "1x3x8x8", "--stages", "3", "--devices", "cpu,cpu"])
    assert code == 2
    assert "--devices lists 2 device(s) for --stages 3" in capsys.readouterr().err
