"""Preflight: every server answers, serves the pinned model, tells us how many slots it has, and
proves it can do the job with one chat request.

Configuration problems (wrong API key, wrong model, servers that disagree) fail here, before any
generation request is sent. A server that is merely down is reported and left to its generate task,
which waits for it and hands its work to the others if it never comes back.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from dflash_pipeline.config import ConfigError, RunConfig
from dflash_pipeline.config.sampling import DIALECTS, unsupported_keys
from dflash_pipeline.dataset.layout import DatasetLayout
from dflash_pipeline.dataset.records import decode_inputs
from dflash_pipeline.dataset.store import Store, with_retries
from dflash_pipeline.serving.probe import concurrency_warning, derive_concurrency, probe_server
from dflash_pipeline.serving.sglang import (
    RequestFailure,
    ServerInfo,
    ServerSpec,
    build_chat_body,
    chat_once,
    new_chat_client,
    new_session,
)
from dflash_pipeline.serving.specwire import confirm_source, request_fields
from dflash_pipeline.steps.plan import load_manifest, update_manifest

logger = logging.getLogger(__name__)


class NoServerAvailable(Exception):
    """No server answered: worth retrying (they may be starting)."""


# The proof request: the run's sampling and thinking flag, a short answer budget. Its X-Request-Id
# starts with PROOF_REQUEST_PREFIX so a server's request counts can leave it out (the simulator does).
PROOF_MAX_TOKENS = 256
PROOF_REQUEST_PREFIX = "preflight-proof"
PROOF_MESSAGES = [{"role": "user", "content": "What is 2 + 3? Answer with one number."}]
PROOF_ATTEMPTS = 3


def proof_messages(store: Store, layout: DatasetLayout) -> tuple[list[dict[str, str]], dict[str, Any] | None]:
    """The plan's longest prompt (so the server's own tokenizer measures it), else a tiny one."""
    got = load_manifest(store, layout)
    longest = (got[0].get("input") or {}).get("longest_prompt") if got else None
    if not longest:
        return PROOF_MESSAGES, None
    data = with_retries(lambda: store.get(layout.input_key(got[0]["plan_id"], int(longest["chunk"]))),
                        what="read the longest prompt")
    for row in decode_inputs(data[0]) if data else []:
        if row["id"] == longest["id"]:
            return row["messages"], longest
    return PROOF_MESSAGES, None


def prove_server(
    spec: ServerSpec, info: ServerInfo, cfg: RunConfig, model: str, run_id: str,
    messages: list[dict[str, str]], longest: dict[str, Any] | None, thinking: bool | None = None,
) -> dict[str, Any]:
    """One chat request with the run's settings, the plan's longest prompt. Raises ConfigError when
    the server cannot do the job: with thinking enabled its answer has neither a reasoning field nor
    `<think>` in the content (no reasoning parser and a template that hides the tags). Whether its
    context holds max_tokens plus that prompt is returned (`fits`) and judged against the fleet by
    `judge_context`. A transient failure raises RequestFailure (server down)."""
    thinking = cfg.sampling.enable_thinking if thinking is None else thinking
    sampling = dataclasses.replace(cfg.sampling, max_tokens=PROOF_MAX_TOKENS, enable_thinking=thinking)
    headers = {"X-Request-Id": f"{PROOF_REQUEST_PREFIX}-{run_id}-{spec.name}"[:200]}

    def ask(msgs: list[dict[str, str]]) -> tuple[Any, float]:
        body = build_chat_body(msgs, model, sampling, "preflight-proof", info.engine,
                               spec_fields=request_fields(info.speculative), max_tokens_cap=PROOF_MAX_TOKENS)
        for attempt in range(1, PROOF_ATTEMPTS + 1):
            try:
                return chat_once(new_chat_client(), spec, body, cfg.request_timeout_s, headers=headers)
            except RequestFailure as exc:
                if exc.kind == "permanent" and exc.error_class == "ContextLengthExceeded":
                    raise
                if exc.kind != "transient":
                    raise ConfigError(f"server {spec.name}: the proof request failed: {exc.message}") from exc
                if attempt == PROOF_ATTEMPTS:
                    raise
                time.sleep(0.5 * attempt)
        raise AssertionError("unreachable")

    fits: bool | None = None
    prompt_tokens: int | None = None
    try:
        completion, latency = ask(messages)
        prompt_tokens = completion.prompt_tokens
        if info.context_length and prompt_tokens is not None:
            fits = prompt_tokens + cfg.sampling.max_tokens <= info.context_length
    except RequestFailure as exc:
        if exc.error_class != "ContextLengthExceeded":
            raise
        fits = False  # the prompt alone is refused; the answer's shape is proven on a short one
        logger.warning("server %s: the plan's longest prompt does not fit its context: %s", spec.name, exc.message)
        completion, latency = ask(PROOF_MESSAGES)
    shape = completion.reasoning_source or "none"
    if thinking and not completion.reasoning:
        raise ConfigError(
            f"server {spec.name} ({info.engine} {info.version or ''}): with enable_thinking the proof "
            "answer has no reasoning field and no <think> in its content, so thinking cannot be split "
            "from answers (finish_reason "
            f"{completion.finish_reason}, {completion.completion_tokens} tokens). Start the server with a "
            "reasoning parser (SGLang or vLLM --reasoning-parser), or set enable_thinking=false"
        )
    return {
        "prompt_tokens": prompt_tokens,
        "fits": fits,
        "context_length": info.context_length,
        "completion_tokens": completion.completion_tokens,
        "finish_reason": completion.finish_reason,
        "reasoning_shape": shape,
        "longest_prompt_id": longest["id"] if longest else None,
        "latency_s": round(latency, 3),
        # The proof's speculative statistics (None when the answer had none): they confirm
        # where this server's answers carry them (spec_manifest).
        "spec": completion.spec.to_columns() if completion.spec is not None else None,
    }


def refuse_sampling_keys(cfg: RunConfig, infos: list[ServerInfo], row_keys: list[str]) -> None:
    """Refuse (before any generation) a sampling key a server's engine does not accept: the run's
    extras and ladder, and the keys the input rows override (plan's `input.sampling_keys`). Engines
    ignore unknown fields silently, so a key sent to the wrong engine would change nothing, unseen."""
    keys = cfg.sampling.override_keys() | set(row_keys)
    bad = [f"server {i.name} ({i.engine}) does not accept {unsupported_keys(keys, i.engine)}"
           for i in infos if unsupported_keys(keys, i.engine)]
    if bad:
        raise ConfigError("sampling keys the engine would ignore: " + "; ".join(bad) + ". Drop them from "
                          "sampling_extra / sampling_ladder / the rows' `sampling`, or use servers whose engine "
                          f"takes them ({ {e: sorted(k) for e, k in DIALECTS.items()} })")


def proof_thinking(cfg: RunConfig, planned: dict[str, Any]) -> bool:
    """The proof's thinking mode: on when any planned conversation thinks (a mixed run must prove the
    servers split reasoning), else the run's flag."""
    mix = planned.get("thinking") or {}
    if mix:
        return int(mix.get("conversations_on") or 0) > 0
    if cfg.sampling.thinking_fraction is not None:
        return cfg.sampling.thinking_fraction > 0
    return cfg.sampling.enable_thinking


