"""Pipeline stages and runtimes (autoopt/pipelining.py, autoopt/distributed.py): composed
stages equal eager, training gives eager's gradients, torch.distributed runs the same cut."""

from __future__ import annotations

import copy
import subprocess
import sys
from collections.abc import Callable
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
from autoopt.capture.graph import export_graph
from autoopt.cli import main
from autoopt.cost_model import CostModel
from autoopt.errors import ConfigError, InputError
from autoopt.parallel.microbatches import split_microbatches
from autoopt.parallel.partition import DeviceSpec, partition
from autoopt.parallel.pipeline import Pipeline, pipeline_from_graph
from autoopt.parallel.planning import device_specs
from autoopt.parallel.schedules import gpipe_order, one_f_one_b_order
from autoopt.parallel.stages import emit_stages

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
    held: set[str] = set()
    for stage in stages:
        named = dict(stage.named_parameters())
        assert set(named) <= set(original)  # names traceable to the model
        assert all(named[n] is original[n] for n in named)
        held |= set(named)
    # Every weight in some stage; where the cuts fall (a stage of pooling and concatenations
    # alone, say) follows the cost model's figures on this machine.
    assert held == set(dict(model.named_parameters()))
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


def test_a_pipeline_optimized_for_inference_refuses_gradients() -> None:
    """An eval-mode model pipelined without training=True: its stages fold the BatchNorm and
    run oneDNN convolutions with no backward. A backward through it reached the last linear
    alone, and ``train_step`` trained that, silently; now its outputs carry no gradient, an
    input that asks for one and ``train_step`` are a ConfigError, and the outputs are eager's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4)).eval()
    x = torch.randn(4, 3, 8, 8)
    pipe = autoopt.optimize(model, (x,), devices=["cpu", "cpu"], microbatches=2)
    y = pipe(x)
    assert not y.requires_grad
    with torch.no_grad():
        torch.testing.assert_close(y, model(x), rtol=1e-4, atol=1e-5)
    with pytest.raises(autoopt.ConfigError, match="optimized for inference.*training=True"):
        pipe(x.clone().requires_grad_())
    with pytest.raises(autoopt.ConfigError, match="optimized for inference"):
        pipe.train_step((x,), torch.zeros(4, 4), nn.functional.mse_loss)
    trainable = autoopt.optimize(model, (x,), devices=["cpu", "cpu"], microbatches=2,
                                 training=True)
    assert trainable(x).requires_grad


def test_a_pipeline_stands_for_the_models_mode_and_refuses_another() -> None:
    """An eval model's pipeline said ``training`` True (nn.Module's default), and switching
    its mode changed nothing: the stages' graphs bake the mode they were captured in, so a
    training pipeline put in eval kept dropout and batch statistics, silently."""
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.5),
                          nn.Linear(16, 4))
    x = torch.randn(4, 8)
    for training in (False, True):
        pipe = autoopt.optimize(model.train(training), (x,), devices=["cpu", "cpu"],
                                microbatches=1, training=training)
        assert pipe.training is training
        was = pipe.training
        pipe.train(not training)
        mode = "train" if training else "eval"
        refused = rf"captured in {mode} mode.*\.train\({training}\)"
        with pytest.raises(autoopt.ConfigError, match=refused):
            pipe(x)
        pipe.train(was)
        pipe(x)


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
    from autoopt.parallel.distributed import _contiguous_boundaries

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
    from autoopt.parallel.distributed import _contiguous_boundaries

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


class TiedLM(nn.Module):
    """An embedding and the LM head that share its weight, at the two ends of the graph: any
    cut puts them in different stages."""

    def __init__(self, vocab: int = 16, dim: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.body = nn.Sequential(nn.Linear(dim, dim), nn.Tanh(), nn.Linear(dim, dim), nn.Tanh(),
                                  nn.Linear(dim, dim))
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(ids)))


def _lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


@pytest.mark.parametrize("devices", [
    ["cpu", "cpu:0"],  # a device other than the weights' own: the stage is placed (copied)
    pytest.param(["cpu", "cuda:0"], marks=pytest.mark.gpu),
])
def test_a_tied_weight_on_stages_placed_on_different_devices_stays_one_weight(
        devices: list[str]) -> None:
    """Placing the LM head's stage copied its weights, so the embedding and the head trained
    apart; the head's stage now reads the embedding stage's weight, and the gradients of both
    uses reach it."""
    torch.manual_seed(0)
    model = TiedLM()
    reference = copy.deepcopy(model)
    ids, labels = torch.randint(0, 16, (4, 5)), torch.randint(0, 16, (4, 5))
    gm = export_graph(model, (ids[:2],), {})
    plan = partition(gm, CostModel("cpu").predict(gm), [DeviceSpec(d) for d in devices])
    pipe = pipeline_from_graph(gm, plan, microbatches=2)
    assert len(list(pipe.parameters())) == len(list(reference.parameters()))
    _lm_loss(pipe(ids).cpu(), labels).backward()
    _lm_loss(reference(ids), labels).backward()
    expected = dict(reference.named_parameters(remove_duplicate=False))
    for name, param in pipe.named_stage_parameters():
        torch.testing.assert_close(param.grad.cpu(), expected[name].grad, rtol=1e-4, atol=1e-6)
    assert gm.get_parameter("head.weight") is model.embed.weight  # the caller's graph as it was


def _distributed_worker() -> int:
    """Run by ``torchrun`` (see ``distributed_checks``); prints one ``rank R: <check> ok`` or
    ``FAIL`` line per check."""
    import torch.distributed as dist

    from autoopt.parallel.distributed import distributed_pipeline

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    failures = 0

    def report(check: str, problem: str | None) -> None:
        nonlocal failures
        failures += problem is not None
        # One write per line: the ranks share the pipe, and print writes the newline apart.
        outcome = "ok" if problem is None else f"FAIL: {problem}"
        sys.stdout.write(f"rank {rank}: {check} {outcome}\n")
        sys.stdout.flush()

    # Tied weights: 3 SGD steps of the pipeline against the unsplit model.
    torch.manual_seed(0)
    model = TiedLM()
    reference = copy.deepcopy(model)
    ids, labels = torch.randint(0, 16, (6, 5)), torch.randint(0, 16, (6, 5))
    pipe = distributed_pipeline(model, (ids,), microbatches=3, training=True, schedule="1f1b",
                                loss_fn=_lm_loss)
    optimizer = torch.optim.SGD(pipe.module.parameters(), lr=0.5)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    expected = dict(reference.named_parameters(remove_duplicate=False))
    problem = None
    for step in range(3):
        optimizer.zero_grad()
        pipe.step(ids, target=labels if pipe.is_last else None)  # the target: last rank only
        reference_optimizer.zero_grad()
        _lm_loss(reference(ids), labels).backward()
        if step == 0:
            for name, param in pipe.module.named_parameters():
                error = (param.grad - expected[name].grad).abs().max().item()
                if error > 1e-5:
                    problem = problem or f"step 0: gradient of {name} off by {error:.3g}"
        optimizer.step()
        reference_optimizer.step()
    for name, param in pipe.module.named_parameters():
        error = (param.detach() - expected[name].detach()).abs().max().item()
        if error > 1e-5:
            problem = problem or f"after 3 steps: {name} off by {error:.3g}"
    tied = [(t.name, t.ranks) for t in pipe.tied]
    if rank in (0, 2) and tied != [("head.weight", (0, 2))]:
        problem = problem or f"tied parameters {tied}"
    report("tied weights", problem)

    # Building a pipeline (measuring, partitioning) leaves the caller's model as it was.
    torch.manual_seed(1)
    model = ConvBN().train()
    x = torch.randn(4, 3, 8, 8)
    before = snapshot(model)
    problem = None
    for training in (False, True):
        pipe = distributed_pipeline(model, (x,), training=training, loss_fn=_mse)
        for name, value in snapshot(model).items():
            if not torch.equal(value, before[name]):
                problem = problem or f"training={training}: {name} changed"
        for name, buffer in pipe.module.named_buffers():
            if not torch.equal(buffer, before[f"buffer:{name}"]):
                problem = problem or f"training={training}: the stage's {name} differs"
    report("model untouched", problem)
    dist.destroy_process_group()
    return 1 if failures else 0


def _mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


@pytest.fixture(scope="module")
def distributed_checks() -> str:
    """``_distributed_worker`` under torchrun on 3 CPU processes (gloo), once for the tests
    below: the tied weight sits on ranks 0 and 2, so its gradients are summed in a group
    that leaves rank 1 out."""
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
         __file__, "--distributed-worker"],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    return done.stdout + done.stderr


def _assert_every_rank(output: str, check: str, ranks: int = 3) -> None:
    lines = [line for line in output.splitlines() if f": {check} " in line]
    assert sorted(lines) == [f"rank {r}: {check} ok" for r in range(ranks)], \
        "\n".join(lines) or output[-3000:]


@pytest.mark.slow
def test_tied_weights_split_across_ranks_train_as_one_weight(distributed_checks: str) -> None:
    """An embedding on rank 0 and the LM head on rank 2 share one weight: after 3 SGD steps
    every rank's gradients (step 0) and parameters equal the unsplit model's."""
    _assert_every_rank(distributed_checks, "tied weights")


@pytest.mark.slow
def test_building_a_distributed_pipeline_leaves_every_ranks_model_untouched(
        distributed_checks: str) -> None:
    """Rank 0 profiles and times stages on a graph that holds the caller's BatchNorm: its
    statistics and the stage built from it stay as they were, on every rank."""
    _assert_every_rank(distributed_checks, "model untouched")


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


@pytest.mark.parametrize("training", [False, True])
def test_building_a_pipeline_leaves_the_model_and_its_stages_as_they_were(training: bool) -> None:
    """Profiling and timing candidate cuts run the graph many times; BatchNorm in train mode
    counts each run (the stages started at num_batches_tracked = 25 before)."""
    model = ConvBN().train()
    before = snapshot(model)
    pipe = autoopt.optimize(model, (torch.randn(4, 3, 8, 8),), devices=["cpu", "cpu"],
                            training=training)
    assert_bit_identical(model, before)
    buffers = {n: b for stage in pipe.stages for n, b in stage.named_buffers()}
    assert set(buffers) == {"bn.running_mean", "bn.running_var", "bn.num_batches_tracked"}
    for name, buffer in buffers.items():
        assert torch.equal(buffer, before[f"buffer:{name}"]), name


class _WritesItsInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.add_(1)
        return self.b(torch.relu(self.a(x)))


def test_building_a_pipeline_leaves_the_inputs_as_given() -> None:
    """A forward that writes its input: the planning runs and the check against eager ran it
    on the caller's tensor (the pipeline saw x + 1 where eager had seen x, and the check
    failed blaming BatchNorm), and left it changed."""
    model, x = _WritesItsInput().eval(), torch.zeros(4, 4)
    pipe = autoopt.optimize(model, (x,), devices=["cpu", "cpu"], microbatches=2)
    assert torch.equal(x, torch.zeros(4, 4))
    with torch.no_grad():
        expected = model(x.clone())
        torch.testing.assert_close(pipe(x), expected)
    assert torch.equal(x, torch.ones(4, 4))  # the call itself writes it, as eager does


class _Reduced(nn.Module):
    def __init__(self, reduce: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.reduce = reduce

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.linear(x)
        return {"hidden": h, "pooled": self.reduce(h)}


@pytest.mark.parametrize(("reduce", "message"), [
    (lambda h: h.mean(0), r"Output \['pooled'\] has shape \(4,\), which does not start with "
                          r"the microbatch's batch size \(2\).*would give shape \(8,\) instead "
                          r"of \(4,\)"),
    (lambda h: h.sum(), r"Output \['pooled'\] has shape \(\).*would give the first "
                        r"microbatch's value"),
])
def test_outputs_reduced_over_the_batch_are_refused_at_build_time(
        reduce: Callable[[torch.Tensor], torch.Tensor], message: str) -> None:
    """Merging microbatches concatenates each output along dim 0: a batch mean came out twice
    as long, a 0-dim output as the first microbatch's value."""
    model = _Reduced(reduce).eval()
    with pytest.raises(ConfigError, match=message + ".*or use microbatches=1"):
        autoopt.optimize(model, (torch.randn(4, 4),), devices=["cpu", "cpu"], microbatches=2,
                         verify=False)
    pipe = autoopt.optimize(model, (torch.randn(4, 4),), devices=["cpu", "cpu"], verify=False)
    x = torch.randn(4, 4)
    with torch.no_grad():  # one microbatch: nothing to merge, the output is the model's
        torch.testing.assert_close(pipe(x)["pooled"], model(x)["pooled"])


def test_a_model_without_compute_is_told_so() -> None:
    with pytest.raises(ConfigError, match="the graph has no compute nodes .* nothing to cut "
                                          "into 2 stages; run the model as it is"):
        autoopt.optimize(nn.Identity(), (torch.randn(2, 4),), devices=["cpu", "cpu"])


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
    from autoopt.parallel.distributed import distributed_pipeline

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


if __name__ == "__main__" and "--distributed-worker" in sys.argv:
    sys.exit(_distributed_worker())
