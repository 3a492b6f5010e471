"""What ``optimize`` did, in a form both a person and a test can read."""

from __future__ import annotations

import textwrap
from collections import Counter
from dataclasses import dataclass, field

from autoopt.check.compare import VerifyResult
from autoopt.passes.precision import PrecisionSummary
from autoopt.planning.memory_plan import MemoryPlan

# The longest line describe() writes (a report line, indented, fits a 100-column terminal).
_WIDTH = 96
_GLUE = "\x1f"  # a space textwrap does not break at


@dataclass
class PassRecord:
    """One pass's outcome on one graph.

    ``status`` is ``applied`` (changed the graph and was kept), ``unchanged``, ``rolled_back``
    (its result failed lint or verification), ``failed`` (it raised) or ``disabled``.
    """

    name: str
    status: str
    counts: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    reason: str = ""


@dataclass
class BackendChoice:
    """Which backend executes one graph, and why.

    Args:
        graph: which graph: ``whole graph`` or ``subgraph N`` (Dynamo).
        chosen: the backend that runs it (``aten``, ``inductor``, ``onnxruntime``).
        seconds: each verified candidate's measured median seconds a call (forward and
            backward for a graph with gradients); empty when only one candidate was left.
        skipped: each candidate not used for a reason other than speed, with the reason
            (not installed, failed to lower, differs from eager, not for training).
        cached: the measurement came from the on-disk cache (an earlier ``optimize`` of the
            same graph, shapes, device, thread count and library versions).
        regions: for a backend that splits the graph between kernel libraries (``hybrid``),
            how: autoopt's kernel calls and the regions Inductor generates between them.
        eager_s: the model's own eager call, where the candidates were timed against it
            (a whole graph): ``eager_s / seconds[chosen]`` is the chosen backend's speedup.
        shared: why the timings may not be this machine's own (other processes held the
            cores, or a time below what the machine's peak allows, after a second
            measurement), or "": the choice is measured again at the next ``optimize``.
    """

    graph: str
    chosen: str
    seconds: dict[str, float] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    cached: bool = False
    regions: str = ""
    eager_s: float | None = None
    shared: str = ""

    def describe(self) -> str:
        """The choice (and the regions) on a first line, then indented lines for the timings,
        and for each candidate not used with its reason, all wrapped at ``_WIDTH`` characters
        (each reason whole: one cut at the width read as if it ended there)."""
        # Each "name 1.2 ms" is one word (_GLUE for its spaces) so that wrapping keeps it whole.
        timed = ", ".join(f"{n}{_GLUE}{s * 1e3:.3g}{_GLUE}ms" for n, s in
                          sorted(self.seconds.items(), key=lambda item: item[1]))
        if timed and self.eager_s:
            timed += f";{_GLUE}eager{_GLUE}{self.eager_s * 1e3:.3g}{_GLUE}ms"
        lines = [f"backend {self.chosen} for the {self.graph}"
                 + (f" ({self.regions})" if self.regions else "")]
        if timed:
            lines.append(f"  measured{' earlier' if self.cached else ''}: {timed}")
        if self.shared:
            lines.append(f"  measured on a shared machine ({self.shared}); measured again at "
                         "the next optimize")
        fastest = min(self.seconds, key=self.seconds.__getitem__, default=self.chosen)
        if self.chosen in self.seconds and self.seconds[fastest] < self.seconds[self.chosen]:
            gain = 1.0 - self.seconds[fastest] / self.seconds[self.chosen]
            lines.append(f"  {self.chosen} kept, earlier in the order of preference: "
                         f"{fastest} measured only {gain:.1%} faster")
        wrapped = [part.replace(_GLUE, " ") for line in lines
                   for part in textwrap.wrap(line, _WIDTH, subsequent_indent="    ")]
        for name, why in self.skipped.items():  # a reason over lines is one paragraph here
            wrapped += textwrap.wrap(f"  not {name}: {' '.join(why.split())}", _WIDTH,
                                     subsequent_indent="      ", break_long_words=False,
                                     break_on_hyphens=False)
        return "\n".join(wrapped)


