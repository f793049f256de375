"""The validation report's acceptance section (steps/validate/acceptance.py) on parts whose truth is
known: rows drawn from the simulator's drafter with a per-domain acceptance probability."""

from __future__ import annotations

import pyarrow as pa
import pytest

from dflash_pipeline.dataset.records import PART_SCHEMA
from dflash_pipeline.dev.sim import spec_drafter
from dflash_pipeline.steps.validate.acceptance import AcceptanceTally, markdown

K = 4
P = {"math": 0.9, "chat": 0.3}


class _Cfg:
    seed = 5
    spec_num_draft_tokens = K
    spec_accept_p = 0.5
    spec_accept_by_keyword = ",".join(f"{k}={v}" for k, v in P.items())


def _part(start: int, n: int, *, with_stats: bool = True, labels: bool = True) -> pa.Table:
    rows = []
    for i in range(start, start + n):
        domain = "math" if i % 2 else "chat"
        tokens = 200 + (i * 37) % 3000
        d = spec_drafter.draw(_Cfg, [{"role": "user", "content": f"{domain} question {i}"}], tokens, i)
        row = {"id": f"r{i}", "sample": 0, "server": "s1", "completion_tokens": tokens, "finish_reason": "stop"}
        if with_stats:
            row.update({"spec_verify_steps": d.verify_steps, "spec_accepted_tokens": d.accepted,
                        "spec_draft_tokens": d.proposed, "spec_accept_histogram": d.histogram()})
        if labels:
            row.update({"domain": domain, "thinking": bool(i % 3)})
        rows.append(row)
    rows.append({"id": "err", "error_class": "Timeout", "server": "s1"})  # error rows are not completions
    table = pa.Table.from_pylist([{c: r.get(c) for c in PART_SCHEMA.names} for r in rows], schema=PART_SCHEMA)
    for name, typ in (("domain", pa.string()), ("thinking", pa.bool_())):
        if labels and name not in table.column_names:  # the label columns come with i30's row labels
            table = table.append_column(name, pa.array([r.get(name) for r in rows], typ))
    return table


def test_breakdown_covers_each_domains_truth_and_counts_rows_without_stats() -> None:
    tally = AcceptanceTally(thinking_default=True)
    for start in range(0, 600, 100):
        tally.add(_part(start, 100))
    tally.add(_part(600, 50, with_stats=False))  # a server that does not say
    report = tally.report()
    assert report["speculating"] is True
    assert report["rows"] == 650 and report["rows_with_stats"] == 600 and report["rows_without_stats"] == 50
    for domain, p in P.items():
        g = report["by"]["domain"][domain]
        truth = spec_drafter.true_acceptance_length(p, K)
        assert g["ci_low"] <= truth <= g["ci_high"], (domain, g, truth)
        assert g["per_position"][0] == pytest.approx(p, abs=0.03)
    assert report["by"]["domain"]["math"]["rows"] == 325  # 300 with stats + 25 without
    assert set(report["by"]["thinking"]) == {"on", "off"}
    assert sum(g["rows"] for g in report["by"]["length"].values()) == 650
    # The hardest prompts are the low-acceptance domain's, lowest first, each with enough steps.
    hardest = report["hardest"]
    assert hardest and all(e["domain"] == "chat" for e in hardest)
    assert [e["acceptance_length"] for e in hardest] == sorted(e["acceptance_length"] for e in hardest)
    assert all(e["verify_steps"] >= report["hardest_min_steps"] for e in hardest)
    md = markdown(report)
    assert "## speculative decoding acceptance" in md and "### by domain" in md and "| math |" in md


def test_rows_without_labels_read_unknown_domain_and_the_runs_thinking_mode() -> None:
    tally = AcceptanceTally(thinking_default=False)
    tally.add(_part(0, 40, labels=False))
    report = tally.report()
    assert set(report["by"]["domain"]) == {"unknown"} and set(report["by"]["thinking"]) == {"off"}


def test_nothing_shown_when_no_row_has_statistics() -> None:
    tally = AcceptanceTally(thinking_default=True)
    tally.add(_part(0, 30, with_stats=False))
    report = tally.report()
    assert report["speculating"] is False and report["rows"] == 30 and "by" not in report
    assert "not speculating" in markdown(report)


def _samples_part(n_prompts: int, samples: int) -> pa.Table:
    """n_prompts prompts with `samples` identical rows each (a prompt's samples, at their extreme)."""
    rows = []
    for i in range(n_prompts):
        d = spec_drafter.draw(_Cfg, [{"role": "user", "content": f"math question {i}"}], 100 + (i * 53) % 900, i)
        for s in range(samples):
            rows.append({"id": f"p{i}", "sample": s, "server": "s1", "completion_tokens": 100, "finish_reason": "stop",
                         "spec_verify_steps": d.verify_steps, "spec_accepted_tokens": d.accepted,
                         "spec_draft_tokens": d.proposed, "spec_accept_histogram": d.histogram()})
    return pa.Table.from_pylist([{c: r.get(c) for c in PART_SCHEMA.names} for r in rows], schema=PART_SCHEMA)


def test_samples_of_one_prompt_are_resampled_together() -> None:
    """Four samples of a prompt are not four independent rows: the interval over 4 copies of each row
    is the interval over one (issue 37: it was half as wide)."""
    reports = []
    for samples in (1, 4):
        tally = AcceptanceTally()
        tally.add(_samples_part(80, samples))
        reports.append(tally.report())
    one, four = reports
    assert (four["ci_low"], four["ci_high"]) == pytest.approx((one["ci_low"], one["ci_high"]))
    assert four["rows_with_stats"] == 4 * one["rows_with_stats"] and four["prompts"] == one["prompts"] == 80
    assert four["ci_method"] == "expanded percentile bootstrap"


def test_small_groups_print_no_interval_and_say_why() -> None:
    tally = AcceptanceTally()
    tally.add(_part(0, 60))  # 60 prompts, 9 of them under 512 tokens
    report = tally.report()
    small = report["by"]["length"]["<512"]
    assert small["ci_low"] is None, f"an interval over {small['rows_with_stats']} rows"
    assert small["prompts"] == 9 and "no interval: 9 prompt(s), fewer than 10" in small["ci_note"]
    md = markdown(report)
    assert "| prompts |" in md and "no interval:" in md and "(expanded percentile bootstrap)" in md
    assert "BCa" not in md
