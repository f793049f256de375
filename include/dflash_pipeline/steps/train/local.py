"""The local backend: the trainer as a subprocess in the trainers' venv, on the worker's CPU.

The tokenization's SpecForge files are downloaded to a work folder fixed by the drafter's name and settings
hash (so a rerun on the same worker finds the trainer's `state/` and resumes), the entry runs with
`--config cfg.json` (contract: docs/train.md), its output lines go to the task log as they come, and
`drafter/*` + `train_log.json` are uploaded under the drafter's prefix at fixed keys. The card is written
after, by card.write_card (last, If-None-Match).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from dflash_pipeline.config import ConfigError
from dflash_pipeline.config.train import DEFAULT_TRAINERS_PYTHON
from dflash_pipeline.dataset.layout import parse_s3_uri
from dflash_pipeline.dataset.store import Store, upload_file, with_retries

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[4]
DEFAULT_ENTRY = Path(__file__).with_name("specforge_entry.py")
EXIT_OTHER_CONFIG = 3
"""The entry's exit code when its output_dir holds a train with another cfg."""
TRAIN_LOG = "train_log.json"
DRAFTER_FILES_REQUIRED = ("config.json", "model.safetensors")


class TrainFailed(RuntimeError):
    """The trainer exited with an error (retryable: a retry resumes from its state)."""


def trainers_python(param: str | None) -> str:
    """The trainers' venv python: the param, else $DFLASH_TRAINERS_PYTHON, else .venv-trainers in the repo."""
    path = param or os.environ.get("DFLASH_TRAINERS_PYTHON") or str(REPO / DEFAULT_TRAINERS_PYTHON)
    if not Path(path).exists():
        raise ConfigError(f"trainers python {path} does not exist: build the trainers' venv (make trainers-venv) or "
                          "set trainers_python / DFLASH_TRAINERS_PYTHON")
    return path


def trainer_entry(param: str | None) -> str:
    path = Path(param) if param else DEFAULT_ENTRY
    if not path.is_file():
        raise ConfigError(f"trainer entry {path} does not exist")
    return str(path)


def work_folder(param: str | None, job: dict[str, Any]) -> Path:
    base = Path(param or os.environ.get("DFLASH_TRAIN_WORK_DIR") or Path(tempfile.gettempdir()) / "dflash-train")
    return base / f"{job['name']}-{job['settings_hash'][:12]}"


def _download(client: Any, uri_bucket: str, key: str, dest: Path) -> str:
    """Download one object to `dest` (atomically: a part file renamed), return its sha256."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_suffix(dest.suffix + ".part")
    with_retries(lambda: client.download_file(uri_bucket, key, str(tmp)), what=f"download {key}")
    digest = hashlib.sha256()
    with tmp.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    tmp.replace(dest)
    return digest.hexdigest()


def fetch_target(client: Any, target: str, work: Path) -> str:
    """The target model as the entry takes it: an s3:// prefix is copied to work/target; anything else as is."""
    if not target.startswith("s3://"):
        return target
    loc = parse_s3_uri(target, what="target_model")
    store = Store(client, loc.bucket)
    prefix = loc.key.rstrip("/") + "/"
    objs = with_retries(lambda: list(store.list(prefix)), what=f"list {target}")
    if not objs:
        raise ConfigError(f"target_model {target} holds no files")
    for o in objs:
        _download(client, loc.bucket, o.key, work / "target" / o.key[len(prefix):])
    return str(work / "target")


def run_local(client: Any, job: dict[str, Any], *, python: str, entry: str, work_dir: str | None,
              env: dict[str, str] | None = None) -> dict[str, Any]:
    """Download, train, upload; return what was uploaded (keys and sha256) and the shards' sha256."""
    work = work_folder(work_dir, job)
    data = work / "data"
    shards = []
    for shard in job["shards"]:
        loc_bucket = parse_s3_uri(job["tokenization"]["tokens_prefix"], what="tokens prefix").bucket
        dest = data / shard["key"].rsplit("/", 1)[-1]
        sha = _download(client, loc_bucket, shard["key"], dest)
        shards.append({**shard, "sha256": sha, "path": str(dest)})
    logger.info("downloaded %d SpecForge file(s) (%d bytes) to %s", len(shards), sum(s["size"] for s in shards), data)
    target = fetch_target(client, job["target_model"], work)
    out = work / "out"
    cfg = {"target_model": target, "train_files": [s["path"] for s in shards], "output_dir": str(out),
           **job["hyperparameters"], "save_every": job["save_every"]}
    cfg_path = work / "cfg.json"
    cfg_path.write_text(json.dumps(cfg, indent=1, sort_keys=True))
    run_entry(python, entry, cfg_path, env=env)
    uploaded = upload_outputs(client, job, out)
    return {"name": job["name"], "uploaded": uploaded, "shards": [{k: v for k, v in s.items() if k != "path"}
                                                                 for s in shards]}


def run_entry(python: str, entry: str, cfg_path: Path, env: dict[str, str] | None = None) -> None:
    """Run the entry; every line it prints goes to the task log as it comes."""
    cmd = [python, entry, "--config", str(cfg_path)]
    logger.info("trainer: %s", " ".join(cmd))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                            env={**os.environ, **(env or {})})
    assert proc.stdout is not None
    tail: list[str] = []
    for line in proc.stdout:
        line = line.rstrip("\n")
        logger.info("trainer | %s", line)
        tail = (tail + [line])[-20:]
    rc = proc.wait()
    if rc == EXIT_OTHER_CONFIG:
        raise ConfigError(f"the trainer refused: its output dir {cfg_path.parent / 'out'} holds a train with another "
                          f"config (exit {rc}); last lines: {tail[-5:]}")
    if rc != 0:
        raise TrainFailed(f"the trainer exited with {rc}; last lines:\n" + "\n".join(tail))


def upload_outputs(client: Any, job: dict[str, Any], out: Path) -> dict[str, str]:
    """drafter/* and train_log.json to their fixed keys under the drafter's prefix; {key: sha256}."""
    drafter = out / "drafter"
    missing = [f for f in DRAFTER_FILES_REQUIRED if not (drafter / f).is_file()]
    if missing or not (out / TRAIN_LOG).is_file():
        raise TrainFailed(f"the trainer exited 0 but {out} lacks {[f'drafter/{m}' for m in missing]}"
                          f"{'' if (out / TRAIN_LOG).is_file() else ' and ' + TRAIN_LOG}")
    loc = parse_s3_uri(job["prefix"].rstrip("/"), what="drafter prefix")
    store = Store(client, loc.bucket)
    files = sorted(p for p in drafter.rglob("*") if p.is_file()) + [out / TRAIN_LOG]
    uploaded: dict[str, str] = {}
    for path in files:
        rel = path.relative_to(out).as_posix()
        key = f"{loc.key}/{rel}"
        ctype = "application/json" if path.suffix == ".json" else "application/octet-stream"
        with path.open("rb") as fh:
            upload_file(store, key, fh, ctype)
        uploaded[key] = hashlib.sha256(path.read_bytes()).hexdigest()
    logger.info("uploaded %d file(s) under %s", len(uploaded), job["prefix"])
    return uploaded
