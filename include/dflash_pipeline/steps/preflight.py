"""Preflight: every server answers, serves the pinned model, tells us how many slots it has, and
proves it can do the job with one chat request. Each server's abilities (token ids, separate
reasoning, speculative statistics, slots; serving/abilities.py) are recorded in its manifest entry
as `abilities`; servers without engine token ids are named in a warning, or refused with
`require_token_exact`.

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

from dflash_pipeline.config import ConfigError, RunConfig, Sampling
from dflash_pipeline.dataset.sampling import DIALECTS, unsupported_keys
from dflash_pipeline.dataset.layout import DatasetLayout
from dflash_pipeline.dataset.records import decode_inputs
from dflash_pipeline.dataset.store import Store, with_retries
from dflash_pipeline.serving.abilities import server_abilities, token_exact_warning
from dflash_pipeline.serving.probe import concurrency_warning, derive_concurrency, probe_server, think_token_ids
from dflash_pipeline.serving.sglang import (
    THINK_CLOSE,
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


# Settling "no reasoning" (the proof answer had none): thinking models close their thinking at once on
# some prompts, and some checkpoints always do greedily, so one answer cannot tell "no reasoning parser"
# from "chose not to think". Before a refusal: the same prompt again with another seed (sampled), then
# the tiny proof prompt sampled with two more seeds; sampled at the run's temperature, or at
# SETTLE_TEMPERATURE / SETTLE_TOP_P when the run is greedy (Qwen3's thinking-mode sampling).
SETTLE_TEMPERATURE = 0.6
SETTLE_TOP_P = 0.95
SETTLE_SEEDS = (101, 202, 303)


def _answer_seen(completion: Any, temperature: float, seed: int | None, think_ids: dict[str, int] | None,
                 prompt: str) -> dict[str, Any]:
    """What one proof answer showed about its thinking (what a refusal names)."""
    ids = completion.output_token_ids
    close = None if think_ids is None or ids is None else int(think_ids["</think>"]) in set(ids.tolist())
    return {"prompt": prompt, "temperature": temperature, "seed": seed, "finish_reason": completion.finish_reason,
            "completion_tokens": completion.completion_tokens, "reasoning_chars": len(completion.reasoning or ""),
            "reasoning_source": completion.reasoning_source,
            "think_close_in_ids": close, "think_close_in_text": THINK_CLOSE in (completion.content or ""),
            # what the answer added to a speculating server's counters (the eval's /metrics accounting)
            "spec": completion.spec.to_columns() if completion.spec is not None else None}


def _thinks(completion: Any) -> bool:
    """Thinking that can be split from the answer: a reasoning field or think tags in the text."""
    return bool(completion.reasoning) or completion.reasoning_source == "inline"


def settle_reasoning(
    first: Any, ask: Callable[[list[dict[str, str]], Sampling, str], Any], sampling: Sampling,
    messages: list[dict[str, str]], info: ServerInfo, think_ids: Callable[[], dict[str, int] | None],
) -> dict[str, Any]:
    """Whether a thinking-on server can split thinking, settled over several answers when the first had
    none (see SETTLE_*). Returns {"verdict", "answers", "parser", "evidence"}; verdict "thinks" (an
    answer thought), or "refuse" with `evidence` saying why: no answer thought, and what the server
    reports about its parser and what the answers' token ids show."""
    seen: list[dict[str, Any]] = []
    ids = None
    if not _thinks(first):
        ids = think_ids()
    seen.append(_answer_seen(first, sampling.temperature, sampling.seed, ids, "plan"))
    parser = ({"reported": True, "name": info.reasoning_parser} if info.reasoning_parser_reported
              else {"reported": False, "why": f"the server ({info.engine}) does not report its reasoning parser"})
    if _thinks(first):
        return {"verdict": "thinks", "answers": seen, "parser": parser}
    hot = sampling.temperature if sampling.temperature > 0 else SETTLE_TEMPERATURE
    top_p = sampling.top_p if sampling.temperature > 0 else SETTLE_TOP_P
    tries = [(messages, "plan", SETTLE_SEEDS[0]), (PROOF_MESSAGES, "tiny", SETTLE_SEEDS[1]),
             (PROOF_MESSAGES, "tiny", SETTLE_SEEDS[2])]
    for msgs, label, seed in tries:
        again = dataclasses.replace(sampling, temperature=hot, top_p=top_p, seed=seed)
        try:
            completion = ask(msgs, again, f"settle-{seed}")
        except RequestFailure as exc:
            seen.append({"prompt": label, "temperature": hot, "seed": seed, "failed": exc.message[:200]})
            continue
        seen.append(_answer_seen(completion, hot, seed, ids, label))
        if _thinks(completion):
            return {"verdict": "thinks", "answers": seen, "parser": parser}
    in_ids = [a for a in seen if a.get("think_close_in_ids") and not a.get("think_close_in_text")]
    if info.reasoning_parser_reported and info.reasoning_parser:
        evidence = (f"the server reports reasoning parser {info.reasoning_parser!r}, yet the model did not think in "
                    f"any of {len(seen)} answers (sampled ones included): it closes its thinking at once or ignores "
                    "enable_thinking (its chat template?)")
    elif info.reasoning_parser_reported:
        evidence = "the server reports no reasoning parser (started without --reasoning-parser)"
    elif in_ids:
        evidence = (f"{len(in_ids)} answer(s) generated </think> (token id {ids['</think>'] if ids else '?'}) that "
                    "their text does not hold: a reasoning parser took it out, but the model closed its thinking at "
                    "once every time (sampled included): it ignores enable_thinking or never thinks")
    else:
        how = ("no </think> among their generated token ids" if ids is not None and any(
            a.get("think_close_in_ids") is not None for a in seen)
            else "their token ids could not be checked (no ids, or no /tokenize to find </think>)")
        evidence = f"{parser['why']}; {how}"
    return {"verdict": "refuse", "answers": seen, "parser": parser, "evidence": evidence}


