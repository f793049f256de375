"""The drafter name's claim and the card's conditional write against a real S3 protocol server (moto over HTTP):
one name never holds two drafters, whichever order retries, reruns and concurrent runs come in."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from dflash_pipeline.steps.train.card import write_card
from dflash_pipeline.steps.train.checks import TrainRefused, claim_job, settings_hash


def _job(bucket: str, name: str, steps: int, backend: str = "local") -> dict[str, Any]:
    settings = {"dataset_uri": f"s3://{bucket}/ds", "hyperparameters": {"steps": steps}}
    return {"name": name, "prefix": f"s3://{bucket}/drafters/{name}/", "settings": settings,
            "settings_hash": settings_hash(settings), "dataset": {"uri": f"s3://{bucket}/ds"}, "shards": [],
            "heldout": {"fraction": 0.1}, "tokenization": {"name": "default"}, "target_model": "t",
            "backend": backend, "save_every": 1, "hyperparameters": {"steps": steps}, "status": None}


def _put(client: Any, bucket: str, key: str, body: bytes = b"x") -> None:
    client.put_object(Bucket=bucket, Key=key, Body=body)


def test_concurrent_claims_with_other_settings_leave_one_owner(s3_client: Any, bucket: str) -> None:
    jobs = [_job(bucket, "d", steps) for steps in (10, 20, 10, 20)]
    with ThreadPoolExecutor(4) as pool:
        outcomes = list(pool.map(lambda j: _try(lambda: claim_job(s3_client, j)["status"]), jobs))
    winner = json.loads(s3_client.get_object(Bucket=bucket, Key="drafters/d/settings.json")["Body"].read())
    won = winner["hyperparameters"]["steps"]
    assert [o for j, o in zip(jobs, outcomes) if j["hyperparameters"]["steps"] == won] == ["train", "train"]
    assert all(o.startswith("refused") for j, o in zip(jobs, outcomes) if j["hyperparameters"]["steps"] != won)


def _try(fn: Any) -> str:
    try:
        return fn()
    except TrainRefused as exc:
        return f"refused: {exc}"


def test_the_card_is_written_once_over_a_complete_drafter(s3_client: Any, bucket: str) -> None:
    job = claim_job(s3_client, _job(bucket, "c", 5))
    with pytest.raises(RuntimeError, match="files or train_log.json are missing"):
        write_card(s3_client, job)  # nothing uploaded yet: no card over an incomplete drafter
    for rel in ("drafter/config.json", "drafter/model.safetensors"):
        _put(s3_client, bucket, f"drafters/c/{rel}")
    _put(s3_client, bucket, "drafters/c/train_log.json",
         json.dumps({"trainer": "t", "trainer_version": "1", "steps": 5, "loss": [[5, 0.5]]}).encode())
    with ThreadPoolExecutor(2) as pool:  # a retried card task racing its first try
        cards = list(pool.map(lambda _: write_card(s3_client, job), range(2)))
    assert cards[0]["settings_hash"] == cards[1]["settings_hash"] == job["settings_hash"]
    assert claim_job(s3_client, _job(bucket, "c", 5))["status"] == "done"
    with pytest.raises(TrainRefused, match="already used with other settings"):
        claim_job(s3_client, _job(bucket, "c", 6))
    with pytest.raises(TrainRefused, match="card.json holds a drafter trained with other settings"):
        write_card(s3_client, _job(bucket, "c", 6))


def test_a_kubernetes_card_lists_the_pods_checkpoints(s3_client: Any, bucket: str) -> None:
    job = claim_job(s3_client, _job(bucket, "k", 5, backend="kubernetes"))
    with pytest.raises(RuntimeError, match="the pod left no file"):
        write_card(s3_client, job)
    _put(s3_client, bucket, "drafters/k/checkpoints/epoch_0_step_5/model.safetensors")
    card = write_card(s3_client, job)
    assert list(card["files"]) == ["drafters/k/checkpoints/epoch_0_step_5/model.safetensors"]
    assert card["trainer"] == {"name": None, "version": None} and card["training"]["loss"] is None
