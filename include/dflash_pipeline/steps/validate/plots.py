"""The report's PNG plots, drawn from validation's fixed-size histograms.

Why: a length distribution or a slow server is seen at a glance, not in a table. matplotlib is
imported here only (Agg canvas, no pyplot state), so neither the DAG parse nor a validation
without plots pays for it.
"""

from __future__ import annotations

import io
import logging
from typing import TYPE_CHECKING, Any

import numpy as np

from dflash_pipeline.config import short_server_labels

if TYPE_CHECKING:
    from dflash_pipeline.steps.validate.histogram import Histogram, Histogram2D

logger = logging.getLogger(__name__)

PLOT_NAMES = ("completion_lengths", "thinking_vs_answer", "server_throughput")
DPI = 90


def _figure(width: float, height: float) -> tuple[Any, Any]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.canvas


def _png(fig: Any) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    return buf.getvalue()


def _display_bins(hists: dict[str, Histogram], bins: int = 50) -> np.ndarray:
    top = max((h.max or 0) for h in hists.values()) if hists else 1
    return np.unique(np.concatenate([[0, 1], np.geomspace(1, max(2, top + 1), bins)]).round()).astype(np.int64)


def completion_lengths(by_finish: dict[str, Histogram], title: str) -> bytes:
    """Output tokens per completion, one step curve per finish_reason (log x)."""
    fig, _ = _figure(7.5, 4.0)
    ax = fig.add_subplot()
    hists = {k: h for k, h in by_finish.items() if h.n}
    edges = _display_bins(hists)
    for name, h in sorted(hists.items(), key=lambda kv: -kv[1].n):
        counts = np.zeros(len(edges) - 1, dtype=np.int64)
        for low, _high, n in h.nonzero():
            counts[min(max(int(np.searchsorted(edges, low, side="right")) - 1, 0), len(counts) - 1)] += n
        ax.stairs(counts, edges + 1, label=f"{name} ({h.n:,} rows, median {h.quantile(0.5):,})")
    ax.set_xscale("log")
    ax.set_xlabel("completion tokens (server usage) + 1")
    ax.set_ylabel("completions")
    ax.set_title(title, fontsize=10)
    if hists:
        ax.legend(fontsize=8)
    return _png(fig)


def thinking_vs_answer(h2: Histogram2D, unit: str, skipped: int) -> bytes:
    """2-D histogram of thinking length against answer length (log-log, log colour)."""
    from matplotlib.colors import LogNorm

    fig, _ = _figure(6.0, 5.0)
    ax = fig.add_subplot()
    edges = h2.edges + 1
    counts = h2.counts.T.astype(float)
    counts[counts == 0] = np.nan
    if h2.n:
        used_x = np.flatnonzero(h2.counts.sum(axis=1))
        used_y = np.flatnonzero(h2.counts.sum(axis=0))
        mesh = ax.pcolormesh(edges, edges, counts, norm=LogNorm(vmin=1, vmax=max(1, int(h2.counts.max()))), cmap="viridis")
        fig.colorbar(mesh, ax=ax, label="completions")
        ax.set_xlim(edges[used_x[0]], edges[used_x[-1] + 1])
        ax.set_ylim(edges[used_y[0]], edges[used_y[-1] + 1])
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(f"thinking {unit} + 1")
    ax.set_ylabel(f"answer {unit} + 1")
    note = f"; {skipped:,} rows without a usage split left out" if skipped else ""
    ax.set_title(f"thinking vs answer length ({h2.n:,} completions{note})", fontsize=9)
    return _png(fig)


def server_throughput(per_server: dict[str, dict[str, Any]]) -> bytes:
    """Per server: output tokens produced, and output tokens per second of request time.

    Horizontal bars, one row per server, labelled with the host:port (or its tail): URLs side by
    side under vertical bars overlapped into unreadable text. The report's table has full names.
    """
    from matplotlib.ticker import EngFormatter

    names = list(per_server)
    labels = short_server_labels(names, max_len=28)
    errors = [int(per_server[n].get("errors") or 0) for n in names]
    labels = [f"{lab} ({e:,} err)" if e else lab for lab, e in zip(labels, errors)]
    fig, _ = _figure(7.0, max(2.8, 1.1 + 0.36 * len(names)))
    left, right = fig.subplots(1, 2, sharey=True)
    y = np.arange(len(names))
    tokens = [per_server[n]["output_tokens"] for n in names]
    rate = [per_server[n].get("output_tokens_per_request_s") or 0.0 for n in names]
    for ax, vals, color, title, fmt in ((left, tokens, "tab:blue", "output tokens", "{:,.0f}"),
                                        (right, rate, "tab:green", "output tokens per request-second", "{:,.1f}")):
        bars = ax.barh(y, vals, color=color)
        ax.bar_label(bars, [fmt.format(v) for v in vals], padding=3, fontsize=9)
        ax.set_title(title, fontsize=10)
        ax.margins(x=0.3)
        ax.tick_params(axis="x", labelsize=8)
        ax.xaxis.set_major_formatter(EngFormatter(sep=""))
    left.set_yticks(y, labels, fontsize=9)
    left.invert_yaxis()  # first server on top, as in the report's table
    return _png(fig)


def render_all(
    by_finish: dict[str, Histogram],
    h2: Histogram2D,
    h2_unit: str,
    h2_skipped: int,
    per_server: dict[str, dict[str, Any]],
    title: str,
) -> dict[str, bytes]:
    """All plots as PNG bytes by name; a plot that fails is logged and left out."""
    out: dict[str, bytes] = {}
    makers = {
        "completion_lengths": lambda: completion_lengths(by_finish, title),
        "thinking_vs_answer": lambda: thinking_vs_answer(h2, h2_unit, h2_skipped),
        "server_throughput": lambda: server_throughput(per_server),
    }
    for name, make in makers.items():
        try:
            out[name] = make()
        except Exception:  # noqa: BLE001 - a plot must never cost the report
            logger.exception("plot %s failed; the report is written without it", name)
    return out