def _seen_text(answers: list[dict[str, Any]]) -> str:
    return "; ".join(
        f"{a['prompt']} prompt at temperature {a['temperature']:g}" + (f" seed {a['seed']}" if a.get("seed") is not None
                                                                        else "")
        + (f": failed ({a['failed']})" if a.get("failed") else
           f": {a['finish_reason']}, {a['completion_tokens']} tokens, no reasoning field, "
           f"{'</think> in the text' if a['think_close_in_text'] else 'no think tags in the text'}"
           + ("" if a["think_close_in_ids"] is None else
              f", </think> {'among' if a['think_close_in_ids'] else 'not among'} its token ids"))
        for a in answers)


def prove_server(
    spec: ServerSpec, info: ServerInfo, cfg: RunConfig, model: str, run_id: str,
    messages: list[dict[str, str]], longest: dict[str, Any] | None, thinking: bool | None = None,
) -> dict[str, Any]:
    """One chat request with the run's settings, the plan's longest prompt. Raises ConfigError when
    the server cannot do the job: with thinking enabled no answer has thinking that can be split from
    it (a reasoning field or `<think>` tags in the text), settled over several answers before a
    refusal (settle_reasoning). Whether its context holds max_tokens plus that prompt is returned
    (`fits`) and judged against the fleet by `judge_context`. A transient failure raises
    RequestFailure (server down)."""
    thinking = cfg.sampling.enable_thinking if thinking is None else thinking
    sampling = dataclasses.replace(cfg.sampling, max_tokens=PROOF_MAX_TOKENS, enable_thinking=thinking)
    headers = {"X-Request-Id": f"{PROOF_REQUEST_PREFIX}-{run_id}-{spec.name}"[:200]}

    def ask(msgs: list[dict[str, str]], how: Sampling = sampling, prompt_id: str = "preflight-proof") -> tuple[Any, float]:
        body = build_chat_body(msgs, model, how, prompt_id, info.engine,
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
            fits = prompt_tokens + cfg.sampling.largest_max_tokens() <= info.context_length
    except RequestFailure as exc:
        if exc.error_class != "ContextLengthExceeded":
            raise
        fits = False  # the prompt alone is refused; the answer's shape is proven on a short one
        logger.warning("server %s: the plan's longest prompt does not fit its context: %s", spec.name, exc.message)
        messages = PROOF_MESSAGES
        completion, latency = ask(PROOF_MESSAGES)
    shape = completion.reasoning_source or "none"
    settled: dict[str, Any] | None = None
    if thinking and not _thinks(completion):
        settled = settle_reasoning(
            completion, lambda m, how, pid: ask(m, how, pid)[0], sampling, messages, info,
            lambda: think_token_ids(new_session(), spec, model) if info.engine == "vllm" else None)
        if settled["verdict"] == "refuse":
            raise ConfigError(
                f"server {spec.name} ({info.engine} {info.version or ''}): with enable_thinking no proof answer "
                f"had thinking, so thinking cannot be split from answers. Seen: {_seen_text(settled['answers'])}. "
                f"{settled['evidence'][:1].upper()}{settled['evidence'][1:]}. Start the server with a reasoning "
                "parser (SGLang or vLLM --reasoning-parser) and a model whose chat template honours enable_thinking, "
                "or measure with thinking off (enable_thinking=false; dflash_eval: thinking_modes [\"off\"])")
        logger.warning("server %s: the first proof answer did not think (%s); settled: an answer with another seed "
                       "did", spec.name, _seen_text(settled["answers"][:1]))
        shape = next((a["reasoning_source"] for a in settled["answers"] if a.get("reasoning_source")), shape)
    return {
        "prompt_tokens": prompt_tokens,
        "fits": fits,
        "context_length": info.context_length,
        "completion_tokens": completion.completion_tokens,
        "finish_reason": completion.finish_reason,
        "reasoning_shape": shape,
        # When the first answer did not think: every answer asked to settle it (settle_reasoning).
        "reasoning_settled": settled,
        "longest_prompt_id": longest["id"] if longest else None,
        "latency_s": round(latency, 3),
        # The proof's speculative statistics (None when the answer had none): they confirm
        # where this server's answers carry them (spec_manifest).
        "spec": completion.spec.to_columns() if completion.spec is not None else None,
        # Where the answer carried token ids (None: it had none): the evidence behind the server's
        # `abilities.token_ids` (serving/abilities.py).
        "token_ids": {"prompt": completion.token_id_sources[0], "output": completion.token_id_sources[1]},
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
    small = [i for i in infos if i.context_length is not None and i.context_length <= cfg.sampling.largest_max_tokens()]
    if small:
        raise ConfigError("; ".join(
            f"server {i.name}: context_length {i.context_length} cannot hold max_tokens {cfg.sampling.largest_max_tokens()} "
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
    abilities = {i.name: server_abilities(i.to_dict(), proofs[i.name], speculative.get(i.name),
                                          proof_thinking(cfg, planned))
                 for i in infos if i.name in proofs}
    for name, found in abilities.items():
        logger.info("server %s abilities: %s", name, found)
        if found.get("note"):
            logger.warning("server %s: %s", name, found["note"])
    exact_warning = token_exact_warning(abilities)
    if exact_warning and cfg.require_token_exact:
        refused.append(f"require_token_exact: {exact_warning}")
    context_refusals, context_warning = judge_context(proofs, cfg.sampling.largest_max_tokens(), longest)
    refused += context_refusals
    if refused:
        raise ConfigError("; ".join(refused))
    if context_warning:
        logger.warning("%s", context_warning)
    if exact_warning:
        logger.warning("%s", exact_warning)

    def record_proofs(manifest: dict[str, Any]) -> None:
        if context_warning:
            manifest.setdefault("runs", {}).setdefault(run_id, {})["context_warning"] = context_warning
        if exact_warning:
            manifest.setdefault("runs", {}).setdefault(run_id, {})["token_exact_warning"] = exact_warning
        for entry in manifest.get("servers", []):
            if entry.get("name") in proofs:
                entry["proof"] = proofs[entry["name"]]
                entry["speculative"] = speculative.get(entry["name"])
                entry["abilities"] = abilities.get(entry["name"])
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
