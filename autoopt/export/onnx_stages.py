"""Pipeline stages as ONNX files: one file per stage and a JSON manifest that connects them.

    model ─ partition ─ stage0.onnx ─ stage1.onnx ─ ... ─ outputs
                        manifest.json: files in order; each stage's outputs, in order, are
                        the next stage's inputs; the model's flat inputs and outputs

Each stage is exported and checked under ONNX Runtime by ``autoopt.export_onnx`` (against the
stage run eagerly); ``OnnxStages`` runs the files in sequence.

Example:
    >>> manifest = export_onnx_stages(model, (x,), "stages/", stages=2)
    >>> outputs = OnnxStages("stages/manifest.json")(x)   # the model's flat outputs
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from autoopt.capture.graph import export_graph
from autoopt.errors import InputError
from autoopt.export.onnx import OnnxReport, eval_mode, export_onnx
from autoopt.onnx.session import onnx_session
from autoopt.parallel.partition import Partition
from autoopt.parallel.planning import device_specs, plan_stages
from autoopt.parallel.stages import emit_stages

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"


def export_onnx_stages(model: nn.Module, example_inputs: tuple[Any, ...], directory: str | Path,
                       *, example_kwargs: Mapping[str, Any] | None = None, stages: int = 2,
                       plan: Partition | None = None, verify: bool = True,
                       ) -> dict[str, Any]:
    """Cut ``model`` into ``stages`` (or as ``plan`` says), export each stage to
    ``directory/stage{i}.onnx``, check each under ONNX Runtime, and write the manifest.

    Returns:
        The manifest (also written to ``directory/manifest.json``), with each stage's
        ``OnnxReport`` as text under ``report``.
    """
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    kwargs = dict(example_kwargs or {})
    with torch.no_grad(), eval_mode(model):
        gm = export_graph(model, tuple(example_inputs), kwargs)
    values = pytree.tree_leaves((tuple(example_inputs), kwargs))
    if plan is None:
        plan = plan_stages(gm, values, device_specs(["cpu"] * stages))
    entries = []
    for i, stage in enumerate(emit_stages(gm, plan)):
        path = folder / f"stage{i}.onnx"
        report: OnnxReport = export_onnx(stage, tuple(values), path, verify=verify)
        entries.append({"file": path.name, "inputs": list(report.inputs),
                        "outputs": list(report.outputs), "report": str(report)})
        with torch.no_grad():
            values = list(stage(*values))
    manifest = {
        "format": "autoopt-onnx-stages/1",
        "connection": "stage i+1's inputs, in order, are stage i's outputs, in order",
        "inputs": entries[0]["inputs"], "outputs": entries[-1]["outputs"],
        "bottleneck_ms": plan.bottleneck_s * 1e3, "balance": plan.balance,
        "stages": entries,
    }
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1))
    log.info("wrote %d ONNX stages to %s", len(entries), folder)
    return manifest


class OnnxStages:
    """The stages of a manifest under ONNX Runtime, run in sequence.

    Args:
        manifest: the ``manifest.json`` (or its directory).
        device: ONNX Runtime's device, as for ``onnx_session``.
    """

    def __init__(self, manifest: str | Path, device: str | torch.device = "cpu") -> None:
        path = Path(manifest)
        path = path / MANIFEST if path.is_dir() else path
        if not path.is_file():
            raise InputError(f"no ONNX stage manifest at {path}; export_onnx_stages writes one")
        self.manifest = json.loads(path.read_text())
        self.sessions = [onnx_session(path.parent / s["file"], device)
                         for s in self.manifest["stages"]]

    def __call__(self, *inputs: torch.Tensor) -> list[torch.Tensor]:
        """The model's flat outputs from its flat tensor inputs."""
        values: list[torch.Tensor] = list(inputs)
        for session in self.sessions:
            if len(values) != len(session.input_names):
                raise InputError(f"stage takes {len(session.input_names)} inputs "
                                 f"({session.input_names}); got {len(values)}")
            outputs = session.run(dict(zip(session.input_names, values, strict=True)))
            values = [outputs[name] for name in session.output_names]
        return values