@dataclass
class CaptureRecord:
    """How one input signature was captured and optimized.

    Args:
        inputs: the input signature, e.g. ``x: f32[1, 3, 224, 224]``.
        method: ``export``, ``symbolic_trace``, ``dynamo`` (partial capture: each captured
            subgraph optimized, the rest eager) or ``eager`` (nothing captured).
        attempts: each capture method tried before ``method``, with why it was not used.
        passes: the pass records (summed over subgraphs for ``dynamo``).
        verification: the end-to-end comparison against eager, when verification ran.
        subgraphs: how many graphs Dynamo handed over (``dynamo`` only).
        seconds: wall time of capture, passes and verification.
        cuda_graph: ``recorded`` when calls replay one CUDA graph, else why not (empty where
            CUDA graphs do not apply: CPU, training, symbolic shapes, ``cuda_graphs=False``).
        runs: what runs the calls when it is not the optimized graph, and why.
        backends: the backend chosen for each graph (one, or one per Dynamo subgraph).
        memory: each step left out or done one piece at a time because it would exceed
            ``optimize_memory`` or the free memory, with the bytes it needed.
        reused: where the graph was not exported anew, which capture's exported graph the
            passes ran on (a call with gradients after an inference capture).
        rebuilds: how many times the graph was built again from its exported graph after
            the weights it folded or packed were written (no export, no measurement).
    """

    inputs: str
    method: str = "eager"
    attempts: list[tuple[str, str]] = field(default_factory=list)
    passes: list[PassRecord] = field(default_factory=list)
    verification: VerifyResult | None = None
    subgraphs: int = 0
    seconds: float = 0.0
    nodes_before: int = 0
    nodes_after: int = 0
    precision: PrecisionSummary | None = None  # precision=: ops cast, kept in fp32 and why
    memory_plan: MemoryPlan | None = None  # memory_budget's plan (training captures)
    cuda_graph: str = ""
    runs: str = ""
    backends: list[BackendChoice] = field(default_factory=list)
    memory: list[str] = field(default_factory=list)
    reused: str = ""
    rebuilds: int = 0


@dataclass
class Report:
    """Everything ``optimize`` and later re-captures did, oldest first."""

    captures: list[CaptureRecord] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    # Why the example call's graph is not built yet (``optimize`` of a model that generates
    # builds it at the first forward call); shown until a graph is.
    deferred: str = ""

    @property
    def capture_method(self) -> str:
        """How the example inputs were captured (the first signature's method)."""
        return self.captures[0].method if self.captures else "none"

    @property
    def pass_counts(self) -> dict[str, int]:
        """Rewrite counts over every captured signature and subgraph, by kind."""
        total: Counter[str] = Counter()
        for capture in self.captures:
            for record in capture.passes:
                if record.status == "applied":
                    total.update(record.counts)
        return dict(total)

    @property
    def backends(self) -> list[BackendChoice]:
        """The backend chosen for every graph of every captured signature, oldest first."""
        return [choice for capture in self.captures for choice in capture.backends]

    def passes_with_status(self, status: str) -> list[str]:
        return sorted({r.name for c in self.captures for r in c.passes if r.status == status})

    @property
    def rolled_back(self) -> list[str]:
        """Passes whose result was undone because it failed lint or verification, or raised."""
        return sorted(set(self.passes_with_status("rolled_back"))
                      | set(self.passes_with_status("failed")))

    def __str__(self) -> str:
        lines = ["autoopt report"]
        if self.deferred and not self.captures:
            lines.append(f"forward: {self.deferred}")
        for i, c in enumerate(self.captures):
            lines.append(f"[{i}] inputs: {c.inputs}")
            # The seconds are the whole build, not the capture method's: "export (71.78 s)"
            # read as a 72 s torch.export.
            lines.append(f"    capture: {c.method}"
                         + (f", {c.subgraphs} subgraph(s)" if c.method == "dynamo" else "")
                         + f"; built in {c.seconds:.2f} s (capture, passes, verification, "
                           f"backend choice)")
            for method, why in c.attempts:
                lines.append(f"      not {method}: {why}")
            if c.reused:
                lines.append(f"    reused: {c.reused}")
            if c.rebuilds:
                lines.append(f"    rebuilt {c.rebuilds} time(s) for new weights (no new export)")
            if c.nodes_before:
                lines.append(f"    nodes: {c.nodes_before} -> {c.nodes_after}")
            for r in c.passes:
                counts = ", ".join(f"{k}={v}" for k, v in sorted(r.counts.items()))
                extra = f" [{counts}]" if counts else ""
                why = f": {r.reason}" if r.reason else ""
                lines.append(f"    pass {r.name:<16} {r.status:<11} {r.seconds * 1e3:7.1f} ms"
                             f"{extra}{why}")
            if c.memory_plan is not None:
                lines.extend("    " + line for line in c.memory_plan.describe().splitlines())
            if c.precision is not None:
                lines.extend("    " + line for line in c.precision.lines())
            if c.verification is not None:
                lines.append(f"    verification: {c.verification}")
            if c.cuda_graph:
                lines.append(f"    cuda graph: {c.cuda_graph}")
            if c.runs:
                lines.append(f"    runs: {c.runs}")
            lines.extend(f"    {line}" for choice in c.backends
                         for line in choice.describe().splitlines())
            lines.extend(f"    not done for memory: {note}" for note in c.memory)
        lines.extend(f"warning: {w}" for w in self.warnings)
        return "\n".join(lines)
