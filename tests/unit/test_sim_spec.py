"""The simulator's speculative dialects over real HTTP (dev/sim/spec_*.py), and its drafter's truth."""

from __future__ import annotations

import pytest
import requests

from dflash_pipeline.dev.sim import SimServer
from dflash_pipeline.dev.sim import spec_drafter
from dflash_pipeline.serving.specstats import token_weighted
from dflash_pipeline.serving.specwire import (
    request_fields,
    sglang_avg_accept_length,
    sglang_spec_config,
    spec_stats_of,
    vllm_spec_config,
    vllm_spec_counters,
)

FAST = dict(token_time_s=0.0002, length_scale=0.05)
ASK_ALL = {"return_meta_info": True, "return_spec_tokens_details": True}


def _ask(server: SimServer, content: str = "hello", **extra) -> dict:
    body = {"model": server.config.served_model_name, "messages": [{"role": "user", "content": content}],
            "max_tokens": 300, **extra}
    r = requests.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


# What each release's meta_info has (tokenizer_manager._calculate_spec_decoding_metrics).
FIELDS = {
    "0.5.10": {"spec_accept_token_num", "spec_draft_token_num", "spec_accept_histogram"},
    "0.5.11": {"spec_accepted_drafts", "spec_proposed_drafts", "spec_accept_histogram"},
    "0.5.13": {"spec_num_correct_drafts", "spec_num_proposed_drafts", "spec_correct_drafts_histogram",
               "spec_accepted_drafts", "spec_proposed_drafts", "spec_accept_histogram"},
    "0.5.19": {"spec_num_correct_drafts", "spec_num_proposed_drafts", "spec_correct_drafts_histogram",
               "spec_accepted_drafts", "spec_proposed_drafts", "spec_accept_histogram"},
    "0.5.21": {"spec_num_correct_drafts", "spec_num_proposed_drafts", "spec_correct_drafts_histogram"},
}
COMMON = {"spec_accept_rate", "spec_accept_length", "spec_verify_ct"}


@pytest.mark.parametrize("version", sorted(FIELDS))
def test_sglang_fields_per_version(version):
    from dflash_pipeline.dev.sim.spec_drafter import Drafted
    from dflash_pipeline.dev.sim.spec_sglang import meta_fields

    got = meta_fields(version, Drafted(3, (0, 3, 1, 3)), 12)
    assert set(got) == FIELDS[version] | COMMON
    assert got["spec_verify_ct"] == 4 and got["spec_accept_length"] == 3.0
    hist_key = "spec_accept_histogram" if version in ("0.5.10", "0.5.11") else "spec_correct_drafts_histogram"
    assert got[hist_key] == [1, 1, 0, 2]


@pytest.mark.parametrize("version,where", [("0.5.10", None), ("0.5.12", None), ("0.5.13", "meta"),
                                           ("0.5.19", "sglext"), ("0.5.21", "sglext")])
def test_sglang_chat_answers_as_the_version_does(version, where):
    with SimServer(**FAST, spec_algorithm="EAGLE3", spec_num_draft_tokens=3, spec_sglang_version=version) as s:
        info = requests.get(s.url + "/get_server_info", timeout=10).json()
        assert info["version"] == version and info["speculative_num_draft_tokens"] == 4
        cfg = sglang_spec_config(info)
        asked = _ask(s, **request_fields(cfg.to_manifest()))
        everything = _ask(s, **ASK_ALL)
        assert ("meta_info" in everything["choices"][0]) == (version >= "0.5.13")
        assert ("sglext" in everything) == (version >= "0.5.19")
        stats = spec_stats_of(asked)
        if where is None:
            assert stats is None and cfg.stats_source is None
        else:
            assert stats is not None and stats.verify_steps > 0
            assert stats.draft_tokens == 3 * stats.verify_steps
            assert sum(stats.histogram) == stats.verify_steps
            assert sum(i * n for i, n in enumerate(stats.histogram)) == stats.accepted_tokens
            assert spec_stats_of(everything) == stats  # the same request, the same figures
        avg = sglang_avg_accept_length(requests.get(s.url + "/get_server_info", timeout=10).json())
        assert avg is not None and avg > 1.0


