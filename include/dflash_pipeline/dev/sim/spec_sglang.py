"""The simulator's SGLang speculative dialect, per version (the fields as each release writes them).

Read from the SGLang wheels (`pip download --no-deps sglang==X`), the same files as
serving/specwire.py lists:
- `managers/tokenizer_manager.py` `_calculate_spec_decoding_metrics` (0.5.10, 0.5.11, 0.5.12,
  0.5.13, 0.5.19, 0.5.21): the meta_info fields per release (FIELDS below); nothing when the
  request had no verify step. `spec_accept_length` = completion_tokens / spec_verify_ct;
  proposed = verify_ct x (speculative_num_draft_tokens - 1); the histogram only when non-empty,
  sized to the largest accepted count seen plus one.
- chat answers: `return_meta_info` (0.5.13+; not in 0.5.12's protocol) puts the request's
  meta_info (`id`, `finish_reason`, `prompt_tokens`, `completion_tokens`, `cached_tokens`, ...; a
  subset here) in `choices[0].meta_info`; `return_spec_tokens_details` (0.5.19+;
  `entrypoints/openai/utils.py` `spec_tokens_details_from_meta_info`, `protocol.py`
  `SpecTokensDetails`) adds top-level `sglext.spec_tokens_details`, one object for n == 1, the
  canonical names with zeros / [] for what meta_info lacks, absent when meta_info has no figure.
  Older releases ignore both fields.
- `/metrics` (only with `--enable-metrics`; `observability/metrics_collector.py` 0.5.21): counters
  `sglang:spec_verify_calls_total` and `sglang:generation_tokens_total`, incremented by each finished
  request's `spec_verify_ct` and completion tokens (`observe_one_finished_request`); its acceptance
  gauges are running averages. Labels here are a
  subset (`model_name`); the series appears once a request verified (a labelled prometheus counter).
- `/get_server_info`: flat server args (`speculative_algorithm` ... None when not speculating)
  and `internal_states[0].avg_spec_accept_length` (`managers/scheduler.py`: accepted tokens incl.
  the bonus / forward passes; only once a verify step ran).
"""

from __future__ import annotations

from typing import Any

from dflash_pipeline.dev.sim.spec_drafter import Drafted, SpecCounters


def _version(text: str | None) -> tuple[int, int, int]:
    parts = (text or "0.5.23").split("-")[0].split("+")[0].split(".")
    nums = [int("".join(ch for ch in p if ch.isdigit()) or 0) for p in parts[:3]]
    return tuple(nums + [0] * (3 - len(nums)))  # type: ignore[return-value]


# (first release, accepted-drafts name, proposed name, histogram names, extra alias pairs)
FIELDS: tuple[tuple[tuple[int, int, int], str, str, tuple[str, ...], tuple[tuple[str, str], ...]], ...] = (
    ((0, 5, 21), "spec_num_correct_drafts", "spec_num_proposed_drafts", ("spec_correct_drafts_histogram",), ()),
    ((0, 5, 12), "spec_num_correct_drafts", "spec_num_proposed_drafts",
     ("spec_correct_drafts_histogram", "spec_accept_histogram"),
     (("spec_accepted_drafts", "spec_num_correct_drafts"), ("spec_proposed_drafts", "spec_num_proposed_drafts"))),
    ((0, 5, 11), "spec_accepted_drafts", "spec_proposed_drafts", ("spec_accept_histogram",), ()),
    ((0, 0, 0), "spec_accept_token_num", "spec_draft_token_num", ("spec_accept_histogram",), ()),
)


def meta_fields(version: str | None, d: Drafted | None, completion_tokens: int) -> dict[str, Any]:
    """The speculative fields SGLang `version` writes into a request's meta_info."""
    if d is None or d.verify_steps == 0 or d.k < 1:
        return {}
    v = _version(version)
    since, accepted_key, proposed_key, hist_keys, aliases = next(f for f in FIELDS if v >= f[0])
    del since
    out: dict[str, Any] = {
        "spec_accept_rate": d.accepted / d.proposed,
        "spec_accept_length": completion_tokens / d.verify_steps,
        accepted_key: d.accepted,
        proposed_key: d.proposed,
        "spec_verify_ct": d.verify_steps,
    }
    for alias, canonical in aliases:
        out[alias] = out[canonical]
    hist = d.histogram()
    while hist and hist[-1] == 0:
        hist.pop()  # SGLang grows it to the largest count seen
    if hist:
        for key in hist_keys:
            out[key] = list(hist)
    return out


