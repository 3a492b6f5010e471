"""The HTML report's charts: matplotlib figures drawn headless and inlined as SVG, in one
colour scheme shared by every chart."""

from __future__ import annotations

import io
import re
from typing import Any

# One colour per cause and per bound, shared by every chart.
COLOURS = {"data": "#e4572e", "memory": "#4c72b0", "operators": "#f3a712",
           "parallelism": "#8172b2", "useful compute": "#55a868", "other": "#bbbbbb",
           "compute": "#55a868", "overhead": "#f3a712", "": "#999999",
           "before": "#9aa5b1", "after": "#2a9d8f"}


def figure(width: float, height: float) -> tuple[Any, Any]:
    """A headless matplotlib figure of this size in inches, and its one axes."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    ax = fig.add_subplot()
    ax.spines[["top", "right"]].set_visible(False)
    return fig, ax


def svg(fig: Any) -> str:
    """The figure as inline SVG: text kept as text, and without the XML prologue, DOCTYPE,
    metadata and namespace declarations (HTML knows <svg>), so the file names no URL."""
    import matplotlib
    from matplotlib.backends.backend_svg import FigureCanvasSVG

    buffer = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "autoopt"}):
        FigureCanvasSVG(fig).print_svg(buffer, metadata={"Date": None})
    text = buffer.getvalue()
    text = text[text.index("<svg"):]
    text = re.sub(r"<metadata>.*?</metadata>", "", text, flags=re.S)
    text = re.sub(r'\s+xmlns(:\w+)?="[^"]*"', "", text)
    return f"<div class=\"chart\">{text}</div>"
