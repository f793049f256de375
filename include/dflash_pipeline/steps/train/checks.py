"""What dflash_train checks before any work, and the job it hands the trainer.

Refused, with a message that says what to do: a tokenization that does not exist, is not complete (its
report.json, written by tokenize's report task, is the tokenization's manifest: status 'complete', every part
with its stats) or has no SpecForge files; a dataset without a held-out split (the drafter must never see the
prompts it is measured on, and without a split there are none to measure it on); a drafter name already used
with other settings.

The name is claimed by `<drafters root>/<name>/settings.json`, written once (If-None-Match) with the settings
hash: a rerun or retry with the same settings resumes (or does nothing once the card exists), one with other
settings is refused, so one name never holds two drafters. Everything written under the name has a fixed key.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from dflash_pipeline.config import ConfigError
from dflash_pipeline.config.train import TrainConfig
from dflash_pipeline.dataset.layout import DEFAULT_TOKENIZATION, DatasetLayout, parse_s3_uri
from dflash_pipeline.dataset.store import PreconditionFailed, Store, with_retries

logger = logging.getLogger(__name__)

SETTINGS_FORMAT = "dflash-pipeline/drafter-settings/1"
TRAINER = "specforge-dflash"
"""The trainer family the settings name: SpecForge's DFlash training (locally through specforge_entry.py, on
Kubernetes through SpecForge's scripts/train_dflash.py)."""


class TrainRefused(ConfigError):
    """A train that must not start: the message says why and what to do."""


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _get(store: Store, key: str) -> bytes | None:
    got = with_retries(lambda: store.get(key), what=f"read {key}")
    return None if got is None else got[0]


def _get_json(store: Store, key: str) -> dict[str, Any] | None:
    data = _get(store, key)
    return None if data is None else json.loads(data)


def drafter_prefix(root_uri: str, name: str) -> str:
    """s3://bucket/<root>/<name>/ (with the trailing slash)."""
    root = parse_s3_uri(root_uri, what="drafters_root")
    return f"s3://{root.bucket}/{root.key}/{name}/"


def settings_hash(settings: dict[str, Any]) -> str:
    return _sha256(json.dumps(settings, sort_keys=True, separators=(",", ":")).encode())


def jobs_for(cfg: TrainConfig, event_datasets: list[dict[str, Any]] | None) -> list[tuple[str, str]]:
    """(dataset root, tokenization) pairs to train: the dflash_tokenized event's datasets, else the params'."""
    if event_datasets:
        return [(d["output_uri"], d.get("tokenization") or DEFAULT_TOKENIZATION) for d in event_datasets]
    if not cfg.dataset_uri:
        raise TrainRefused("no dflash_tokenized asset event and no dataset_uri param: nothing to train on")
    return [(cfg.dataset_uri, cfg.tokenization)]