def spec_manifest(info: ServerInfo, proof: dict[str, Any] | None) -> dict[str, Any] | None:
    """The server's `speculative` manifest entry, confirmed by its proof answer (specwire.confirm_source);
    a speculating server whose answers carry no figures is logged: its rows' spec columns stay null."""
    if info.speculative is None:
        return None
    confirmed = confirm_source(info.speculative, bool(proof and proof.get("spec")))
    if confirmed.get("stats_source") is None:
        logger.warning(
            "server %s speculates (%s %s, algorithm %s) but gives no per-request statistics: its rows' "
            "spec columns stay null (SGLang needs >= 0.5.13; vLLM needs --per-request-spec-decode-metrics "
            "summary)", info.name, info.engine, info.version, confirmed.get("algorithm"))
    elif proof and not proof.get("spec") and (proof.get("completion_tokens") or 0) > 1:
        logger.warning("server %s: its version should return %s, but the proof answer had none",
                       info.name, confirmed.get("stats_source"))
    return confirmed


def judge_context(proofs: dict[str, dict[str, Any]], max_tokens: int, longest: dict[str, Any] | None) -> tuple[list[str], str | None]:
    """(refusals, warning) from the proofs' `fits`. A server that cannot hold max_tokens plus the
    plan's longest prompt while another server can is misconfigured (a smaller --context-length):
    refused, with the figures. When no server can hold it, the fleet is consistent and only the
    longest prompts are too long: they become permanent ContextLengthExceeded error rows (a failed
    request is a row), so the run goes on with a warning rather than failing on one outlier."""
    what = f"the plan's longest prompt ({longest['id']}, {longest['bytes']} bytes)" if longest else "the proof prompt"
    ok = sorted(n for n, p in proofs.items() if p.get("fits") is not False)
    short = sorted(n for n, p in proofs.items() if p.get("fits") is False)
    if not short:
        return [], None

    def figures(name: str) -> str:
        p = proofs[name]
        tokens = f"{p['prompt_tokens']} tokens here" if p.get("prompt_tokens") is not None else "refused outright"
        return f"context_length {p.get('context_length')}, {what}: {tokens}"

    if ok:
        return [
            f"server {n}: {figures(n)}; it cannot hold max_tokens {max_tokens} plus that prompt, which "
            f"{', '.join(ok)} can: start it with the same --context-length as the others, or lower max_tokens"
            for n in short
        ], None
    return [], (f"no server can hold max_tokens {max_tokens} plus {what} ({'; '.join(figures(n) for n in short)}): "
                "prompts that long will be ContextLengthExceeded error rows; lower max_tokens or shorten them to keep them")


