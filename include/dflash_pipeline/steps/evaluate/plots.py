"""The eval's plot: acceptance per drafter and condition (with CIs), per-position acceptance and the
per-domain figures of the headline condition, each bar labelled with the prompts it stands on ("no
CI" where too few prompts for an interval). Agg canvas, no pyplot state (as steps/validate/plots.py)."""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import Any

import numpy as np

DPI = 90


def acceptance_plot(report: Mapping[str, Any]) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    groups: Mapping[str, Mapping[str, Any]] = report["groups"]
    conds = [c["name"] for c in report["conditions"]]
    spec = [g for g, cs in groups.items() if any((f["acceptance"]["rows_with_stats"] or 0) for f in cs.values())]
    headline = report.get("headline_condition")
    fig = Figure(figsize=(13, 4.2), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    ax1, ax2, ax3 = fig.subplots(1, 3, width_ratios=[1.4, 1, 1.2])
    width = 0.8 / max(1, len(spec))
    x = np.arange(len(conds))
    for i, g in enumerate(spec):
        vals, lo, hi = [], [], []
        for c in conds:
            a = (groups[g].get(c) or {}).get("acceptance") or {}
            v = a.get("acceptance_length")
            vals.append(v if v is not None else np.nan)
            lo.append(v - a["ci_low"] if v is not None and a.get("ci_low") is not None else 0)
            hi.append(a["ci_high"] - v if v is not None and a.get("ci_high") is not None else 0)
        ax1.bar(x + (i - (len(spec) - 1) / 2) * width, vals, width, yerr=[lo, hi], capsize=3, label=g)
    ax1.set_xticks(x, conds, rotation=25, ha="right", fontsize=8)
    ax1.set_ylabel("acceptance length (tokens / verify step)")
    ax1.set_title("acceptance by condition (CI bars; none under the prompt floor)")
    ax1.axhline(1.0, color="grey", lw=0.8)
    if spec:
        ax1.legend(fontsize=8)
    for g in spec:
        pp = ((groups[g].get(headline) or {}).get("acceptance") or {}).get("per_position")
        if pp:
            ax2.plot(range(1, len(pp) + 1), pp, marker="o", label=g)
    ax2.xaxis.get_major_locator().set_params(integer=True)
    ax2.set_xlabel("draft position")
    ax2.set_ylabel("acceptance rate")
    ax2.set_ylim(0, 1.02)
    ax2.set_title(f"per position ({headline})", fontsize=9)
    domains = sorted({d for g in spec for d in ((groups[g].get(headline) or {}).get("by_domain") or {})})
    xd = np.arange(len(domains))
    for i, g in enumerate(spec):
        by = (groups[g].get(headline) or {}).get("by_domain") or {}
        vals = [by.get(d, {}).get("acceptance_length") or np.nan for d in domains]
        err = [[(by[d]["acceptance_length"] - by[d]["ci_low"]) if d in by and by[d].get("ci_low") is not None else 0
                for d in domains],
               [(by[d]["ci_high"] - by[d]["acceptance_length"]) if d in by and by[d].get("ci_high") is not None else 0
                for d in domains]]
        bars = ax3.bar(xd + (i - (len(spec) - 1) / 2) * width, vals, width, yerr=err, capsize=3, label=g)
        labels = [(f"n={by[d].get('prompts')}" + ("" if by[d].get("ci_low") is not None else "\nno CI"))
                  if d in by and by[d].get("acceptance_length") is not None else "" for d in domains]
        ax3.bar_label(bars, labels=labels, fontsize=6, padding=2)
    ax3.set_xticks(xd, domains, rotation=25, ha="right", fontsize=8)
    ax3.set_title(f"by domain ({headline})", fontsize=9)
    ax3.set_ylabel("acceptance length")
    ax3.axhline(1.0, color="grey", lw=0.8)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    return buf.getvalue()
