"""What a module's first graph measured, reused by the graphs after it (a new batch size, a
dimension made dynamic): the backend that won and the passes that found nothing to do.

The first ``optimize`` of a model builds every backend candidate, verifies and times each
against eager: most of its time. A later input size of the same module runs the same model on
the same machine; measuring every candidate again cost more than the first ``optimize`` (the
Quick start's second batch size: 63 s after a 50 s ``optimize``). So a new signature in the
same modes (grad, autocast, train or eval) builds only the backend measured fastest for the
first one, skips the passes
that did not apply there (a rewrite looks at the graph's structure, which a new size does not
change), and, where that backend lowers the graph from before autoopt's own lowerings
(Inductor, ONNX Runtime, OpenVINO), skips those lowering passes too. The graph is verified
against eager as every graph is; where the backend cannot build it, the aten graph runs.

A first choice made on a shared machine (``BackendChoice.shared``) is not reused: it is not a
measurement of this machine, and the new graph measures its candidates again.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from autoopt.check.report import BackendChoice, CaptureRecord
from autoopt.options.config import OptimizeConfig
from autoopt.passes import LOWERING

# Backends that run the graph the lowering passes produced: the other ones start from the
# graph before them (``portable``).
_RUN_LOWERED = ("aten", "hybrid")


@dataclass(frozen=True)
class Earlier:
    """The first graph's measured choice: ``backend``, at ``inputs`` (its signature), with
    the candidates' ``seconds``; ``idle``: the passes that did not apply to it."""

    backend: str
    inputs: str
    seconds: dict[str, float]
    idle: frozenset[str]

    @classmethod
    def of(cls, record: CaptureRecord, choice: BackendChoice) -> Earlier | None:
        """What ``record``'s choice lets later graphs reuse; None where it measured nothing
        (one candidate), or measured on a shared machine."""
        if len(choice.seconds) < 2 or choice.shared:
            return None
        idle = frozenset(r.name for r in record.passes if r.status != "applied")
        return cls(choice.chosen, record.inputs, dict(choice.seconds), idle)

    def config(self, config: OptimizeConfig) -> OptimizeConfig:
        """``config`` for a later graph: the one backend, the passes that can matter."""
        known = {name for name, _ in config.passes}
        skip = set(self.idle)
        if self.backend not in _RUN_LOWERED:
            skip |= LOWERING
        return dataclasses.replace(config, backend=None, backends=(self.backend,),
                                   disable=tuple(sorted({*config.disable, *(skip & known)})))

    def note(self, choice: BackendChoice) -> None:
        """Say in ``choice`` why the other candidates were not measured for this graph (the
        one that runs it, aten where the first graph's winner could not, excepted)."""
        ranked = sorted(self.seconds.items(), key=lambda item: item[1])
        timed = ", ".join(f"{name} {seconds * 1e3:.3g} ms" for name, seconds in ranked)
        for name in self.seconds:
            if name not in (self.backend, choice.chosen):
                choice.skipped.setdefault(
                    name, f"not measured for these inputs: {self.backend} was measured "
                          f"fastest for {self.inputs} ({timed}); optimize with these inputs "
                          f"to measure them here")
