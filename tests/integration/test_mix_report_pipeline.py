"""The mix report end to end: a labelled prompt set generated on simulated servers, stored on a real S3
protocol server (moto over HTTP), validated with a target mix, then tokenized.

Validation's report.json / report.md carry the mix before filters with the target side by side (every
count checked against the completion parts themselves), the mix plot is written next to the other plots,
the progress page (the plugin's S3 reading, `ui_app.collect`, and its HTML) shows the mix after
validation, and tokenize's report carries the mix of what it kept next to validation's.
"""

from __future__ import annotations

import io
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from dflash_pipeline.config import RunConfig, TokenizeConfig
from dflash_pipeline.dataset.layout import DatasetLayout
from dflash_pipeline.dataset.store import Store
from dflash_pipeline.dev.faultlab import run_generation
from dflash_pipeline.dev.sim.tokenizer import build_sim_tokenizer
from dflash_pipeline.steps.tokenize import plan, run_assignment, write_report
from dflash_pipeline.steps.validate import Thresholds, run_validation

N = 120
DOMAINS = ("math", "math", "math", "math", "math", "code", "code", "code", "chat", "chat")  # 50/30/20 %
TARGET = {"domain": {"math": 0.3, "code": 0.3, "chat": 0.4}, "thinking": {"true": 0.5, "false": 0.5}}


def _prompts() -> bytes:
    rows = []
    for i in range(N):
        row: dict[str, Any] = {"id": f"m{i}", "domain": DOMAINS[i % len(DOMAINS)], "source": "web" if i % 3 else "books"}
        if i % 10 == 9:  # a two-turn conversation
            row["messages"] = [{"role": "user", "content": f"first question {i}"},
                               {"role": "assistant", "content": "an old answer"},
                               {"role": "user", "content": f"and the follow-up {i}?"}]
        else:
            row["prompt"] = f"question number {i}: " + "explain it " * (1 + i % 7)
        rows.append(row)
    return "\n".join(json.dumps(r) for r in rows).encode()


@pytest.fixture
def validated(s3_client: Any, bucket: str, sim_fleet: Any, tmp_path: Path) -> dict[str, Any]:
    s3_client.put_object(Bucket=bucket, Key="mix/prompts.jsonl", Body=_prompts())
    # The servers "serve" the sim tokenizer, so tokenize can check its re-encoded turns against their counts.
    tokenizer = build_sim_tokenizer(tmp_path / "tokenizer")
    fleet = sim_fleet(2, token_time_s=0.0003, length_scale=0.05, tokenizer_dir=str(tokenizer))
    cfg = RunConfig.from_params({"prompts_uri": f"s3://{bucket}/mix/prompts.jsonl", "output_uri": f"s3://{bucket}/mix/ds",
                                 "servers": fleet.urls, "save_every": 20, "max_tokens": 4096, "target_mix": TARGET})
    outcomes = run_generation(s3_client, cfg, fleet.urls, "mix-run1")
    assert not [o for o in outcomes if isinstance(o, BaseException)], outcomes
    report = run_validation(s3_client, cfg.output_uri, thresholds=Thresholds(max_truncation_rate=1.0),
                            tokenizer=str(tokenizer), target_mix=cfg.target_mix)
    layout = DatasetLayout.from_uri(cfg.output_uri)
    parts = [pd.read_parquet(io.BytesIO(s3_client.get_object(Bucket=bucket, Key=o["Key"])["Body"].read()))
             for o in s3_client.list_objects_v2(Bucket=bucket, Prefix=layout.completions_prefix)["Contents"]]
    return {"report": report, "layout": layout, "parts": pd.concat(parts), "cfg": cfg, "tokenizer": str(tokenizer)}


def _rows(mix: dict[str, Any], dim: str) -> dict[str, dict[str, Any]]:
    return {r["label"]: r for r in mix["dimensions"][dim]["rows"]}


def test_validation_writes_the_mix_with_the_target_side_by_side(validated: dict[str, Any], s3_client: Any,
                                                                 bucket: str) -> None:
    report, layout, parts = validated["report"], validated["layout"], validated["parts"]
    ok = parts[parts["error_class"].isna()]
    assert report["status"] == "passed" and len(ok) == N
    mix = report["mix"]
    assert mix["completions"] == N and mix["target"] == TARGET
    domain = _rows(mix, "domain")
    counts = Counter(ok["domain"])
    assert {k: v["count"] for k, v in domain.items()} == dict(counts) == {"math": 60, "code": 36, "chat": 24}
    assert (domain["math"]["share"], domain["math"]["target"], domain["math"]["gap"]) == (0.5, 0.3, 0.2)
    assert (domain["chat"]["share"], domain["chat"]["target"], domain["chat"]["gap"]) == (0.2, 0.4, -0.2)
    assert mix["dimensions"]["domain"]["max_abs_gap"] == 0.2
    thinking = _rows(mix, "thinking")  # one run with thinking on: all "true", against a 50/50 target
    assert (thinking["true"]["count"], thinking["true"]["gap"]) == (N, 0.5)
    assert (thinking["false"]["count"], thinking["false"]["gap"]) == (0, -0.5)
    assert {k: v["count"] for k, v in _rows(mix, "source").items()} == dict(Counter(ok["source"]))
    assert {k: v["count"] for k, v in _rows(mix, "turns").items()} == {"1": 108, "2": 12}
    lengths = Counter("0-255" if n < 256 else "256-1023" if n < 1024 else "1024-4095" if n < 4096 else "4096-16383"
                      for n in ok["completion_tokens"])
    assert {k: v["count"] for k, v in _rows(mix, "completion_length").items()} == dict(lengths)
    assert "max_abs_gap" not in mix["dimensions"]["source"]  # no target there
    # the answers' languages as the quality tally identified them (once, at validation)
    languages = {k: v["count"] for k, v in _rows(mix, "language").items()}
    assert languages == report["quality"]["languages"] and sum(languages.values()) == N

    md = s3_client.get_object(Bucket=bucket, Key=layout.report_md_key)["Body"].read().decode()
    assert " · thinking on · " in md.splitlines()[2]
    section = md[md.index("## mix (before filters)"):]
    assert "### domain (largest gap 20.0 pp)" in section
    assert "| label | completions | share | target | gap |" in section
    assert "| math | 60 | 50.0% | 30.0% | +20.0 pp |" in section
    assert "| chat | 24 | 20.0% | 40.0% | -20.0 pp |" in section
    assert "| false | 0 | 0.0% | 50.0% | -50.0 pp |" in section
    mix_key = f"{layout.root}/report-mix.png"
    assert mix_key in report["files"]["plots"] and f"Plot: `{mix_key}`" in section
    assert s3_client.get_object(Bucket=bucket, Key=mix_key)["Body"].read()[:8] == b"\x89PNG\r\n\x1a\n"