def resolve_model(cfg_model: str | None, infos: list[ServerInfo], pinned: str | None) -> str:
    """The model name to send; refuses mismatches between the param, the servers and the dataset."""
    if cfg_model:
        wrong = [f"{i.name} serves {i.served_model_name or i.model_path!r}" for i in infos if not i.serves(cfg_model)]
        if wrong:
            raise ConfigError(f"model={cfg_model!r} but " + "; ".join(wrong))
        model = cfg_model
    else:
        names = {i.served_model_name or i.model_path for i in infos}
        if len(names) != 1 or None in names:
            listing = "; ".join(f"{i.name}: {i.served_model_name or i.model_path!r}" for i in infos)
            raise ConfigError(f"the servers do not all serve one model ({listing}); set the model param")
        model = names.pop()  # type: ignore[assignment]
    if pinned and pinned != model:
        raise ConfigError(
            f"this dataset root was generated with model {pinned!r}, the servers now serve {model!r}. "
            "Use a new output_uri, or set accept_pin_changes=true."
        )
    return model


def run_preflight(
    client: Any,
    cfg: RunConfig,
    specs: list[ServerSpec],
    run_id: str,
    session_factory: Callable[[], Any] = new_session,
) -> list[dict[str, Any]]:
    """Probe all servers; record them in the manifest; return one small dict per server for mapping."""
    layout = DatasetLayout.from_uri(cfg.output_uri)
    store = Store(client, layout.bucket)
    session = session_factory()
    infos: list[ServerInfo] = []
    down: list[tuple[ServerSpec, str]] = []
    for spec in specs:
        try:
            info = probe_server(session, spec)
        except RequestFailure as exc:
            if exc.kind == "config":
                raise ConfigError(f"server {spec.name}: {exc.message}") from exc
            logger.warning("server %s is not answering (%s); its task will wait for it", spec.name, exc.message)
            down.append((spec, exc.message))
            continue
        logger.info(
            "server %s: engine %s %s, model %s, max_running_requests=%s, context_length=%s",
            spec.name, info.engine, info.version, info.served_model_name, info.max_running_requests,
            info.context_length,
        )
        if info.capacity_warning and not cfg.concurrency_per_server:
            logger.info("server %s: %s", spec.name, info.capacity_warning)
        infos.append(info)
    if not infos:
        raise NoServerAvailable("no server answered /health: " + "; ".join(f"{s.name}: {m}" for s, m in down))
    # A server whose context cannot hold max_tokens plus a prompt answers every request with a 400:
    # refuse it now, not after it has committed a dataset of error rows.
    small = [i for i in infos if i.context_length is not None and i.context_length <= cfg.sampling.max_tokens]
    if small:
        raise ConfigError("; ".join(
            f"server {i.name}: context_length {i.context_length} cannot hold max_tokens {cfg.sampling.max_tokens} "
            "plus a prompt" for i in small
        ) + ": start it with a larger --context-length, or lower max_tokens")

    pinned_model_holder: dict[str, Any] = {}

    def record(manifest: dict[str, Any]) -> None:
        pinned = None if cfg.accept_pin_changes else manifest.get("model_resolved")
        model = resolve_model(cfg.model, infos, pinned)
        pinned_model_holder["model"] = model
        manifest["model_resolved"] = model
        manifest["servers"] = [i.to_dict() for i in infos] + [
            {"name": s.name, "base_url": s.base_url, "unreachable": m} for s, m in down
        ]
        manifest.setdefault("runs", {})[run_id] = {
            "servers": [s.name for s in specs],
            "model": model,
            "sampling": manifest["pinned"]["sampling"],
        }
        pinned_model_holder["input"] = manifest.get("input") or {}

    update_manifest(store, layout, record)
    model = pinned_model_holder["model"]
    planned = pinned_model_holder["input"]
    refuse_sampling_keys(cfg, infos, planned.get("sampling_keys") or [])

    # Prove each server with one request of the run's settings; a server that cannot do the job
    # is refused here, before any generation (all refusals in one message).
    messages, longest = proof_messages(store, layout)
    proofs: dict[str, dict[str, Any]] = {}
    refused: list[str] = []
    for info in list(infos):
        spec = next(s for s in specs if s.name == info.name)
        try:
            proofs[info.name] = prove_server(spec, info, cfg, model, run_id, messages, longest,
                                             proof_thinking(cfg, planned))
        except ConfigError as exc:
            refused.append(str(exc))
        except RequestFailure as exc:
            logger.warning("server %s: proof request failed (%s); its task will wait for it", spec.name, exc.message)
            infos.remove(info)
            down.append((spec, f"proof request: {exc.message}"))
            continue
        else:
            logger.info("server %s: proof request ok: %s", info.name, proofs[info.name])
    speculative = {i.name: spec_manifest(i, proofs.get(i.name)) for i in infos}
    context_refusals, context_warning = judge_context(proofs, cfg.sampling.max_tokens, longest)
    refused += context_refusals
    if refused:
        raise ConfigError("; ".join(refused))
    if context_warning:
        logger.warning("%s", context_warning)

    def record_proofs(manifest: dict[str, Any]) -> None:
        if context_warning:
            manifest.setdefault("runs", {}).setdefault(run_id, {})["context_warning"] = context_warning
        for entry in manifest.get("servers", []):
            if entry.get("name") in proofs:
                entry["proof"] = proofs[entry["name"]]
                entry["speculative"] = speculative.get(entry["name"])
            elif any(s.name == entry.get("name") for s, _ in down) and "unreachable" not in entry:
                entry["unreachable"] = next(m for s, m in down if s.name == entry["name"])

    out: list[dict[str, Any]] = []
    by_name = {i.name: i for i in infos}
    for spec in specs:
        info = by_name.get(spec.name)
        mrr = info.max_running_requests if info else None
        concurrency = cfg.concurrency_per_server or min(cfg.max_concurrency_per_server, derive_concurrency(mrr))
        warning = concurrency_warning(concurrency, mrr, cfg.request_timeout_s)
        if warning:
            logger.warning("server %s: %s", spec.name, warning)
        out.append(
            {
                "server": spec.name,
                "model": model,
                "concurrency": concurrency,
                "max_running_requests": mrr,
                "healthy": info is not None,
                "engine": info.engine if info else None,
                # How to ask this server for each answer's speculative statistics (specwire).
                "spec_request": request_fields(speculative.get(spec.name)),
                "speculative": speculative.get(spec.name),
            }
        )
    # Each server's in-flight limit as the run starts; validate adds how it moved (record_concurrency).
    plan_concurrency = {
        o["server"]: {
            "mode": "fixed" if cfg.concurrency_per_server else "discovered",
            "start": o["concurrency"],
            "declared_slots": o["max_running_requests"],
            "cap": None if cfg.concurrency_per_server else cfg.max_concurrency_per_server,
        }
        for o in out
    }

    def record_start(manifest: dict[str, Any]) -> None:
        record_proofs(manifest)
        manifest.setdefault("runs", {}).setdefault(run_id, {})["concurrency"] = plan_concurrency

    update_manifest(store, layout, record_start)
    return out


