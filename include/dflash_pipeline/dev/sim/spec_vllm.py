"""The simulator's vLLM speculative dialect (vLLM 0.32, read from its installed source).

- Per request (`v1/metrics/stats.py` `RequestSpecDecodeMetrics.to_dict`,
  `entrypoints/generate/base/protocol.py` `SpeculativeDecodingMetrics` / `PerRequestMetrics`,
  `entrypoints/openai/chat_completion/serving.py`): with `--per-request-spec-decode-metrics
  summary|detailed` a speculating server's n == 1 answer has `metrics` = PerRequestMetrics with
  the timing fields null (they need `--enable-per-request-metrics`) and `speculative_decoding`:
  `mean_acceptance_length` (1 + accepted / steps; 1.0 with no step), `draft_acceptance_rate`,
  `acceptance_histogram` (dense, length k + 1), `num_spec_steps`, `num_accepted_draft_tokens`,
  `num_draft_tokens`, `num_spec_tokens`; `detailed` adds `per_step_accepted` and
  `per_step_drafted` (only when non-empty). Otherwise `metrics` is null.
- `/metrics` (`v1/spec_decode/metrics.py` `SpecDecodingProm`, labels `model_name`, `engine` and
  `position` for the per-position counter, 0-based): the four counters below, written by
  prometheus_client with `# HELP` / `# TYPE` and a `_created` sample per series; only a
  speculating server has them.
"""

from __future__ import annotations

from typing import Any

from dflash_pipeline.dev.sim.spec_drafter import Drafted, SpecCounters


def metrics_field(config: Any, d: Drafted | None) -> dict[str, Any] | None:
    """The answer's `metrics` value."""
    if d is None or not config.spec_algorithm or config.spec_per_request_metrics == "none":
        return None
    steps = d.verify_steps
    accepted = d.accepted
    spec: dict[str, Any] = {
        "mean_acceptance_length": 1.0 + accepted / steps if steps else 1.0,
        "draft_acceptance_rate": accepted / d.proposed if d.proposed else 0.0,
        "acceptance_histogram": d.histogram(),
        "num_spec_steps": steps,
        "num_accepted_draft_tokens": accepted,
        "num_draft_tokens": d.proposed,
        "num_spec_tokens": d.k,
        "per_step_accepted": None,
        "per_step_drafted": None,
    }
    if config.spec_per_request_metrics == "detailed" and steps:
        spec["per_step_accepted"] = list(d.per_step)
        spec["per_step_drafted"] = [d.k] * steps
    return {"time_to_first_token_ms": None, "generation_time_ms": None, "queue_time_ms": None,
            "mean_itl_ms": None, "tokens_per_second": None, "speculative_decoding": spec}


def metrics_lines(model: str, counters: SpecCounters | None, created: float) -> str:
    """The spec-decode counters of vLLM's `/metrics` text ("" when not speculating)."""
    if counters is None:
        return ""
    snap = counters.snapshot()
    label = f'engine="0",model_name="{model}"'
    out: list[str] = []
    for name, doc, value in (
        ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", snap["drafts"]),
        ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", snap["draft_tokens"]),
        ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", snap["accepted_tokens"]),
    ):
        out += [f"# HELP {name}_total {doc}", f"# TYPE {name}_total counter",
                f"{name}_total{{{label}}} {float(value)}",
                f"# HELP {name}_created {doc}", f"# TYPE {name}_created gauge",
                f"{name}_created{{{label}}} {created}"]
    name = "vllm:spec_decode_num_accepted_tokens_per_pos"
    out += [f"# HELP {name}_total Accepted tokens per draft position.", f"# TYPE {name}_total counter"]
    out += [f'{name}_total{{{label},position="{i}"}} {float(v)}' for i, v in enumerate(snap["per_position"])]
    out += [f"# HELP {name}_created Accepted tokens per draft position.", f"# TYPE {name}_created gauge"]
    out += [f'{name}_created{{{label},position="{i}"}} {created}' for i in range(len(snap["per_position"]))]
    return "\n".join(out) + "\n"
