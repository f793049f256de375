"""Are dflash_eval's groups comparable? Checked at prepare from each server's own report (the GET-only
probe: no proof or generation request), before anything is planned.

A comparison of drafters means something only when every group serves the same target model, every
server of a drafter group runs the same speculative method and draft length (on one engine), and the
baseline does not speculate. A server that does not answer now is left out of the check (its task waits
for it; its manifest entry records what it serves once it does).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from dflash_pipeline.config.evaluate import Group
from dflash_pipeline.serving.probe import probe_server
from dflash_pipeline.serving.sglang import RequestFailure, ServerInfo, ServerSpec, new_session

logger = logging.getLogger(__name__)


def target_of(info: ServerInfo) -> str:
    """The target a server serves: the weights it loaded (model_path), else the name it serves."""
    return str(info.model_path or info.served_model_name)


def spec_label(info: ServerInfo) -> str:
    spec = info.speculative
    if not spec:
        return f"{info.engine}, no speculation"
    return f"{info.engine} {spec.get('algorithm')}, {spec.get('num_draft_tokens')} drafts per step"


def _spec_key(info: ServerInfo) -> tuple[Any, ...]:
    spec = info.speculative or {}
    return (info.engine, str(spec.get("algorithm") or "").upper() or None, spec.get("num_draft_tokens"))


def comparability_refusals(groups: Iterable[Group], infos: dict[str, ServerInfo]) -> list[str]:
    """Why the groups cannot be compared (empty: they can). `infos`: server name -> its probe."""
    groups = list(groups)
    out: list[str] = []
    targets: dict[str, list[str]] = {}
    for g in groups:
        for s in g.servers:
            if s in infos:
                targets.setdefault(target_of(infos[s]), []).append(f"{g.name} ({s})")
    if len(targets) > 1:
        out.append("the groups serve different target models (" + "; ".join(
            f"{t}: {', '.join(w)}" for t, w in targets.items()) + "): acceptance and speed of drafters are only "
            "comparable on one target; serve the same model everywhere, or evaluate each target in its own eval")
    for g in groups:
        seen = [(s, infos[s]) for s in g.servers if s in infos]
        if g.baseline:
            spec = [f"{s}: {spec_label(i)}" for s, i in seen if i.speculative]
            if spec:
                out.append(f"the baseline {g.name} speculates ({'; '.join(spec)}): a baseline serves the target "
                           "without speculation (restart those servers without --speculative-* flags / "
                           "--speculative-config)")
            continue
        if len({_spec_key(i) for _, i in seen}) > 1:
            out.append(f"drafter {g.name} mixes speculative configurations ({'; '.join(f'{s}: {spec_label(i)}' for s, i in seen)}): "
                       "a group is one method and draft length on every server; split it into one group per configuration")
    return out


def probe_groups(groups: Iterable[Group], specs: dict[str, list[ServerSpec]]) -> dict[str, ServerInfo]:
    """Each answering server's probe (server name -> ServerInfo); a server that does not answer is left
    out, a configuration error (wrong key, wrong endpoint) is raised by preflight as before."""
    session = new_session()
    found: dict[str, ServerInfo] = {}
    for g in groups:
        for spec in specs[g.name]:
            try:
                found[spec.name] = probe_server(session, spec)
            except RequestFailure as exc:
                logger.warning("server %s (%s) did not answer the comparability probe (%s): left out of the check",
                               spec.name, g.name, exc.message)
    return found