def server_args(config: Any) -> dict[str, Any]:
    """The speculative server args `/get_server_info` shows (None when not speculating)."""
    if not config.spec_algorithm:
        return {"speculative_algorithm": None, "speculative_draft_model_path": None,
                "speculative_num_steps": None, "speculative_eagle_topk": None,
                "speculative_num_draft_tokens": None}
    k = int(config.spec_num_draft_tokens)
    return {"speculative_algorithm": config.spec_algorithm,
            "speculative_draft_model_path": "sim/drafter",
            "speculative_num_steps": k, "speculative_eagle_topk": 1,
            "speculative_num_draft_tokens": k + 1}


def internal_state(counters: SpecCounters | None) -> dict[str, Any]:
    snap = counters.snapshot() if counters is not None else None
    if not snap or snap["drafts"] <= 0:
        return {}
    return {"avg_spec_accept_length": (snap["drafts"] + snap["accepted_tokens"]) / snap["drafts"]}


def decorate(body: dict[str, Any], request: dict[str, Any], version: str | None, d: Drafted | None,
             meta_base: dict[str, Any]) -> None:
    """Add what `request` asked for, as SGLang `version` answers it, to a chat answer `body`."""
    v = _version(version)
    completion_tokens = int(meta_base.get("completion_tokens") or 0)
    meta = {**meta_base, **meta_fields(version, d, completion_tokens)}
    if request.get("return_meta_info") is True and v >= (0, 5, 13):
        body["choices"][0]["meta_info"] = meta
    if request.get("return_spec_tokens_details") is True and v >= (0, 5, 19):
        keys = ("spec_accept_rate", "spec_accept_length", "spec_num_correct_drafts", "spec_num_proposed_drafts",
                "spec_verify_ct", "spec_correct_drafts_histogram")
        if any(k in meta for k in keys):
            body["sglext"] = {"spec_tokens_details": {
                "spec_accept_rate": meta.get("spec_accept_rate") or 0.0,
                "spec_accept_length": meta.get("spec_accept_length") or 0.0,
                "spec_cap_length": 0.0,
                "spec_block_accept_length": 0.0,
                "spec_num_correct_drafts": meta.get("spec_num_correct_drafts") or 0,
                "spec_num_proposed_drafts": meta.get("spec_num_proposed_drafts") or 0,
                "spec_verify_ct": meta.get("spec_verify_ct") or 0,
                "spec_correct_drafts_histogram": meta.get("spec_correct_drafts_histogram") or [],
                "spec_cap_lens_histogram": [],
            }}


def metrics_text(model: str, counters: SpecCounters | None, generated_tokens: int = 0) -> str:
    """SGLang's `/metrics` text, the part a client of its counters reads: generated tokens and verify
    calls, each a labelled counter whose series appears at its first increment."""
    lines = ["# HELP sglang:generation_tokens_total Number of generation tokens processed.",
             "# TYPE sglang:generation_tokens_total counter"]
    if generated_tokens > 0:
        lines.append(f'sglang:generation_tokens_total{{model_name="{model}"}} {float(generated_tokens)}')
    lines += ["# HELP sglang:spec_verify_calls_total Number of speculative decoding verification calls.",
              "# TYPE sglang:spec_verify_calls_total counter"]
    snap = counters.snapshot() if counters is not None else None
    if snap and snap["drafts"] > 0:
        lines.append(f'sglang:spec_verify_calls_total{{model_name="{model}"}} {float(snap["drafts"])}')
    return "\n".join(lines) + "\n"


class SglangMetricsEndpoint:
    """The SGLang flavour's `/metrics` handler (mixed into the simulator's handler): served only with
    `SimConfig.enable_metrics` (SGLang's --enable-metrics), FastAPI's 404 otherwise."""

    sim: Any

    def _sglang_metrics(self, _body: bytes) -> None:
        if not self.sim.config.enable_metrics:
            self._send_json(404, {"detail": "Not Found"})  # type: ignore[attr-defined]
            return
        text = metrics_text(self.sim.config.served_model_name, self.sim.spec_counters, self.sim._sched.generated())
        self._send(200, text.encode(), content_type="text/plain; version=0.0.4; charset=utf-8")  # type: ignore[attr-defined]
