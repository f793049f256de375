"""Speculative decoding on the wire: how a server tells us it speculates, how we ask it for each
request's statistics, and how an answer's statistics become one `SpecStats` (serving/specstats.py
has the definition and the arithmetic).

Why one module: SGLang renamed its per-request fields three times and moved them between two
places in the chat answer, and vLLM reports them in a third shape; everything engine- and
version-specific about speculative decoding is read here, so rows, preflight and the simulator's
tests agree on one table.

SGLang (read from the wheels of 0.5.10, 0.5.11, 0.5.13, 0.5.19 and 0.5.21):
- `managers/tokenizer_manager.py` `_calculate_spec_decoding_metrics` fills a request's `meta_info`
  only when it had at least one verify step (`spec_verify_ct > 0`) and the server drafts
  (`speculative_num_draft_tokens > 1`):
  * 0.5.10: `spec_verify_ct`, `spec_accept_token_num` (accepted drafts), `spec_draft_token_num`
    (= verify_ct x (speculative_num_draft_tokens - 1): an estimate, not a count),
    `spec_accept_histogram`, `spec_accept_rate`, `spec_accept_length` (= completion_tokens /
    verify_ct: counts the prefill token, so it is not ours);
  * 0.5.11: `spec_accepted_drafts`, `spec_proposed_drafts` (same meaning);
  * 0.5.13 and 0.5.19: `spec_num_correct_drafts`, `spec_num_proposed_drafts`,
    `spec_correct_drafts_histogram`, the 0.5.11 names and `spec_accept_histogram` kept as aliases;
  * 0.5.21: the aliases are gone.
- The histogram (`managers/schedule_batch.py` `update_spec_correct_drafts_histogram`, called from
  `speculative/eagle_info.py` and `ngram_info.py` per verify step): index k counts the verify
  steps that accepted exactly k draft tokens; the list grows to the largest k seen plus one. That
  is our histogram (specstats.py), as is.
- Chat answers: `usage` never carries them. 0.5.13+ (`entrypoints/openai/protocol.py`
  `ChatCompletionRequest.return_meta_info`, non-streaming only; `serving_chat.py` copies
  `ret_item["meta_info"]` into `choices[i].meta_info`). 0.5.19+ (`return_spec_tokens_details`;
  `openai/utils.py` `spec_tokens_details_from_meta_info`): top-level
  `sglext.spec_tokens_details`, one object when n == 1 and a list (one per choice with figures)
  when n > 1, with the canonical names only and zeros for what meta_info lacked; absent when no
  choice had figures. Older servers ignore both fields (pydantic drops unknown fields).
- `/get_server_info` (`/server_info` in 0.5.21) carries the server args flat
  (`speculative_algorithm`, `speculative_num_draft_tokens`, `speculative_num_steps`,
  `speculative_eagle_topk`; 0.5.21 declares them in a `Spec` namespace but `server_args.py` builds
  `ServerArgs` as one flat msgspec struct of every namespace's fields, and `resolved_dict()` dumps
  it flat), `version`, and `internal_states[0].avg_spec_accept_length`
  (`managers/scheduler.py`: accepted tokens including the bonus over forward passes since start).

vLLM 0.32 (read from the installed source, `vllm/v1/metrics/stats.py` `RequestSpecDecodeMetrics`,
`entrypoints/generate/base/protocol.py` `SpeculativeDecodingMetrics`,
`entrypoints/openai/chat_completion/serving.py`, `v1/spec_decode/metrics.py`):
- with the server flag `--per-request-spec-decode-metrics summary|detailed` (no request field),
  n == 1 answers carry `metrics.speculative_decoding`: `num_spec_steps`,
  `num_accepted_draft_tokens` (= sum j x histogram[j]), `num_draft_tokens` (counted, after the
  grammar adjustment), `acceptance_histogram` (dense, length num_spec_tokens + 1, index j = verify
  steps that accepted exactly j drafts, the bonus token excluded: our histogram as is),
  `num_spec_tokens`, `mean_acceptance_length` (1 + accepted / steps: ours). Present with
  `num_spec_steps` 0 for a request that never verified (then we store 0 steps: the server said so).
  Without the flag `metrics` is null.
- `/metrics` counters (labels `model_name`, `engine`): `vllm:spec_decode_num_drafts_total` (verify
  steps), `vllm:spec_decode_num_draft_tokens_total`, `vllm:spec_decode_num_accepted_tokens_total`,
  `vllm:spec_decode_num_accepted_tokens_per_pos_total{position="0".."k-1"}` (0-based): a
  speculating server publishes them (one position per `num_speculative_tokens`); others do not.
  The speculative method itself is not published over HTTP.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dflash_pipeline.serving.specstats import SpecStats

logger = logging.getLogger(__name__)

SOURCE_SGLANG_SGLEXT = "sglang.sglext.spec_tokens_details"
SOURCE_SGLANG_META = "sglang.meta_info"
SOURCE_VLLM = "vllm.metrics.speculative_decoding"

# SGLang releases from which a chat request can ask for per-request figures (see module docstring).
SGLANG_SGLEXT_SINCE = (0, 5, 19)
SGLANG_META_INFO_SINCE = (0, 5, 13)

# SGLang's per-request field names, newest first: (accepted drafts, proposed drafts, histogram).
SGLANG_FIELDS: tuple[tuple[str, str, str | None], ...] = (
    ("spec_num_correct_drafts", "spec_num_proposed_drafts", "spec_correct_drafts_histogram"),  # 0.5.12+
    ("spec_accepted_drafts", "spec_proposed_drafts", "spec_accept_histogram"),  # 0.5.11 (alias to 0.5.19)
    ("spec_accept_token_num", "spec_draft_token_num", "spec_accept_histogram"),  # <= 0.5.10
)


def parse_version(text: Any) -> tuple[int, ...] | None:
    """(major, minor, patch) of "0.5.19", "v0.5.13.post1", "0.5.23-sim"; None when unreadable."""
    m = re.match(r"^v?(\d+)\.(\d+)(?:\.(\d+))?", str(text or "").strip())
    if not m:
        return None
    return tuple(int(x) for x in m.groups(default="0"))


@dataclass(frozen=True)
class SpecConfig:
    """A speculating server's configuration, as recorded in the manifest (`speculative`).

    `num_draft_tokens` is the most draft tokens one verify step can accept (the bonus token
    excluded): SGLang's `speculative_num_draft_tokens - 1` (its figure counts the target's own
    token; for a DFlash block of 16 it is 15), vLLM's `num_speculative_tokens`. `engine_args` keeps
    the server's own figures as it gave them. `stats_source` names where each answer carries its
    figures, None when the server speculates but gives no per-request figures."""

    algorithm: str | None
    num_draft_tokens: int | None
    engine: str
    engine_version: str | None
    stats_source: str | None
    engine_args: dict[str, Any] = field(default_factory=dict)
    # SGLang --speculative-adaptive (0.5.19+, EAGLE/EAGLE3 with topk 1): the draft depth changes at run
    # time between the config's candidate steps, 0 included (plain decode steps, which SGLang counts
    # in spec_verify_ct as steps that accepted nothing).
    adaptive: bool = False

    def to_manifest(self) -> dict[str, Any]:
        return {
            "algorithm": self.algorithm,
            "num_draft_tokens": self.num_draft_tokens,
            "adaptive": self.adaptive,
            "engine": self.engine,
            "engine_version": self.engine_version,
            "stats_source": self.stats_source,
            "engine_args": dict(self.engine_args),
        }


def request_fields(speculative: Mapping[str, Any] | None) -> dict[str, Any]:
    """The chat-request fields that make a server return each answer's figures (from the
    manifest's `speculative` entry): SGLang asks, vLLM needs nothing (a server flag)."""
    source = (speculative or {}).get("stats_source")
    if source == SOURCE_SGLANG_SGLEXT:
        return {"return_spec_tokens_details": True}
    if source == SOURCE_SGLANG_META:
        return {"return_meta_info": True}
    return {}


