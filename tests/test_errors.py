"""Bad input gets a clear error naming what is wrong and what to do."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import autoopt
from autoopt import ConfigError, DeviceError, InputError, ModelError
from autoopt.errors import ArgumentError


def linear() -> nn.Module:
    return nn.Linear(4, 2)


def test_not_a_module() -> None:
    with pytest.raises(ModelError, match="expects a torch.nn.Module; got function"):
        autoopt.optimize(lambda v: v, (torch.randn(2),))


def test_torchscript_module() -> None:
    with pytest.raises(ModelError, match="TorchScript"):
        autoopt.optimize(torch.jit.script(linear()), (torch.randn(3, 4),))


def test_meta_parameters() -> None:
    with torch.device("meta"):
        model = linear()
    with pytest.raises(ModelError, match="meta device.*load or initialise the weights"):
        autoopt.optimize(model, (torch.randn(3, 4),))


def test_model_that_fails_on_the_example_inputs() -> None:
    with pytest.raises(ModelError, match="raised RuntimeError when run eagerly on the example"):
        autoopt.optimize(linear(), (torch.randn(3, 5),))


@torch.no_grad()
def test_a_later_call_the_model_rejects_raises_eager_s_own_error() -> None:
    """A later call with inputs the model rejects (a wrong width, another dtype) raised a
    ``ModelError`` (a ``TypeError``) about "the example inputs"; eager raises a
    ``RuntimeError``, which code around the model catches. The module raises eager's."""
    model = linear()
    fast = autoopt.optimize(model, (torch.randn(3, 4),), backends=("aten",))
    for bad in (torch.randn(3, 5), torch.randn(3, 4, dtype=torch.float64)):
        with pytest.raises(RuntimeError) as eager:
            model(bad)
        with pytest.raises(RuntimeError) as optimized:
            fast(bad)
        assert type(optimized.value) is type(eager.value)
        assert str(optimized.value) == str(eager.value)
    torch.testing.assert_close(fast(torch.ones(3, 4)), model(torch.ones(3, 4)))


def test_example_inputs_as_a_list_or_dict() -> None:
    with pytest.raises(InputError, match=r"tuple of positional arguments.*got list.*your_list"):
        autoopt.optimize(linear(), [torch.randn(3, 4)])
    with pytest.raises(InputError, match="example_kwargs"):
        autoopt.optimize(linear(), {"input": torch.randn(3, 4)})
    with pytest.raises(InputError, match="example_kwargs must be a dict"):
        autoopt.optimize(linear(), (torch.randn(3, 4),), [1])


def test_dtype_mismatch_between_model_and_inputs() -> None:
    with pytest.raises(InputError, match=r"args\[0\] is torch.float16 but the model's "
                                         r"parameters are torch.float32"):
        autoopt.optimize(linear(), (torch.randn(3, 4, dtype=torch.float16),))


def test_missing_gpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU; the error is for machines without one")
    with pytest.raises(DeviceError, match="no CUDA GPU is available.*device='cpu'"):
        autoopt.optimize(linear(), (torch.randn(3, 4),), device="cuda")
    with pytest.raises(DeviceError, match="not a device name"):
        autoopt.optimize(linear(), (torch.randn(3, 4),), device="tpu-ish")


def test_unknown_options_and_bad_values() -> None:
    x = (torch.randn(3, 4),)
    with pytest.raises(ConfigError, match=r"unknown option\(s\) \['verfy'\]; valid options"):
        autoopt.optimize(linear(), x, verfy=False)
    with pytest.raises(ConfigError, match="unknown pass name.*known passes are"):
        autoopt.optimize(linear(), x, disable=["fuse_everything"])
    with pytest.raises(ConfigError, match="capture must be"):
        autoopt.optimize(linear(), x, capture=["magic"])
    with pytest.raises(ConfigError, match="pass_options maps a name to a dict of options"):
        autoopt.optimize(linear(), x, pass_options={"precision": "force"})
    # None for a collection option is none, as leaving it out is (it raised TypeError).
    fast = autoopt.optimize(linear(), x, pass_options=None, backend_options=None, disable=None)
    assert fast.config.pass_options == {} and fast.config.disable == ()
    with pytest.raises(ConfigError, match="random_inputs must be an integer >= 0"):
        autoopt.optimize(linear(), x, random_inputs=-1)
    with pytest.raises(ConfigError, match="max_specializations must be an integer >= 1"):
        autoopt.optimize(linear(), x, config={"max_specializations": 0})
    with pytest.raises(ConfigError, match="config must be an OptimizeConfig or a dict"):
        autoopt.optimize(linear(), x, config=3)


def test_uncopyable_model() -> None:
    class HoldsGenerator(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lines = (i for i in range(3))

        def forward(self, v: torch.Tensor) -> torch.Tensor:
            return v

    with pytest.raises(ModelError, match="deep-copyable"):
        autoopt.optimize(HoldsGenerator(), (torch.randn(2),))


def test_nan_inputs_warn_that_verification_cannot_judge() -> None:
    with pytest.warns(UserWarning, match="NaN or Inf"):
        autoopt.optimize(linear(), (torch.tensor([[float("nan"), 0.0, 1.0, 2.0]]),))


def test_errors_leave_the_model_untouched() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).train()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ModelError):
        autoopt.optimize(model, (torch.randn(3, 5),))
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_all_errors_share_a_base_class() -> None:
    for error in (ConfigError, DeviceError, InputError, ModelError, autoopt.ModelSpecError,
                  ArgumentError):
        assert issubclass(error, autoopt.AutoOptError)
    # A call whose arguments do not bind is a TypeError, as Python's own, and bad input.
    assert issubclass(ArgumentError, TypeError) and issubclass(ArgumentError, InputError)


def test_onnx_runtime_not_installed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import onnxruntime now fails
    path = tmp_path / "m.onnx"
    path.write_bytes(b"")
    with pytest.raises(autoopt.DependencyError, match=r"onnxruntime.*pip install onnxruntime"):
        autoopt.onnx_session(path)
    with pytest.raises(autoopt.DependencyError, match="ONNX export"):
        autoopt.export_onnx(nn.Linear(2, 2), (torch.randn(1, 2),), tmp_path / "x.onnx")
    assert not (tmp_path / "x.onnx").exists()


def test_build_refuses_the_features_layered_on_the_core() -> None:
    from autoopt.module.build import build

    with pytest.raises(ConfigError, match="pass devices= or report= to autoopt.optimize"):
        build(linear(), torch.randn(2, 4), report="r.html")
