"""Stage-wise ONNX export (autoopt/onnx_stages.py): one file per stage, a manifest that says
how they connect, and the files run in sequence under ONNX Runtime equal eager."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from model_zoo import bert
from torch import nn
from torch.utils import _pytree as pytree

from autoopt.errors import InputError
from autoopt.export.onnx_stages import OnnxStages, export_onnx_stages


def test_stages_run_in_sequence_under_ort_equal_eager(tmp_path: Path) -> None:
    # BERT: integer inputs, and a mask that stage 0 passes on to the stage that needs it.
    model, args, kwargs = bert()
    # Each stage's own ORT check is export_onnx's (tested there); here: the whole chain.
    manifest = export_onnx_stages(model, args, tmp_path, example_kwargs=kwargs, stages=2,
                                  verify=False)
    written = json.loads((tmp_path / "manifest.json").read_text())
    assert written["stages"] == manifest["stages"] and len(written["stages"]) == 2
    assert all((tmp_path / s["file"]).is_file() for s in written["stages"])
    # The connection the manifest states: stage 1 takes what stage 0 returns.
    assert len(written["stages"][1]["inputs"]) == len(written["stages"][0]["outputs"])
    flat = pytree.tree_leaves((args, kwargs))
    with torch.no_grad():
        expected = [x for x in pytree.tree_leaves(model(*args, **kwargs))
                    if isinstance(x, torch.Tensor)]
    stages = OnnxStages(tmp_path)
    actual = stages(*flat)
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-4)
    with pytest.raises(InputError, match=r"stage takes 2 inputs \(\['input_ids', "
                                         r"'attention_mask'\]\); got 1"):
        stages(flat[0])


def test_missing_manifest_is_an_input_error(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="no ONNX stage manifest at .*export_onnx_stages"):
        OnnxStages(tmp_path)



def test_the_model_keeps_its_training_mode(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Dropout(),
                          nn.Linear(16, 4)).train()
    model[3].eval()  # a submodule in its own mode keeps it too
    export_onnx_stages(model, (torch.randn(2, 8),), tmp_path, stages=2, verify=False)
    assert [m.training for m in model.modules()] == [True, True, True, True, False, True]
