"""Parsing each engine's per-request speculative statistics (serving/specwire.py).

The bodies are written field by field from the engines' sources (SGLang wheels 0.5.10, 0.5.11,
0.5.13, 0.5.19, 0.5.21: tokenizer_manager._calculate_spec_decoding_metrics, openai/utils.py
spec_tokens_details_from_meta_info, protocol.py SpecTokensDetails; vLLM 0.32:
v1/metrics/stats.py RequestSpecDecodeMetrics.to_dict), not from our simulator.
"""

from __future__ import annotations

import pytest

from dflash_pipeline.serving.sglang import build_chat_body, parse_chat_response
from dflash_pipeline.serving.specstats import SpecStats
from dflash_pipeline.serving.specwire import (
    SOURCE_SGLANG_META,
    SOURCE_SGLANG_SGLEXT,
    SOURCE_VLLM,
    confirm_source,
    parse_version,
    request_fields,
    sglang_avg_accept_length,
    sglang_spec_config,
    spec_stats_of,
    vllm_spec_config,
    vllm_spec_counters,
)
from dflash_pipeline.config import Sampling


def _chat(choice_extra: dict | None = None, **top) -> dict:
    choice = {"index": 0, "message": {"role": "assistant", "content": "4", "reasoning_content": "r"},
              "finish_reason": "stop", "matched_stop": 151645, **(choice_extra or {})}
    return {"id": "x", "object": "chat.completion", "model": "m", "choices": [choice],
            "usage": {"prompt_tokens": 10, "completion_tokens": 40, "total_tokens": 50}, **top}


# meta_info as each SGLang release writes it (12 verify steps, draft tokens arg 4 -> 3 per step).
META_0_5_10 = {"id": "r", "spec_accept_rate": 19 / 36, "spec_accept_length": 40 / 12,
               "spec_accept_token_num": 19, "spec_draft_token_num": 36, "spec_verify_ct": 12,
               "spec_accept_histogram": [4, 1, 3, 4]}
META_0_5_11 = {"id": "r", "spec_accept_rate": 19 / 36, "spec_accept_length": 40 / 12,
               "spec_accepted_drafts": 19, "spec_proposed_drafts": 36, "spec_verify_ct": 12,
               "spec_accept_histogram": [4, 1, 3, 4]}
META_0_5_13 = {"id": "r", "spec_accept_rate": 19 / 36, "spec_accept_length": 40 / 12,
               "spec_num_correct_drafts": 19, "spec_num_proposed_drafts": 36, "spec_verify_ct": 12,
               "spec_accepted_drafts": 19, "spec_proposed_drafts": 36,
               "spec_correct_drafts_histogram": [4, 1, 3, 4], "spec_accept_histogram": [4, 1, 3, 4]}
META_0_5_21 = {"id": "r", "spec_accept_rate": 19 / 36, "spec_accept_length": 40 / 12,
               "spec_num_correct_drafts": 19, "spec_num_proposed_drafts": 36, "spec_verify_ct": 12,
               "spec_correct_drafts_histogram": [4, 1, 3, 4]}
EXPECTED = SpecStats(12, 19, 36, (4, 1, 3, 4))


@pytest.mark.parametrize("meta", [META_0_5_10, META_0_5_11, META_0_5_13, META_0_5_21],
                         ids=["0.5.10", "0.5.11", "0.5.13", "0.5.21"])
def test_sglang_meta_info_every_version(meta):
    body = _chat({"meta_info": meta})
    assert spec_stats_of(body) == EXPECTED
    assert parse_chat_response(body).spec == EXPECTED
    assert EXPECTED.acceptance_length == pytest.approx(1 + 19 / 12)


def test_sglang_sglext_one_object_for_n1_and_list_for_n2():
    details = {"spec_accept_rate": 19 / 36, "spec_accept_length": 40 / 12, "spec_cap_length": 0.0,
               "spec_block_accept_length": 0.0, "spec_num_correct_drafts": 19,
               "spec_num_proposed_drafts": 36, "spec_verify_ct": 12,
               "spec_correct_drafts_histogram": [4, 1, 3, 4], "spec_cap_lens_histogram": []}
    assert spec_stats_of(_chat(sglext={"spec_tokens_details": details})) == EXPECTED
    two = _chat(sglext={"spec_tokens_details": [details, {**details, "spec_verify_ct": 5,
                                                          "spec_num_correct_drafts": 2}]})
    two["choices"].append({**two["choices"][0], "index": 1})
    assert spec_stats_of(two, 1) == SpecStats(5, 2, 36, (4, 1, 3, 4))


def test_no_verify_step_or_no_figures_is_none_not_zero():
    # SGLang leaves the fields out without a verify step; sglext then reports zeros.
    assert spec_stats_of(_chat({"meta_info": {"id": "r", "prompt_tokens": 3}})) is None
    zeros = {"spec_accept_rate": 0.0, "spec_accept_length": 0.0, "spec_num_correct_drafts": 0,
             "spec_num_proposed_drafts": 0, "spec_verify_ct": 0, "spec_correct_drafts_histogram": []}
    assert spec_stats_of(_chat(sglext={"spec_tokens_details": zeros})) is None
    assert spec_stats_of(_chat()) is None
    assert parse_chat_response(_chat()).spec is None
    assert spec_stats_of(_chat(metrics=None)) is None


