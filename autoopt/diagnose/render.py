"""One self-contained HTML file that shows what autoopt found and did, as charts.

    write_report("report.html", collect(model, (x,), {}, optimized=fast))

Sections: before/after latency and model FLOP utilization, where step time goes (the
diagnosis, with evidence and fixes), the per-op time breakdown before and after, utilization
over time, what each pass changed, and, where the optimized module has them, the precision
map, the stage partition with per-stage time and memory, and the memory plan ("not used"
otherwise). Charts are matplotlib
figures inlined as SVG; the file loads nothing from the network, so it opens anywhere. What is
shown is measured by ``collect`` (``autoopt.diagnose.collect``).
"""

from __future__ import annotations

import dataclasses
import html
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from torch import nn

from autoopt.diagnose.charts import COLOURS, figure, svg
from autoopt.diagnose.collect import ReportData
from autoopt.diagnose.diagnosis import Diagnosis
from autoopt.diagnose.findings import CAUSES
from autoopt.diagnose.per_op import OpTime

_TOP_OPS = 12


def write_report(path: str | Path, data: ReportData) -> Path:
    """Write the HTML report; returns its path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_html(data), encoding="utf-8")
    return path


def render_html(data: ReportData) -> str:
    """The whole report as one HTML document (inline CSS and SVG, no scripts, no links)."""
    sections = [_summary(data), _latency_section(data), _diagnosis_section(data),
                _ops_section(data), _utilization_section(data), _passes_section(data)]
    sections += [_feature_section(title, value) for title, value in _features(data)]
    body = "\n".join(s for s in sections if s)
    return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>autoopt report: {_e(data.title)}</title><style>{_CSS}</style></head>"
            f"<body><h1>autoopt report: {_e(data.title)}</h1>"
            f"<p class=\"meta\">{_e(data.device)}, {data.threads} thread(s), {_e(data.created)}"
            f"</p>{body}</body></html>\n")


def _summary(data: ReportData) -> str:
    cards = []
    if data.latency_s:
        for name, seconds in data.latency_s.items():
            cards.append((name, f"{seconds * 1e3:.3f} ms"))
        values = list(data.latency_s.values())
        if len(values) == 2 and values[1] > 0:
            cards.append(("speed-up", f"{values[0] / values[1]:.2f}×"))
    for label, d in (("before", data.before), ("after", data.after)):
        if d is not None and d.flops is not None:
            cards.append((f"MFU {label}", f"{d.flops.mfu:.1%} of {d.flops.precision} peak"))
    if data.before is not None:
        top = data.before.top
        cards.append(("top cause", f"{top.cause} ({top.share:.0%})" if top is not None
                      and top.share >= 0.1 else "none above 10%: compute-bound"))
    if not cards:
        return ""
    inner = "".join(f"<div class=\"card\"><div class=\"k\">{_e(k)}</div>"
                    f"<div class=\"v\">{_e(v)}</div></div>" for k, v in cards)
    return f"<div class=\"cards\">{inner}</div>"


def _latency_section(data: ReportData) -> str:
    if not data.latency_s:
        return _section("Before / after latency", "<p class=\"none\">not measured</p>")
    names = list(data.latency_s)
    ms = [data.latency_s[n] * 1e3 for n in names]
    fig, ax = figure(6.5, 0.6 + 0.5 * len(names))
    bars = ax.barh(names, ms, color=[COLOURS["before"], COLOURS["after"]][:len(names)]
                   + [COLOURS["after"]] * max(0, len(names) - 2))
    ax.bar_label(bars, labels=[f"{v:.3f} ms" for v in ms], padding=3, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("median latency per call (ms), interleaved runs")
    ax.set_xlim(0, max(ms) * 1.25)
    return _section("Before / after latency", svg(fig))


def _diagnosis_section(data: ReportData) -> str:
    rows = [(label, d) for label, d in (("before", data.before), ("after", data.after)) if d]
    if not rows:
        return _section("Diagnosis", "<p class=\"none\">not run</p>")
    keys = list(CAUSES) + ["useful compute", "other"]
    fig, ax = figure(7.5, 0.9 + 0.55 * len(rows))
    for i, (_, d) in enumerate(rows):
        left = 0.0
        for key in keys:
            share = d.shares.get(key, 0.0) * d.step.total_s * 1e3
            ax.barh(i, share, left=left, color=COLOURS[key],
                    label=key if i == 0 else None)
            left += share
    ax.set_yticks(range(len(rows)), [f"{label}\n{d.step.total_s * 1e3:.2f} ms/step"
                                     for label, d in rows])
    ax.invert_yaxis()
    ax.set_xlabel("step time (ms) by cause")
    ax.legend(ncol=3, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.35 if
              len(rows) > 1 else -0.6), frameon=False)
    parts = [svg(fig)]
    for label, d in rows:
        parts.append(f"<h3>{_e(label)}: {_e(_step_line(d))}</h3>")
        if d.flops is not None:  # model FLOP utilization, next to the utilization counters
            parts.append(f"<p class=\"mfu\"><b>{_e(d.flops.line())}</b>; "
                         f"{_e(d.utilization.summary())}</p>")
        if not d.findings:
            parts.append("<p>no cause above 1% of step time</p>")
        for f in d.findings:
            evidence = "".join(f"<li><b>{_e(k)}</b>: {_e(v)}</li>" for k, v in f.evidence)
            fixes = "".join(f"<li><b>{_e(r.option)}</b>: <code>{_e(r.how)}</code></li>"
                            for r in f.remedies)
            parts.append(f"<div class=\"finding\" style=\"border-color:{COLOURS[f.cause]}\">"
                         f"<div class=\"ft\">{f.share:.1%} &nbsp; <b>{_e(f.cause)}</b>: "
                         f"{_e(f.title)}</div><ul>{evidence}</ul><div class=\"fix\">fixes:"
                         f"</div><ul>{fixes}</ul></div>")
        for note in d.notes:
            parts.append(f"<p class=\"note\">note: {_e(note)}</p>")
    return _section("Diagnosis: where step time goes", "".join(parts))


def _ops_section(data: ReportData) -> str:
    rows = [(label, d.ops) for label, d in (("before", data.before), ("after", data.after))
            if d is not None and d.ops]
    if not rows:
        return _section("Per-op time", "<p class=\"none\">not profiled</p>")
    parts = []
    for label, ops in rows:
        top = ops[:_TOP_OPS]
        fig, ax = figure(7.5, 0.6 + 0.28 * len(top))
        names = [f"{o.name.removeprefix('aten::')} ×{o.calls:g}" for o in top]
        values = [o.seconds * 1e3 for o in top]
        ax.barh(names, values, color=[COLOURS.get(o.bound, COLOURS[""]) for o in top])
        ax.invert_yaxis()
        ax.set_xlabel(f"{label}: ms per step (torch.profiler)")
        ax.tick_params(axis="y", labelsize=7)
        parts.append(f"<h3>{_e(label)}</h3>" + svg(fig) + _ops_table(top, ops))
    legend = ("<p class=\"note\">Colour: what limits the op in the cost model's roofline: "
              "<b style=\"color:#55a868\">compute</b>, <b style=\"color:#4c72b0\">memory</b>, "
              "<b style=\"color:#f3a712\">launch/dispatch overhead</b>, grey: not in the "
              "graph.</p>")
    return _section("Per-op time breakdown", legend + "".join(parts))


def _ops_table(top: Sequence[OpTime], ops: Sequence[OpTime]) -> str:
    total = sum(o.seconds for o in ops) or 1.0
    rows = "".join(f"<tr><td>{_e(o.name)}</td><td>{o.calls:g}</td><td>{o.seconds * 1e3:.3f}"
                   f"</td><td>{o.seconds / total:.1%}</td><td>{_e(o.bound or '-')}</td></tr>"
                   for o in top)
    return ("<details><summary>table</summary><table><tr><th>op</th><th>calls/step</th>"
            f"<th>ms/step</th><th>share</th><th>bound</th></tr>{rows}</table></details>")


def _utilization_section(data: ReportData) -> str:
    rows = [(label, d.utilization) for label, d in (("before", data.before),
                                                    ("after", data.after)) if d is not None]
    if not rows or not any(u.samples for _, u in rows):
        return ""
    fig, ax = figure(7.5, 2.4)
    for label, u in rows:
        t = [s.t for s in u.samples]
        style = "-" if label == "before" else "--"
        style += "o" if len(t) < 20 else ""  # a short run's few samples stay visible
        ax.plot(t, [s.process_cpu_percent for s in u.samples], style,
                color=COLOURS["memory"], label=f"{label}: this process, % of all cores")
        ax.plot(t, [s.cpu_percent for s in u.samples], style, color=COLOURS["other"],
                label=f"{label}: whole machine CPU %")
        if u.has_gpu:
            ax.plot(t, [s.gpu_percent or 0 for s in u.samples], style,
                    color=COLOURS["useful compute"], label=f"{label}: GPU SM %")
            ax.plot(t, [s.gpu_memory_bandwidth_percent or 0 for s in u.samples], style,
                    color=COLOURS["operators"], label=f"{label}: GPU memory bandwidth %")
    ax.set_ylim(0, 105)
    ax.set_xlabel("seconds into the timed steps")
    ax.set_ylabel("%")
    ax.legend(fontsize=7, frameon=False)
    notes = "".join(f"<p>{_e(label)}: {_e(u.summary())}</p>" for label, u in rows)
    return _section("Utilization over time", svg(fig) + notes)


def _passes_section(data: ReportData) -> str:
    report = data.report or getattr(data.optimized, "report", None)
    if report is None or not report.captures:
        why = getattr(report, "deferred", "") or "not optimized"  # a forward not yet built
        return _section("What each pass changed", f"<p class=\"none\">{_e(why)}</p>")
    rows, counts = [], {}
    for i, c in enumerate(report.captures):
        rows.append(f"<tr class=\"cap\"><td colspan=\"5\">[{i}] {_e(c.inputs)}: captured by "
                    f"{_e(c.method)}, nodes {c.nodes_before} → {c.nodes_after}, "
                    f"{_e(str(c.verification) if c.verification else 'not verified')}</td></tr>")
        for r in c.passes:
            changed = ", ".join(f"{k}={v}" for k, v in sorted(r.counts.items()))
            rows.append(f"<tr><td>{_e(r.name)}</td><td class=\"{_e(r.status)}\">"
                        f"{_e(r.status)}</td><td>{_e(changed)}</td><td>{r.seconds * 1e3:.1f}"
                        f"</td><td>{_e(r.reason)}</td></tr>")
            if r.status == "applied":
                counts[r.name] = counts.get(r.name, 0) + sum(r.counts.values())
        for choice in c.backends:
            measured = ", ".join(f"{n}: {s * 1e3:.3g} ms" for n, s in
                                 sorted(choice.seconds.items(), key=lambda item: item[1]))
            skipped = "; ".join(f"not {n}: {why}" for n, why in choice.skipped.items())
            rows.append(f"<tr class=\"backend\"><td>backend ({_e(choice.graph)})</td>"
                        f"<td class=\"applied\">{_e(choice.chosen)}</td><td>{_e(measured)}"
                        f"{' (cached)' if choice.cached else ''}</td><td></td>"
                        f"<td>{_e(skipped)}</td></tr>")
        for note in c.memory:  # steps optimize_memory (or free memory) left out
            step, _, why = note.partition(": ")
            rows.append(f"<tr><td>{_e(step)}</td><td class=\"rolled_back\">not done for "
                        f"memory</td><td></td><td></td><td>{_e(why)}</td></tr>")
    chart = ""
    if counts:
        fig, ax = figure(6.5, 0.6 + 0.35 * len(counts))
        bars = ax.barh(list(counts), list(counts.values()), color=COLOURS["after"])
        ax.bar_label(bars, padding=3, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("rewrites per pass (applied)")
        chart = svg(fig)
    table = ("<table><tr><th>pass</th><th>status</th><th>changes</th><th>ms</th>"
             f"<th>why</th></tr>{''.join(rows)}</table>")
    return _section("What each pass changed", chart + table)


def _features(data: ReportData) -> list[tuple[str, Any]]:
    """The precision map, stage partition and memory plan, wherever the optimized module or
    its report keeps them (None: the feature was not used)."""
    holders: list[Any] = [data.report, data.optimized]
    report = data.report or getattr(data.optimized, "report", None)
    holders += list(getattr(report, "captures", []) or [])
    for spec in getattr(data.optimized, "specializations", ()) or ():
        holders.append(getattr(spec.graph, "meta", None))
    found = []
    for title, names in (("Precision map", ("precision_map", "precision")),
                         ("Stage partition", ("partition", "plan", "stages")),
                         ("Memory plan", ("memory_plan",))):
        found.append((title, _first(holders, names)))
    return found


def _first(holders: Iterable[Any], names: Sequence[str]) -> Any:
    for holder in holders:
        if holder is None:
            continue
        for name in names:
            value = holder.get(name) if isinstance(holder, Mapping) else \
                getattr(holder, name, None)
            if value is not None and not callable(value) and not isinstance(value, nn.Module):
                return value
    return None


def _feature_section(title: str, value: Any) -> str:
    if value is None:
        return _section(title, "<p class=\"none\">not used</p>")
    parts = []
    items = getattr(value, "stages", None) or getattr(value, "segments", None)
    if isinstance(value, Mapping):
        parts.append(_mapping_chart(value))
        parts.append(_table([(str(k), str(v)) for k, v in value.items()], ("name", "value")))
    elif isinstance(items, Sequence) and items:
        parts.append(_items_charts(items, "stage" if getattr(value, "stages", None) else
                                   "segment"))
    if hasattr(value, "low_ops") and hasattr(value, "kept"):  # a precision summary
        parts.append(_counts_chart({f"ops in {getattr(value, 'precision', 'low precision')}":
                                    int(value.low_ops), "kept in fp32": len(value.kept)}))
    text = _text_of(value)
    if text is not None:
        parts.append(f"<pre>{_e(text)}</pre>")
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        scalars = [(f.name, str(getattr(value, f.name))) for f in dataclasses.fields(value)
                   if isinstance(getattr(value, f.name), (int, float, str, bool))]
        parts.append(_table(scalars, ("field", "value")))
    elif not parts:
        parts.append(f"<pre>{_e(str(value))}</pre>")
    return _section(title, "".join(parts))


def _text_of(value: Any) -> str | None:
    """The feature's own text form: ``table()``, ``describe()`` or ``lines()``."""
    for name in ("table", "describe", "lines"):
        method = getattr(value, name, None)
        if callable(method):
            try:
                text = method()
            except TypeError:
                continue
            return "\n".join(text) if isinstance(text, (list, tuple)) else str(text)
    return None