def _num(v: Any) -> int | None:
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def sglang_spec_config(info: Mapping[str, Any]) -> SpecConfig | None:
    """From an SGLang `/get_server_info` body: None when it does not speculate. How to ask for
    per-request figures follows its version (never guessed from anything else)."""
    args: Mapping[str, Any] = info
    if not info.get("speculative_algorithm") and isinstance(info.get("spec"), Mapping):
        args = info["spec"]  # a nested `spec` namespace, should a release publish it that way
    algorithm = args.get("speculative_algorithm")
    if not algorithm or str(algorithm).upper() == "NONE":
        return None
    version = info.get("version")
    v = parse_version(version)
    source = None
    if v is not None and v >= SGLANG_SGLEXT_SINCE:
        source = SOURCE_SGLANG_SGLEXT
    elif v is not None and v >= SGLANG_META_INFO_SINCE:
        source = SOURCE_SGLANG_META
    tokens = _num(args.get("speculative_num_draft_tokens"))
    steps, topk = _num(args.get("speculative_num_steps")), _num(args.get("speculative_eagle_topk"))
    engine_args = {k: args.get(k) for k in (
        "speculative_algorithm", "speculative_num_draft_tokens", "speculative_num_steps",
        "speculative_eagle_topk", "speculative_draft_model_path", "speculative_adaptive",
        "speculative_adaptive_config") if k in args}
    # An EAGLE tree (topk > 1) verifies speculative_num_draft_tokens nodes, but a step accepts one path
    # of the tree: at most speculative_num_steps drafts (its depth). A chain (topk 1), DFlash's block and
    # the others accept up to speculative_num_draft_tokens - 1 (the count includes the target's token).
    most = steps if topk is not None and topk > 1 and steps else (tokens - 1 if tokens else None)
    return SpecConfig(str(algorithm), most, "sglang", None if version is None else str(version), source, engine_args,
                      adaptive=bool(args.get("speculative_adaptive")))