def test_non_speculating_servers_report_nothing():
    with SimServer(**FAST) as s:
        info = requests.get(s.url + "/get_server_info", timeout=10).json()
        assert sglang_spec_config(info) is None and sglang_avg_accept_length(info) is None
        body = _ask(s, **ASK_ALL)
        assert "sglext" not in body and spec_stats_of(body) is None
    with SimServer(**FAST, engine="vllm") as s:
        metrics = requests.get(s.url + "/metrics", timeout=10).text
        assert "spec_decode" not in metrics and vllm_spec_config(metrics, "0.32.0") is None
        body = _ask(s)
        assert body["metrics"] is None and spec_stats_of(body) is None


def test_vllm_per_request_figures_sum_to_the_metrics_delta():
    with SimServer(**FAST, engine="vllm", spec_algorithm="ngram", spec_num_draft_tokens=4) as s:
        before = vllm_spec_counters(requests.get(s.url + "/metrics", timeout=10).text)
        assert before is not None and before.drafts == 0 and len(before.accepted_per_position) == 4
        got = [spec_stats_of(_ask(s, f"question {i}")) for i in range(6)]
        delta = vllm_spec_counters(requests.get(s.url + "/metrics", timeout=10).text).minus(before)
        assert delta.drafts == sum(g.verify_steps for g in got)
        assert delta.accepted_tokens == sum(g.accepted_tokens for g in got)
        assert delta.draft_tokens == sum(g.draft_tokens for g in got)
        hist = [sum(g.histogram[j] for g in got) for j in range(5)]
        assert list(delta.accepted_per_position) == [sum(hist[i + 1:]) for i in range(4)]
    with SimServer(**FAST, engine="vllm", spec_algorithm="ngram", spec_per_request_metrics="none") as s:
        assert _ask(s)["metrics"] is None  # the server flag off: no figures, counters still there
        assert vllm_spec_counters(requests.get(s.url + "/metrics", timeout=10).text).drafts > 0
    with SimServer(**FAST, engine="vllm", spec_algorithm="ngram", spec_per_request_metrics="detailed") as s:
        spec = _ask(s)["metrics"]["speculative_decoding"]
        assert len(spec["per_step_accepted"]) == spec["num_spec_steps"]


def test_drafter_truth_per_domain_and_determinism():
    cfg = type("C", (), dict(seed=1, spec_num_draft_tokens=4, spec_accept_p=0.5,
                             spec_accept_by_keyword="math=0.9, chat=0.2"))()
    for content, p in (("a math problem", 0.9), ("CHAT please", 0.2), ("other", 0.5)):
        draws = [spec_drafter.draw(cfg, [{"role": "user", "content": f"{content} {i}"}], 400, i) for i in range(300)]
        measured = token_weighted([d.verify_steps for d in draws], [d.accepted for d in draws])
        truth = spec_drafter.true_acceptance_length(p, 4)
        assert measured == pytest.approx(truth, abs=0.05), (content, measured, truth)
    one = spec_drafter.draw(cfg, [{"role": "user", "content": "x"}], 100, 7)
    assert one == spec_drafter.draw(cfg, [{"role": "user", "content": "x"}], 100, 7)
    assert one.verify_steps > 0 and sum(a + 1 for a in one.per_step) >= 99
    assert spec_drafter.draw(cfg, [{"role": "user", "content": "x"}], 1, 7).verify_steps == 0
    with pytest.raises(ValueError):
        spec_drafter.parse_keyword_map("math")


def test_sglang_metrics_only_with_enable_metrics_and_verify_calls_sum_the_answers():
    with SimServer(**FAST, spec_algorithm="EAGLE3") as s:
        assert requests.get(s.url + "/metrics", timeout=10).status_code == 404
    with SimServer(**FAST, spec_algorithm="EAGLE3", enable_metrics=True) as s:
        text = requests.get(s.url + "/metrics", timeout=10).text
        assert "sglang:spec_verify_calls_total{" not in text  # no request verified yet
        got = [spec_stats_of(_ask(s, f"q {i}", return_spec_tokens_details=True)) for i in range(4)]
        line = [x for x in requests.get(s.url + "/metrics", timeout=10).text.splitlines()
                if x.startswith("sglang:spec_verify_calls_total{")]
        assert float(line[0].rsplit(" ", 1)[1]) == sum(g.verify_steps for g in got)
        assert requests.get(s.url + "/get_server_info", timeout=10).json()["enable_metrics"] is True