def record_concurrency(store: Store, layout: DatasetLayout, run_id: str) -> dict[str, Any]:
    """Copy each server's in-flight limit over the run (from the generate tasks' progress objects)
    into `manifest.runs[run_id].concurrency`: what the limit was discovered from, the final limit and
    slots, the refusals seen, the controller's changes
    (unix time, limit, slots, ceiling, reason) and the limit sampled over time ([unix time, limit]).
    Called once, after every generate task (validate), so the manifest has one writer then."""
    from dflash_pipeline.monitor.progress import H_LIMIT, H_T

    prefix = layout.run_key(run_id, "progress/")
    found: dict[str, dict[str, Any]] = {}
    for obj in with_retries(lambda: list(store.list(prefix)), what="list progress"):
        got = with_retries(lambda: store.get(obj.key), what="read progress")
        if not got:
            continue
        try:
            doc = json.loads(got[0])
        except ValueError:
            continue
        control = doc.get("concurrency_control") or {}
        series = [[h[H_T], h[H_LIMIT]] for h in doc.get("history") or [] if len(h) > H_LIMIT]
        found[str(doc.get("server"))] = {
            "worker": doc.get("worker"),
            "evidence": control.get("mode"),  # "load" (its load endpoint), "latency" (none), "fixed"
            "final_limit": control.get("limit", doc.get("in_flight_limit")),
            "final_slots": control.get("slots"),
            "rejections": control.get("rejections") or {},
            "changes": control.get("changes") or [],
            "limit_series": series,
        }
    if not found:
        return {}

    def mutate(manifest: dict[str, Any]) -> None:
        entry = manifest.setdefault("runs", {}).setdefault(run_id, {}).setdefault("concurrency", {})
        for server, figures in found.items():
            entry.setdefault(server, {}).update(figures)

    update_manifest(store, layout, mutate)
    return found