VLLM_DRAFTS = "vllm:spec_decode_num_drafts"
VLLM_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
VLLM_ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
VLLM_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
SGLANG_VERIFY = "sglang:spec_verify_calls"
_COUNTERS = (VLLM_DRAFTS, VLLM_DRAFT_TOKENS, VLLM_ACCEPTED, SGLANG_VERIFY)


@dataclass(frozen=True)
class VllmSpecCounters:
    """vLLM's server-wide speculative counters at one moment (summed over engines)."""

    drafts: int
    draft_tokens: int
    accepted_tokens: int
    accepted_per_position: tuple[int, ...]

    def minus(self, before: VllmSpecCounters) -> VllmSpecCounters:
        n = len(self.accepted_per_position)
        prior = tuple(before.accepted_per_position) + (0,) * max(0, n - len(before.accepted_per_position))
        return VllmSpecCounters(self.drafts - before.drafts, self.draft_tokens - before.draft_tokens,
                                self.accepted_tokens - before.accepted_tokens,
                                tuple(a - b for a, b in zip(self.accepted_per_position, prior)))

    @property
    def acceptance_length(self) -> float | None:
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts > 0 else None


@dataclass(frozen=True)
class SglangSpecCounters:
    """SGLang's one speculative counter (`--enable-metrics`): verify steps, summed over ranks."""

    verify_steps: int


def spec_counters(metrics_text: str) -> VllmSpecCounters | SglangSpecCounters | None:
    """The speculative counters of a `/metrics` text (Prometheus exposition, read with
    prometheus_client's parser): vLLM's when it publishes `vllm:spec_decode_num_drafts`, else
    SGLang's verify calls, else None (the server does not speculate, or the text does not parse).
    Every reader of these counters (preflight, the eval's cross-check, the dev stack) calls this."""
    from prometheus_client.parser import text_string_to_metric_families

    sums: dict[str, float] = {}
    per_pos: dict[int, float] = {}
    try:
        for family in text_string_to_metric_families(metrics_text):
            for sample in family.samples:
                if sample.name.endswith(("_created", "_bucket", "_count", "_sum")):
                    continue
                name = sample.name[:-len("_total")] if sample.name.endswith("_total") else sample.name
                if name == VLLM_PER_POS:
                    if "position" in sample.labels:
                        pos = int(sample.labels["position"])
                        per_pos[pos] = per_pos.get(pos, 0.0) + sample.value
                elif name in _COUNTERS:
                    sums[name] = sums.get(name, 0.0) + sample.value
    except ValueError as exc:
        logger.warning("unparseable /metrics text: %s", exc)
        return None
    if VLLM_DRAFTS in sums:
        positions = tuple(int(per_pos.get(i, 0)) for i in range(max(per_pos) + 1)) if per_pos else ()
        return VllmSpecCounters(int(sums[VLLM_DRAFTS]), int(sums.get(VLLM_DRAFT_TOKENS, 0)),
                                int(sums.get(VLLM_ACCEPTED, 0)), positions)
    if SGLANG_VERIFY in sums:
        return SglangSpecCounters(int(sums[SGLANG_VERIFY]))
    return None


def vllm_spec_counters(metrics_text: str) -> VllmSpecCounters | None:
    """The `vllm:spec_decode_*_total` counters of a `/metrics` text; None when absent (the server
    does not speculate)."""
    counters = spec_counters(metrics_text)
    return counters if isinstance(counters, VllmSpecCounters) else None


