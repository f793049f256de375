"""The drafter card: `<drafters root>/<name>/card.json`, written last, once (If-None-Match).

It ties the drafter to the data it learned from: the dataset root and its manifest's sha256, the tokenization
(name, settings sha256, report sha256, every shard's key, size, ETag and, when the local backend downloaded
it, sha256), the held-out split, the trainer and its version, the hyperparameters, steps, loss curve, wall
time and rows per second (from the trainer's train_log.json). Its presence means the drafter is complete: a
rerun with the same settings does nothing, one with other settings is refused (checks.claim_name).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from dflash_pipeline.dataset.layout import parse_s3_uri
from dflash_pipeline.dataset.store import PreconditionFailed, Store, with_retries
from dflash_pipeline.steps.train.checks import TrainRefused

logger = logging.getLogger(__name__)

CARD_FORMAT = "dflash-pipeline/drafter-card/1"
TRAIN_LOG_KEYS = ("trainer", "trainer_version", "steps", "loss", "rows", "tokens", "wall_s", "rows_per_s",
                  "resumed_from_step")


def card_key(prefix_key: str) -> str:
    return f"{prefix_key.rstrip('/')}/card.json"


def build_card(job: dict[str, Any], train_log: dict[str, Any] | None, files: dict[str, Any],
               shards: list[dict[str, Any]] | None = None, run_id: str | None = None) -> dict[str, Any]:
    """The card's JSON (pure: the job from checks, the trainer's log, the drafter's files)."""
    log = train_log or {}
    return {
        "format": CARD_FORMAT,
        "name": job["name"],
        "uri": job["prefix"],
        "settings_hash": job["settings_hash"],
        "settings": job["settings"],
        "dataset": job["dataset"],
        "tokenization": job["tokenization"],
        "shards": shards or job["shards"],
        "heldout": job["heldout"],
        "target_model": job["target_model"],
        "backend": job["backend"],
        "trainer": {"name": log.get("trainer"), "version": log.get("trainer_version")},
        "hyperparameters": job["hyperparameters"],
        "save_every": job["save_every"],
        "training": {k: log.get(k) for k in TRAIN_LOG_KEYS if k not in ("trainer", "trainer_version")},
        "files": files,
        "created_by_run": run_id,
    }


def read_train_log(store: Store, prefix_key: str) -> dict[str, Any] | None:
    got = with_retries(lambda: store.get(f"{prefix_key}/train_log.json"), what="read train_log.json")
    return None if got is None else json.loads(got[0])


def write_card(client: Any, job: dict[str, Any], shards: list[dict[str, Any]] | None = None,
               run_id: str | None = None) -> dict[str, Any]:
    """Write the card once (the drafter's files must be there); return it. The same settings' card already
    there is returned as it is; another's is refused."""
    loc = parse_s3_uri(job["prefix"].rstrip("/"), what="drafter prefix")
    store = Store(client, loc.bucket)
    key = card_key(loc.key)
    existing = with_retries(lambda: store.get(key), what="read card")
    if existing is not None:
        return _same_or_refuse(json.loads(existing[0]), job)
    objs = with_retries(lambda: list(store.list(f"{loc.key}/")), what=f"list {job['prefix']}")
    files = {o.key: {"size": o.size, "etag": o.etag.strip('"')} for o in sorted(objs, key=lambda o: o.key)
             if not o.key.endswith(("/card.json", "/settings.json"))}
    train_log = read_train_log(store, loc.key)
    if job["backend"] == "local":
        drafter = [k for k in files if k.startswith(f"{loc.key}/drafter/")]
        if train_log is None or not any(k.endswith("/model.safetensors") for k in drafter):
            raise RuntimeError(f"{job['prefix']}: the drafter's files or train_log.json are missing; the card is "
                               "written only over a complete drafter (rerun: the train resumes)")
    elif not files:
        raise RuntimeError(f"{job['prefix']}: the pod left no file under the drafter's prefix")
    card = build_card(job, train_log, files, shards, run_id)
    body = json.dumps(card, indent=1, sort_keys=True).encode()
    try:
        with_retries(lambda: store.put(key, body, if_none_match=True, content_type="application/json"),
                     what="write card")
    except PreconditionFailed:
        got = with_retries(lambda: store.get(key), what="read card")
        return _same_or_refuse(json.loads(got[0]) if got else {}, job)
    logger.info("drafter card written: s3://%s/%s", loc.bucket, key)
    return card


def _same_or_refuse(card: dict[str, Any], job: dict[str, Any]) -> dict[str, Any]:
    if card.get("settings_hash") != job["settings_hash"]:
        raise TrainRefused(f"{job['prefix']}card.json holds a drafter trained with other settings "
                           f"({str(card.get('settings_hash'))[:12]}…, asked {job['settings_hash'][:12]}…)")
    logger.info("%scard.json already written with these settings: nothing to do", job["prefix"])
    return card


def read_card(client: Any, uri: str) -> dict[str, Any]:
    """A card by its s3:// uri (of card.json, or of the drafter's folder)."""
    loc = parse_s3_uri(uri.rstrip("/"), what="card_uri")
    key = loc.key if loc.key.endswith(".json") else card_key(loc.key)
    got = with_retries(lambda: Store(client, loc.bucket).get(key), what="read drafter card")
    if got is None:
        from dflash_pipeline.config import ConfigError

        raise ConfigError(f"drafter card s3://{loc.bucket}/{key} does not exist")
    card = json.loads(got[0])
    if card.get("format") != CARD_FORMAT:
        from dflash_pipeline.config import ConfigError

        raise ConfigError(f"s3://{loc.bucket}/{key} is not a drafter card (format {card.get('format')!r})")
    return card


def lineage(card: dict[str, Any]) -> dict[str, Any]:
    """What a report shows beside a drafter's figures: where it came from, in a few fields."""
    tok = card.get("tokenization") or {}
    training = card.get("training") or {}
    loss = training.get("loss") or []
    return {
        "card": f"{card.get('uri', '')}card.json",
        "dataset": (card.get("dataset") or {}).get("uri"),
        "tokenization": tok.get("name"),
        "tokenization_settings_sha256": tok.get("settings_sha256"),
        "answers": tok.get("answers"),
        "defect": (tok.get("defect") or {}).get("name") if isinstance(tok.get("defect"), dict) else tok.get("defect"),
        "trainer": (card.get("trainer") or {}).get("name"),
        "trainer_version": (card.get("trainer") or {}).get("version"),
        "steps": training.get("steps") or (card.get("hyperparameters") or {}).get("steps"),
        "seed": (card.get("hyperparameters") or {}).get("seed"),
        "final_loss": loss[-1][1] if loss else None,
        "settings_hash": card.get("settings_hash"),
    }