def check_train(client: Any, cfg: TrainConfig, dataset_uri: str, tokenization: str,
                several: bool = False) -> dict[str, Any]:
    """Check one (dataset, tokenization) train; return the job (JSON, for XCom). Nothing is written: the name
    is claimed after every check passed (`claim_job`)."""
    base = DatasetLayout.from_uri(dataset_uri)
    layout = base.tokenized_as(tokenization)
    store = Store(client, layout.bucket)
    manifest_bytes = _get(store, layout.manifest_key)
    if manifest_bytes is None:
        raise TrainRefused(f"{layout.uri}/manifest.json does not exist: not a dflash_generate dataset")
    manifest = json.loads(manifest_bytes)
    settings_bytes = _get(store, layout.tokenized_settings_key)
    report_bytes = _get(store, layout.tokenized_report_key)
    if settings_bytes is None:
        from dflash_pipeline.steps.tokenize.run import existing_tokenizations

        known = sorted(existing_tokenizations(store, base))
        raise TrainRefused(f"{layout.uri} has no tokenization {tokenization!r} ({layout.tokenized_dir}/settings.json "
                           f"is missing); its tokenizations: {known or 'none'}. Run dflash_tokenize first, or name one "
                           "of those")
    report = json.loads(report_bytes) if report_bytes is not None else {}
    if report.get("status") != "complete":
        raise TrainRefused(f"tokenization {tokenization!r} of {layout.uri} is not complete (report.json status "
                           f"{report.get('status', 'missing')!r}, {report.get('parts_tokenized', 0)} of "
                           f"{report.get('parts', '?')} parts): rerun dflash_tokenize on it, then train")
    if "specforge" not in (report.get("profiles") or {}):
        raise TrainRefused(f"tokenization {tokenization!r} of {layout.uri} has no 'specforge' files (formats "
                           f"{sorted(report.get('profiles') or {})}): tokenize with formats including 'specforge'")
    heldout = manifest.get("heldout") or report.get("heldout")
    if not heldout or not (heldout.get("fraction") or heldout.get("key") or heldout.get("tokenize_heldout_uri")):
        raise TrainRefused(f"{layout.uri} has no held-out split (manifest.json 'heldout' is empty): a drafter trained "
                           "on it would see every prompt, and none would be left to measure it on. Plan the dataset "
                           "with heldout_fraction > 0 (or heldout_uri), or tokenize it with heldout_uri")
    shards = _list_shards(store, layout.key("tokenized/specforge/"))
    conversations = _list_shards(store, layout.key("tokenized/specforge-conversations/"))
    if len(shards) != int(report.get("parts_tokenized", -1)):
        raise TrainRefused(f"tokenization {tokenization!r} of {layout.uri}: {len(shards)} SpecForge files for "
                           f"{report.get('parts_tokenized')} tokenized parts; the tokenization was changed after its "
                           "report: rerun dflash_tokenize on it")
    tok_settings = json.loads(settings_bytes)
    target_model = cfg.target_model or manifest.get("model_resolved") or (manifest.get("pinned") or {}).get("model")
    if not target_model:
        raise TrainRefused(f"{layout.uri}: no target_model param and none recorded in the manifest")
    if cfg.backend == "local" and not target_model.startswith("s3://") and not Path(target_model).is_dir():
        raise TrainRefused(f"target_model {target_model!r} is not a local model directory: the local backend's "
                           "trainer takes a directory (or give an s3:// prefix holding the model, copied to the work "
                           "dir); a Hugging Face id is for the kubernetes backend")
    settings = {
        "format": SETTINGS_FORMAT,
        "trainer": TRAINER,
        "dataset_uri": base.uri,
        "tokenization": tokenization,
        "tokenization_settings_sha256": _sha256(settings_bytes),
        "target_model": target_model,
        "hyperparameters": cfg.hyperparameters(),
    }
    digest = settings_hash(settings)
    name = cfg.drafter_name or f"{tokenization}-{digest[:8]}"
    if cfg.drafter_name and several:
        name = f"{cfg.drafter_name}-{tokenization}-{digest[:8]}"
    root_uri = cfg.drafters_root or f"{base.uri}/drafters"
    prefix = drafter_prefix(root_uri, name)
    thinking = bool(((manifest.get("pinned") or {}).get("sampling") or {}).get("enable_thinking", True))
    return {
        "name": name,
        "prefix": prefix,
        "status": None,
        "settings": settings,
        "settings_hash": digest,
        "dataset": {"uri": base.uri, "manifest_key": layout.manifest_key, "manifest_sha256": _sha256(manifest_bytes),
                    "model": manifest.get("model_resolved"), "plan_id": manifest.get("plan_id")},
        "tokenization": {
            "name": tokenization, "dir": layout.tokenized_dir, "settings_key": layout.tokenized_settings_key,
            "settings_sha256": _sha256(settings_bytes), "report_key": layout.tokenized_report_key,
            "report_sha256": _sha256(report_bytes or b""), "answers": tok_settings.get("answers", "regenerated"),
            "defect": tok_settings.get("defect"), "max_length": tok_settings.get("max_length"),
            "rows": report.get("rows_out"), "tokens": report.get("tokens"), "loss_tokens": report.get("loss_tokens"),
            "specforge_template": tok_settings.get("specforge_template") or ("qwen3-thinking" if thinking else "qwen"),
            "tokens_prefix": f"s3://{layout.bucket}/{layout.key('tokenized/specforge/')}",
            "conversations_prefix": f"s3://{layout.bucket}/{layout.key('tokenized/specforge-conversations/')}",
            "conversations_rows": (((report.get("profiles") or {}).get("specforge") or {})
                                   .get("specforge_conversations") or {}).get("rows"),
        },
        "shards": shards,
        "conversation_shards": conversations,
        "heldout": {k: heldout.get(k) for k in ("fraction", "salt", "key", "uri", "count", "ids_sha256",
                                                 "heldout_uri", "tokenize_heldout_uri") if k in heldout},
        "target_model": target_model,
        "hyperparameters": cfg.hyperparameters(),
        "save_every": cfg.save_every,
        "backend": cfg.backend,
    }


