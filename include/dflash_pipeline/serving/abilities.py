"""What each server can do for this pipeline, found at preflight: token ids, separate reasoning,
speculative statistics, slots.

Why: a fleet mixes engines and releases, and the abilities that matter fail silently. An engine
that returns no token ids makes its rows fall back to re-encoding (token-exactness is lost for
them); one without a reasoning parser returns `<think>` inline; one without per-request
speculative figures leaves the spec columns null. Preflight records each server's abilities in
the manifest (`servers[].abilities`) and the progress page shows them, so a user sees before the
run what every server will give.

Evidence first: each ability is read from what the server reported (server info, `/version`,
`/metrics`) and from the preflight proof answer (which fields carried ids, where the thinking
came). The version tables (`token_ids_expected`, from docs/engines.md) only explain a gap: a
server whose release should return ids but whose proof answer had none gets a `note`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dflash_pipeline.serving.specwire import parse_version

# Releases from which the engine returns token ids when asked (engines.ADAPTERS, docs/engines.md):
# SGLang prompt ids with `return_prompt_token_ids` from 0.5.13, generated ids with
# `return_token_ids` from 0.5.17 (`token_ids` in 0.5.17, `response_token_ids` from 0.5.18);
# vLLM both with `return_token_ids` from 0.10.2.
SGLANG_PROMPT_IDS_SINCE = (0, 5, 13)
SGLANG_OUTPUT_IDS_SINCE = (0, 5, 17)
VLLM_TOKEN_IDS_SINCE = (0, 10, 2)

# `token_ids` values: both lists (token-exact), only the prompt's, none.
IDS_BOTH = "prompt+output"
IDS_PROMPT = "prompt only"
IDS_OUTPUT = "output only"
IDS_NONE = "none"


def token_ids_expected(engine: str | None, version: str | None) -> str | None:
    """What the engine's release should return when asked (None: unknown release or engine)."""
    v = parse_version(version)
    if engine == "openai":
        return IDS_NONE  # not asked: a strict generic server may refuse unknown fields
    if v is None:
        return None
    if engine == "sglang":
        if v >= SGLANG_OUTPUT_IDS_SINCE:
            return IDS_BOTH
        return IDS_PROMPT if v >= SGLANG_PROMPT_IDS_SINCE else IDS_NONE
    if engine == "vllm":
        return IDS_BOTH if v >= VLLM_TOKEN_IDS_SINCE else IDS_NONE
    return None


def _ids_kind(prompt_field: str | None, output_field: str | None) -> str:
    if prompt_field and output_field:
        return IDS_BOTH
    if prompt_field:
        return IDS_PROMPT
    return IDS_OUTPUT if output_field else IDS_NONE


def server_abilities(
    server: Mapping[str, Any], proof: Mapping[str, Any] | None, speculative: Mapping[str, Any] | None,
    enable_thinking: bool,
) -> dict[str, Any]:
    """One server's abilities from its manifest entry (`ServerInfo.to_dict()`), its preflight proof
    (`prove_server`'s dict, with `token_ids` = {"prompt": field, "output": field}) and its
    `speculative` entry (already confirmed by the proof, `spec_manifest`).

    Keys: engine, version; token_ids (IDS_*), token_ids_via (the answer's fields), token_exact
    (both lists: rows are built from the engine's own ids, never re-encoded), token_ids_expected
    (the release's, from the version table); reasoning ("separate": a reasoning parser split it into
    a field; "inline": `<think>` in the content, split by us; "none"; "not checked" when the run
    has thinking off); speculative (the algorithm, None when not speculating), spec_stats (where
    each answer carries its figures, None when it gives none); slots (the server's declared running
    requests, None when it does not declare them), slots_source; note (evidence that disagrees
    with the release's table), None otherwise."""
    engine = server.get("engine")
    version = server.get("version")
    ids = (proof or {}).get("token_ids") or {}
    prompt_field, output_field = ids.get("prompt"), ids.get("output")
    kind = _ids_kind(prompt_field, output_field)
    expected = token_ids_expected(engine, version)
    note = None
    if proof is not None and expected is not None and expected != kind:
        note = (f"{engine} {version} should return {expected} token ids, the proof answer had {kind} "
                "(a proxy that drops fields, or a patched build?)")
    if not enable_thinking:
        reasoning = "not checked"
    else:
        shape = (proof or {}).get("reasoning_shape")
        reasoning = {"field": "separate", "inline": "inline"}.get(str(shape), "none") if proof else "unknown"
    slots = server.get("max_running_requests")
    if slots is not None:
        slots_source = "max_running_requests"
    elif engine == "vllm":
        slots_source = "not reported (max_num_seqs is not on vLLM's HTTP API): discovered from /metrics load"
    else:
        slots_source = "not reported: discovered from the latency of its answers"
    spec = speculative or {}
    return {
        "engine": engine,
        "version": version,
        "token_ids": kind if proof is not None else "unknown",
        "token_ids_via": " + ".join(f for f in (prompt_field, output_field) if f) or None,
        "token_exact": kind == IDS_BOTH,
        "token_ids_expected": expected,
        "reasoning": reasoning,
        "speculative": spec.get("algorithm") or (f"{spec.get('num_draft_tokens')} draft tokens" if spec else None),
        "spec_stats": spec.get("stats_source"),
        "slots": slots,
        "slots_source": slots_source,
        "note": note,
    }


def token_exact_warning(abilities: Mapping[str, Mapping[str, Any]]) -> str | None:
    """The warning for servers whose rows would be re-encoded (no engine token ids), None when
    every server returns both lists."""
    lost = sorted(name for name, a in abilities.items() if not a.get("token_exact"))
    if not lost:
        return None
    what = "; ".join(f"{n} ({abilities[n].get('engine')} {abilities[n].get('version') or '?'}: "
                     f"token ids {abilities[n].get('token_ids')})" for n in lost)
    return (f"token-exactness is lost on {len(lost)} server(s): {what}. Their rows carry no engine token "
            "ids, so tokenize re-encodes their text (checked, but not the tokens the model produced). "
            "Use SGLang >= 0.5.17 or vLLM >= 0.10.2 (docs/engines.md), or set require_token_exact=true "
            "to refuse such a run")