def test_vllm_metrics_speculative_decoding():
    spec = {"mean_acceptance_length": 1 + 119 / 75, "draft_acceptance_rate": 119 / 225,
            "acceptance_histogram": [22, 18, 4, 31], "num_spec_steps": 75,
            "num_accepted_draft_tokens": 119, "num_draft_tokens": 225, "num_spec_tokens": 3}
    body = _chat(metrics={"time_to_first_token_ms": None, "speculative_decoding": spec})
    got = parse_chat_response(body).spec
    assert got == SpecStats(75, 119, 225, (22, 18, 4, 31))
    assert got.acceptance_length == pytest.approx(spec["mean_acceptance_length"])
    # A request that never verified: vLLM says 0 steps (stored as said; no acceptance length).
    none = {**spec, "acceptance_histogram": [0, 0, 0, 0], "num_spec_steps": 0, "num_accepted_draft_tokens": 0,
            "num_draft_tokens": 0, "mean_acceptance_length": 1.0}
    zero = spec_stats_of(_chat(metrics={"speculative_decoding": none}))
    assert zero == SpecStats(0, 0, 0, (0, 0, 0, 0)) and zero.acceptance_length is None


def test_version_picks_how_to_ask():
    base = {"speculative_algorithm": "EAGLE3", "speculative_num_draft_tokens": 4, "speculative_num_steps": 3,
            "speculative_eagle_topk": 1}
    assert sglang_spec_config({**base, "version": "0.5.21"}).stats_source == SOURCE_SGLANG_SGLEXT
    assert sglang_spec_config({**base, "version": "0.5.19"}).stats_source == SOURCE_SGLANG_SGLEXT
    assert sglang_spec_config({**base, "version": "0.5.18"}).stats_source == SOURCE_SGLANG_META
    assert sglang_spec_config({**base, "version": "0.5.13"}).stats_source == SOURCE_SGLANG_META
    assert sglang_spec_config({**base, "version": "0.5.12"}).stats_source is None
    cfg = sglang_spec_config({**base, "version": "0.5.10"})
    assert cfg is not None and cfg.num_draft_tokens == 3 and cfg.algorithm == "EAGLE3"
    assert sglang_spec_config({"speculative_algorithm": None, "version": "0.5.21"}) is None
    assert request_fields(sglang_spec_config({**base, "version": "0.5.21"}).to_manifest()) == {
        "return_spec_tokens_details": True}
    assert request_fields(sglang_spec_config({**base, "version": "0.5.14"}).to_manifest()) == {
        "return_meta_info": True}
    assert request_fields(None) == {}
    assert parse_version("v0.5.13.post1") == (0, 5, 13)
    assert sglang_avg_accept_length({"internal_states": [{"avg_spec_accept_length": 2.5}]}) == 2.5


def test_chat_body_carries_the_ask():
    body = build_chat_body([{"role": "user", "content": "x"}], "m", Sampling(), "id1", "sglang",
                           spec_fields={"return_meta_info": True})
    assert body["return_meta_info"] is True
    assert "return_meta_info" not in build_chat_body([{"role": "user", "content": "x"}], "m", Sampling(), "id1")


METRICS = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 75.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7e9
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 225.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 119.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 53.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 35.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 31.0
"""


def test_vllm_counters_and_config():
    c = vllm_spec_counters(METRICS)
    assert (c.drafts, c.draft_tokens, c.accepted_tokens, c.accepted_per_position) == (75, 225, 119, (53, 35, 31))
    assert c.acceptance_length == pytest.approx(1 + 119 / 75)
    assert c.minus(c).drafts == 0
    assert vllm_spec_counters('vllm:num_requests_running{engine="0"} 1.0\n') is None
    cfg = vllm_spec_config(METRICS, "0.32.0")
    assert cfg.num_draft_tokens == 3 and cfg.stats_source is None
    assert confirm_source(cfg.to_manifest(), True)["stats_source"] == SOURCE_VLLM
    assert confirm_source(cfg.to_manifest(), False)["stats_source"] is None
    assert vllm_spec_config("", "0.32.0") is None


def test_eagle_tree_accepts_at_most_its_depth_and_the_adaptive_flag_is_kept():
    """Issue 37 item 8: an EAGLE tree (topk > 1) verifies speculative_num_draft_tokens nodes but accepts at
    most speculative_num_steps drafts per step (one path of the tree); --speculative-adaptive is kept."""
    tree = {"speculative_algorithm": "EAGLE3", "speculative_num_draft_tokens": 64, "speculative_num_steps": 5,
            "speculative_eagle_topk": 8, "version": "0.5.23"}
    cfg = sglang_spec_config(tree)
    assert cfg is not None and cfg.num_draft_tokens == 5
    assert cfg.engine_args["speculative_num_draft_tokens"] == 64 and cfg.engine_args["speculative_eagle_topk"] == 8
    chain = sglang_spec_config({**tree, "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 6})
    assert chain is not None and chain.num_draft_tokens == 5
    adaptive = sglang_spec_config({**tree, "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 6,
                                   "speculative_adaptive": True, "speculative_adaptive_config": None})
    assert adaptive is not None and adaptive.engine_args["speculative_adaptive"] is True
    assert adaptive.to_manifest()["adaptive"] is True and chain.to_manifest()["adaptive"] is False
    assert "speculative_adaptive_config" in adaptive.engine_args
