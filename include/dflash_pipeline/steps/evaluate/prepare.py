"""dflash_eval's first task: find the prompts, plan and preflight every (group, condition) dataset,
and hand each server its list of conditions.

Each (group, condition) is a regular generate dataset under `<output_uri>/<group>/<condition>/`,
planned by the generate step's own `run_plan` and checked by its own `run_preflight` with a
RunConfig derived from the eval's params (config/evaluate.py). So everything generate guarantees
holds per condition: exactly-once rows, resume (a rerun finds the manifests and only does what is
missing), the progress objects. Nothing here sends a generation request before every config check
passed; preflight's proof requests run before any condition's first /metrics scrape.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from dflash_pipeline.config import ConfigError
from dflash_pipeline.config.evaluate import Condition, EvalConfig
from dflash_pipeline.dataset.layout import DatasetLayout
from dflash_pipeline.dataset.store import Store, with_retries
from dflash_pipeline.serving.sglang import ServerSpec
from dflash_pipeline.steps.plan import run_plan
from dflash_pipeline.steps.preflight import run_preflight

logger = logging.getLogger(__name__)

EVAL_FORMAT = "dflash-pipeline/eval/1"


def resolve_prompts(client: Any, cfg: EvalConfig) -> tuple[str, bool | None, dict[str, Any]]:
    """(prompts_uri, the source dataset's thinking mode or None, what the report says about the source)."""
    if cfg.prompts_uri:
        return cfg.prompts_uri, None, {"kind": "prompts_uri", "prompts_uri": cfg.prompts_uri}
    assert cfg.dataset_uri is not None
    layout = DatasetLayout.from_uri(cfg.dataset_uri)
    got = with_retries(lambda: Store(client, layout.bucket).get(layout.manifest_key), what="dataset manifest")
    if got is None:
        raise ConfigError(f"dataset_uri {cfg.dataset_uri}: no manifest.json there (not a dflash_generate dataset)")
    manifest = json.loads(got[0])
    heldout = manifest.get("heldout") or {}
    key = heldout.get("key")
    if not key:
        raise ConfigError(
            f"dataset_uri {cfg.dataset_uri} has no held-out split (manifest.heldout.key is missing): generate it "
            "with a held-out split, or name a benchmark file with prompts_uri")
    uri = key if str(key).startswith("s3://") else f"s3://{layout.bucket}/{key}"
    thinking = ((manifest.get("pinned") or {}).get("sampling") or {}).get("enable_thinking")
    source = {"kind": "heldout", "dataset_uri": cfg.dataset_uri, "prompts_uri": uri,
              "heldout": {k: v for k, v in heldout.items() if isinstance(v, (str, int, float, bool)) or v is None},
              "dataset_thinking": thinking}
    return uri, None if thinking is None else bool(thinking), source


def condition_from_dict(d: dict[str, Any]) -> Condition:
    conc = d.get("concurrency")
    return Condition(sampling=d["sampling"], temperature=float(d["temperature"]), top_p=float(d["top_p"]),
                     thinking=bool(d["thinking"]), concurrency=None if conc in (None, "production") else int(conc))


def prepare(
    client: Any,
    cfg: EvalConfig,
    run_id: str,
    resolve: Callable[[str], ServerSpec],
) -> list[dict[str, Any]]:
    """Plan and preflight every (group, condition); one assignment per server (for the mapped task).

    Each assignment: the server, its group, its index in the group, the prompts, and per condition
    its name, settings and preflight's answer for that server."""
    prompts_uri, dataset_thinking, source = resolve_prompts(client, cfg)
    lineages = read_lineages(client, cfg, source)  # a missing or foreign card fails here, before any request
    conditions = cfg.conditions(dataset_thinking)
    logger.info("eval %s: %d group(s) x %d condition(s) on %s: %s", cfg.output_uri, len(cfg.groups), len(conditions),
                prompts_uri, [c.name for c in conditions])
    specs = {g.name: [resolve(s) for s in g.servers] for g in cfg.groups}  # a bad connection id fails here
    per_server: dict[str, list[dict[str, Any]]] = {s: [] for g in cfg.groups for s in g.servers}
    for group in cfg.groups:
        for cond in conditions:
            rc = cfg.run_config(group, cond, prompts_uri)
            plan = run_plan(client, rc, run_id)
            infos = run_preflight(client, rc, specs[group.name], run_id)
            logger.info("%s/%s: %s prompts in %s chunks (resumed %s)", group.name, cond.name, plan["prompts"],
                        plan["chunks"], plan["resumed"])
            for info in infos:
                per_server[info["server"]].append(dict(cond.to_dict(), root=rc.output_uri, server_info=info))
    _write_eval_doc(client, cfg, run_id, dict(source, lineage=lineages), conditions)
    out: list[dict[str, Any]] = []
    for group in cfg.groups:
        for index, server in enumerate(group.servers):
            out.append({"server": server, "group": group.name, "baseline": group.baseline, "index": index,
                        "n_servers": len(group.servers), "prompts_uri": prompts_uri, "source": source,
                        "conditions": per_server[server], "lineage": lineages.get(group.name)})
    return out


def read_lineages(client: Any, cfg: EvalConfig, source: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """{drafter: its card's lineage} for the drafters that name a card (steps/train/card.py). Each says
    whether the eval's prompts are the held-out split of the dataset the drafter was trained on
    (`heldout_of_training_data`: true; false = another dataset's prompts or a benchmark, so nothing says the
    drafter never saw them; the report shows it)."""
    from dflash_pipeline.steps.train.card import lineage, read_card

    out: dict[str, dict[str, Any]] = {}
    for group in cfg.drafters:
        if not group.card_uri:
            continue
        entry = lineage(read_card(client, group.card_uri))
        trained_on = str(entry.get("dataset") or "").rstrip("/")
        entry["heldout_of_training_data"] = bool(source.get("kind") == "heldout" and trained_on
                                                 and str(source.get("dataset_uri") or "").rstrip("/") == trained_on)
        logger.info("drafter %s: card %s (dataset %s, tokenization %s, trainer %s, %s steps)", group.name,
                    entry["card"], entry.get("dataset"), entry.get("tokenization"), entry.get("trainer"),
                    entry.get("steps"))
        out[group.name] = entry
    return out


def _write_eval_doc(client: Any, cfg: EvalConfig, run_id: str, source: dict[str, Any],
                    conditions: list[Condition]) -> None:
    """`runs/<run_id>/eval.json` at the eval root: what this run measures (the report reads the params
    from Airflow; this is for people and later runs)."""
    root = DatasetLayout.from_uri(cfg.output_uri)
    doc = {"format": EVAL_FORMAT, "run_id": run_id, "config": cfg.to_dict(), "source": source,
           "conditions": [c.to_dict() for c in conditions]}
    store = Store(client, root.bucket)
    key = root.run_key(run_id, "eval.json")
    with_retries(lambda: store.put(key, json.dumps(doc, indent=1).encode(), content_type="application/json"),
                 what="write eval.json")
