"""What a newcomer's first hour met (issue 41): work whose result goes unused, messages that
say what is wrong in the library's words rather than a dependency's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autoopt.backends import onnxruntime as ort


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


@pytest.mark.skipif(bool(ort.available()), reason=ort.available() or "")
@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_onnx_runtime_says_up_front_which_dtype_it_cannot_run(dtype: torch.dtype) -> None:
    """A bf16 graph was exported and its session opened (15 s) to fail with ONNX Runtime's
    raw INVALID_GRAPH / NOT_IMPLEMENTED: ``unsupported_dtypes`` says so before building, and
    is right about it: where it says nothing the candidate builds and matches eager, where it
    gives a reason building fails."""
    model = _Mlp().eval().to(dtype)
    x = torch.randn(4, 16, dtype=dtype)
    gm = torch.export.export(model, (x,)).module()
    why = ort.unsupported_dtypes(gm, "cpu")
    with torch.no_grad():
        expected = model(x)
    if dtype == torch.float32:
        assert why == ""
    if why:
        assert str(dtype).removeprefix("torch.") in why and "ONNX Runtime" in why
        with pytest.raises(Exception):  # noqa: B017 - what ORT raises is ORT's to choose
            ort.lower(gm, model.forward, (x,), {}, expected, torch.device("cpu"))(x)
    else:
        run = ort.lower(gm, model.forward, (x,), {}, expected, torch.device("cpu"))
        torch.testing.assert_close(run(x), expected, rtol=0.05, atol=0.05)