def _mapping_chart(value: Mapping[Any, Any]) -> str:
    """Counts per distinct value (e.g. nodes per dtype in a precision map)."""
    counts: dict[str, int] = {}
    for v in value.values():
        counts[str(v)] = counts.get(str(v), 0) + 1
    return _counts_chart(counts)


def _counts_chart(counts: Mapping[str, int]) -> str:
    if not counts or len(counts) > 20:
        return ""
    fig, ax = figure(6.0, 0.6 + 0.35 * len(counts))
    bars = ax.barh(list(counts), list(counts.values()), color=COLOURS["memory"])
    ax.bar_label(bars, padding=3, fontsize=8)
    ax.set_xlabel("entries per value")
    return svg(fig)


def _items_charts(items: Sequence[Any], noun: str) -> str:
    """Per stage/segment: its ``*_s`` fields as stacked time bars, its ``*bytes`` fields as
    stacked memory bars."""
    def numeric(item: Any, test: Callable[[str], bool]) -> dict[str, float]:
        names = [f.name for f in dataclasses.fields(item)] if dataclasses.is_dataclass(item) \
            else []
        names += [n for n in dir(type(item))  # properties such as ``saved_bytes``
                  if not n.startswith("_") and isinstance(getattr(type(item), n), property)]
        values = {n: getattr(item, n) for n in names if test(n)}
        return {n: float(v) for n, v in values.items()
                if isinstance(v, (int, float)) and not isinstance(v, bool)}

    charts = []
    labels = [f"{getattr(it, 'index', i)}" + (f" {it.device}" if hasattr(it, "device") else "")
              for i, it in enumerate(items)]
    for unit, scale, test in (("ms", 1e3, lambda n: n.endswith("_s")),
                              ("MiB", 1 / 2**20, lambda n: "bytes" in n)):
        rows = [numeric(it, test) for it in items]
        keys = sorted({k for r in rows for k in r})
        if not keys:
            continue
        fig, ax = figure(7.0, 0.8 + 0.35 * len(items))
        left = [0.0] * len(items)
        palette = ["#4c72b0", "#e4572e", "#55a868", "#f3a712", "#8172b2"]
        for j, key in enumerate(keys):
            widths = [r.get(key, 0.0) * scale for r in rows]
            ax.barh(labels, widths, left=left, label=key, color=palette[j % len(palette)])
            left = [a + b for a, b in zip(left, widths, strict=True)]
        ax.invert_yaxis()
        ax.set_xlabel(f"{unit} per {noun}")
        ax.legend(fontsize=7, frameon=False)
        charts.append(svg(fig))
    return "".join(charts)


