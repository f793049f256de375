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


def short_names(names: list[str], limit: int = 28) -> list[str]:
    """Axis labels for servers: host:port without the scheme, else the tail; the full names go in
    the figure's footnote when any label had to be cut."""
    out = []
    for n in names:
        text = n.split("://", 1)[-1].rstrip("/")
        out.append(text if len(text) <= limit else "\u2026" + text[-(limit - 1):])
    if len(set(out)) < len(out):
        out = [f"s{i}" for i in range(len(names))]
    return out


def server_throughput(per_server: dict[str, dict[str, Any]]) -> bytes:
    """Per server, as horizontal bars (readable for any number of servers and any URL length):
    output tokens produced, and output tokens per second of request time."""
    names = list(per_server)
    height = max(3.2, min(14.0, 1.4 + 0.45 * len(names)))
    fig, _ = _figure(8.0, height)
    left, right = fig.subplots(1, 2, sharey=True)
    y = np.arange(len(names))
    tokens = [per_server[n]["output_tokens"] for n in names]
    rate = [per_server[n].get("output_tokens_per_request_s") or 0.0 for n in names]
    errors = [per_server[n]["errors"] for n in names]
    short = short_names(names)
    labels = [f"{s} ({e} err)" if e else s for s, e in zip(short, errors)]
    left.barh(y, tokens, color="tab:blue")
    left.set_title("output tokens", fontsize=11)
    right.barh(y, rate, color="tab:green")
    right.set_title("output tokens / request-second", fontsize=11)
    left.set_yticks(y, labels, fontsize=10)
    left.invert_yaxis()
    for ax in (left, right):
        ax.tick_params(axis="x", labelsize=9)
        ax.ticklabel_format(axis="x", style="plain")
    if short != [n.split("://", 1)[-1].rstrip("/") for n in names]:
        fig.text(0.01, 0.005, "; ".join(f"{s} = {n}" for s, n in zip(short, names))[:400], fontsize=6)
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