def vllm_spec_config(metrics_text: str | None, version: str | None) -> SpecConfig | None:
    """A vLLM server speculates when its `/metrics` has the spec-decode counters; the draft length
    is its number of per-position counters. Whether answers carry figures is only known from an
    answer (`confirm_source`): no request field asks for them."""
    counters = vllm_spec_counters(metrics_text) if metrics_text else None
    if counters is None:
        return None
    k = len(counters.accepted_per_position) or None
    return SpecConfig(None, k, "vllm", version, None, {"num_speculative_tokens": k})


def confirm_source(speculative: Mapping[str, Any], proof_has_stats: bool) -> dict[str, Any]:
    """The manifest's `speculative` entry as a real answer (the preflight proof) shows it. vLLM:
    `stats_source` is set only when the answer had `metrics.speculative_decoding` (the server runs
    --per-request-spec-decode-metrics; nothing in a request can ask for it). SGLang: kept as the
    version chose it (an answer without a verify step has no figures, so one answer cannot
    refute it)."""
    out = dict(speculative)
    if out.get("engine") == "vllm":
        out["stats_source"] = SOURCE_VLLM if proof_has_stats else None
    return out


def _ints(v: Any) -> tuple[int, ...] | None:
    if isinstance(v, list) and v and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        return tuple(v)
    return None


def from_sglang(details: Mapping[str, Any]) -> SpecStats | None:
    """One SGLang figures object (a `meta_info` or a `spec_tokens_details`) of any version in
    SGLANG_FIELDS; None when it has no verify step (SGLang leaves the fields out then, and
    `spec_tokens_details` reports zeros)."""
    verify = _num(details.get("spec_verify_ct"))
    if not verify:
        return None
    for accepted_key, proposed_key, hist_key in SGLANG_FIELDS:
        accepted = _num(details.get(accepted_key))
        if accepted is None:
            continue
        hist = None
        for key in (hist_key, "spec_correct_drafts_histogram", "spec_accept_histogram"):
            hist = hist or (_ints(details.get(key)) if key else None)
        return SpecStats(verify, accepted, _num(details.get(proposed_key)), hist)
    return None


def from_vllm(details: Mapping[str, Any]) -> SpecStats | None:
    """vLLM's `metrics.speculative_decoding` object."""
    steps = _num(details.get("num_spec_steps"))
    accepted = _num(details.get("num_accepted_draft_tokens"))
    if steps is None or accepted is None:
        return None
    return SpecStats(steps, accepted, _num(details.get("num_draft_tokens")),
                     _ints(details.get("acceptance_histogram")))


def spec_stats_of(data: Mapping[str, Any], choice_index: int = 0) -> SpecStats | None:
    """The statistics of one choice of a chat-completion body, whichever dialect carries them
    (vLLM `metrics.speculative_decoding`, SGLang `sglext.spec_tokens_details`, SGLang
    `choices[i].meta_info`); None when the body has none."""
    metrics = data.get("metrics")
    if isinstance(metrics, Mapping) and isinstance(metrics.get("speculative_decoding"), Mapping):
        return from_vllm(metrics["speculative_decoding"])  # n == 1 only (vLLM)
    ext = data.get("sglext")
    details = ext.get("spec_tokens_details") if isinstance(ext, Mapping) else None
    if isinstance(details, Mapping) and choice_index == 0:
        return from_sglang(details)
    if isinstance(details, Sequence) and not isinstance(details, (str, bytes)):
        # n > 1: one object per choice that had figures, in choice order; with all choices present
        # the index is the choice's.
        choices = data.get("choices")
        if isinstance(choices, list) and len(details) == len(choices) and choice_index < len(details):
            item = details[choice_index]
            return from_sglang(item) if isinstance(item, Mapping) else None
    choices = data.get("choices")
    if isinstance(choices, list) and choice_index < len(choices) and isinstance(choices[choice_index], Mapping):
        meta = choices[choice_index].get("meta_info")
        if isinstance(meta, Mapping):
            return from_sglang(meta)
    return None


def sglang_avg_accept_length(info: Mapping[str, Any]) -> float | None:
    """`internal_states[0].avg_spec_accept_length` of SGLang's server info (since start)."""
    states = info.get("internal_states")
    if isinstance(states, list) and states and isinstance(states[0], Mapping):
        v = states[0].get("avg_spec_accept_length")
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None
    return None
