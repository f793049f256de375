"""Preflight: every server answers, serves the pinned model, and tells us how many slots it has.

Configuration problems (wrong API key, wrong model, servers that disagree) fail here, before any
generation request is sent. A server that is merely down is reported and left to its generate task,
which waits for it and hands its work to the others if it never comes back.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from dflash_pipeline.config import ConfigError, RunConfig
from dflash_pipeline.dataset.layout import DatasetLayout
from dflash_pipeline.dataset.store import Store
from dflash_pipeline.serving.sglang import (
    RequestFailure,
    ServerInfo,
    ServerSpec,
    concurrency_warning,
    derive_concurrency,
    new_session,
    probe_server,
)
from dflash_pipeline.steps.plan import update_manifest

logger = logging.getLogger(__name__)


class NoServerAvailable(Exception):
    """No server answered: worth retrying (they may be starting)."""


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
            logger.warning("server %s: %s", spec.name, info.capacity_warning)
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

    update_manifest(store, layout, record)
    model = pinned_model_holder["model"]

    out: list[dict[str, Any]] = []
    by_name = {i.name: i for i in infos}
    for spec in specs:
        info = by_name.get(spec.name)
        mrr = info.max_running_requests if info else None
        concurrency = cfg.concurrency_per_server or derive_concurrency(mrr)
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
            }
        )
    return out