def test_progress_page_shows_the_mix_after_validation(validated: dict[str, Any], s3_client: Any, bucket: str) -> None:
    from dflash_pipeline.monitor import ui
    from dflash_pipeline.monitor.ui_app import collect

    layout = validated["layout"]
    data = collect(Store(s3_client, bucket), layout, "mix-run1", run_started_at=None, task_states={}, now=0.0)
    assert "report-mix.png" in data["plots"]
    view = {"dag_id": "dflash_generate", "run_id": "mix-run1", "run_state": "success", "output_uri": layout.uri,
            "progress": data["progress"], "report": data["report"],
            "plot_urls": [(n, f"/dflash/runs/d/r/plots/{n}") for n in data["plots"]]}
    html = ui.run_page(view)
    assert 'src="/dflash/runs/d/r/plots/report-mix.png"' in html
    section = html[html.index('<section id="mix">'):]
    section = section[:section.index("</section>")]
    assert 'data-dim="domain"' in section and 'data-dim="thinking"' in section
    assert '<td class="">math</td><td class="n">60</td><td class="n">50.0 %</td><td class="n">30.0 %</td>' \
           '<td class="n">+20.0 pp</td>' in section


def test_tokenize_reports_the_mix_it_kept_next_to_validation(validated: dict[str, Any], s3_client: Any,
                                                              bucket: str) -> None:
    layout = validated["layout"]
    cfg = TokenizeConfig.from_params({"tokenizer": validated["tokenizer"], "workers": 1, "min_loss_tokens": 40,
                                      "min_kept_share": 0.0, "target_mix": {"domain": TARGET["domain"]}})
    planned = plan(s3_client, [layout.uri], cfg)
    for a in planned["assignments"]:
        run_assignment(s3_client, a)
    report = write_report(s3_client, planned["datasets"][0], cfg.min_kept_share, target_mix=cfg.target_mix)
    mix = report["mix"]
    assert mix["basis"] == "completions kept by tokenize" and mix["before_completions"] == N
    assert mix["parts_counted"] == report["parts_tokenized"] > 0
    # min_loss_tokens 40 (and the quality filters) drop rows: the mix counts the completions that kept one
    assert 0 < mix["completions"] < N and report["rows_dropped"] > 0
    domain = _rows(mix, "domain")
    assert sum(r["count"] for r in domain.values()) == mix["completions"]
    assert {k: r["before_count"] for k, r in domain.items()} == {"math": 60, "code": 36, "chat": 24}
    for r in domain.values():
        assert r["gap"] == pytest.approx(r["share"] - r["target"], abs=1e-4)
    md = s3_client.get_object(Bucket=bucket, Key=layout.tokenized_report_md_key)["Body"].read().decode()
    assert "## mix after filters" in md and "| label | before | completions | share before | share | target | gap |" in md
    assert f"| math | 60 | {domain['math']['count']} | 50.0% |" in md
    assert "(tokenize identifies no language unless drop_quality has 'language'" in md  # said, not shown as data


def test_tokenize_without_its_own_target_takes_the_one_generate_was_given(validated: dict[str, Any], s3_client: Any,
                                                                          bucket: str) -> None:
    """Issue 41: an asset-triggered tokenize run has no target_mix of its own; the dataset's (given to
    dflash_generate, in validation's report) is the one its report compares with, and it says so."""
    layout = validated["layout"]
    cfg = TokenizeConfig.from_params({"tokenizer": validated["tokenizer"], "workers": 1, "min_kept_share": 0.0})
    planned = plan(s3_client, [layout.uri], cfg)
    for a in planned["assignments"]:
        run_assignment(s3_client, a)
    report = write_report(s3_client, planned["datasets"][0], cfg.min_kept_share, target_mix=cfg.target_mix)
    assert report["mix"]["target"] == TARGET
    assert report["mix"]["target_from"] == "dflash_generate's target_mix (validation report)"