def _step_line(d: Diagnosis) -> str:
    s = d.step
    return (f"{s.total_s * 1e3:.2f} ms/step (data {s.data_s * 1e3:.2f}, transfer "
            f"{s.transfer_s * 1e3:.2f}, compute {s.compute_s * 1e3:.2f} ms), batch "
            f"{d.batch_size or '?'}, {'training' if d.training else 'inference'}")


def _section(title: str, inner: str) -> str:
    return f"<section><h2>{_e(title)}</h2>{inner}</section>"


def _table(rows: Sequence[tuple[str, str]], header: tuple[str, str]) -> str:
    body = "".join(f"<tr><td>{_e(a)}</td><td>{_e(b)}</td></tr>" for a, b in rows)
    return f"<table><tr><th>{_e(header[0])}</th><th>{_e(header[1])}</th></tr>{body}</table>"


def _e(text: Any) -> str:
    return html.escape(str(text))


_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px auto;
max-width:1100px;color:#222;padding:0 16px}
h1{font-size:24px;margin-bottom:2px}h2{font-size:19px;border-bottom:2px solid #eee;
padding-bottom:4px;margin-top:28px}h3{font-size:15px;margin:14px 0 6px}
.meta{color:#777;margin-top:0}.cards{display:flex;gap:12px;flex-wrap:wrap;margin:16px 0}
.card{background:#f6f8fa;border-radius:8px;padding:10px 16px;min-width:130px}
.card .k{font-size:12px;color:#666}.card .v{font-size:20px;font-weight:600}
.chart svg{max-width:100%;height:auto}
table{border-collapse:collapse;font-size:13px;margin:8px 0}
td,th{border:1px solid #ddd;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#f6f8fa}tr.cap td{background:#eef4fb;font-weight:600}
td.applied{color:#1a7f37}td.rolled_back,td.failed{color:#cf222e}td.unchanged{color:#777}
.finding{border-left:5px solid;padding:6px 12px;margin:8px 0;background:#fafafa}
.finding ul{margin:4px 0 4px 18px;padding:0;font-size:13px}.ft{font-size:14px}
.fix{font-size:12px;color:#555}.none{color:#888;font-style:italic}.note{color:#666;
font-size:12px}pre{background:#f6f8fa;padding:8px;font-size:12px;overflow-x:auto}
code{font-size:12px}
"""