def _list_shards(store: Store, prefix: str) -> list[dict[str, Any]]:
    """The files directly under `prefix` with their size and S3 ETag (the shard hashes the card records; the
    local backend adds each file's sha256 as it downloads it)."""
    objs = with_retries(lambda: list(store.list(prefix)), what=f"list {prefix}")
    return [{"key": o.key, "size": o.size, "etag": o.etag.strip('"')} for o in sorted(objs, key=lambda o: o.key)
            if "/" not in o.key[len(prefix):]]


def claim_job(client: Any, job: dict[str, Any]) -> dict[str, Any]:
    """The job with its status: 'train' (to run or resume) or 'done' (its card exists with these settings)."""
    return {**job, "status": claim_name(client, job["prefix"], job["settings"], job["settings_hash"])}


def claim_name(client: Any, prefix: str, settings: dict[str, Any], digest: str) -> str:
    """Claim the drafter name (settings.json, If-None-Match) or find it claimed with these settings.

    Returns 'done' when the card exists with this hash, 'train' otherwise; refuses a name taken by other
    settings (the claim, or a card written before the claim existed)."""
    loc = parse_s3_uri(prefix.rstrip("/"), what="drafter prefix")
    store = Store(client, loc.bucket)
    from dflash_pipeline.steps.train.card import card_key

    card = _get_json(store, card_key(loc.key))
    if card is not None:
        if card.get("settings_hash") != digest:
            raise TrainRefused(_taken(prefix, card.get("settings") or {}, settings))
        return "done"
    key = f"{loc.key}/settings.json"
    body = json.dumps({**settings, "settings_hash": digest}, indent=1, sort_keys=True).encode()
    try:
        with_retries(lambda: store.put(key, body, if_none_match=True, content_type="application/json"),
                     what=f"claim {prefix}")
        logger.info("drafter name claimed: %ssettings.json (settings %s)", prefix, digest[:12])
        return "train"
    except PreconditionFailed:
        pass
    held = _get_json(store, key) or {}
    if held.get("settings_hash") != digest:
        raise TrainRefused(_taken(prefix, {k: v for k, v in held.items() if k != "settings_hash"}, settings))
    logger.info("%s is claimed with these settings: resuming", prefix)
    return "train"


def _taken(prefix: str, held: dict[str, Any], asked: dict[str, Any]) -> str:
    differ = {k: (held.get(k), asked.get(k)) for k in sorted(set(held) | set(asked)) if held.get(k) != asked.get(k)}
    return (f"drafter name {prefix} is already used with other settings (held, asked): {differ}. Its files stay as "
            "they are: give another drafter_name, or the same settings to resume it")
