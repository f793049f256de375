"""
### dflash_train

Trains a DFlash drafter for the dataset's target on one named tokenization of one dataset (its SpecForge
files), with SpecForge's DFlash training, and writes it under `<drafters_root>/<name>/` with its card.

`check` does every check before any work: the tokenization exists and is complete, the dataset has a held-out
split, the drafter name is free or claimed with the same settings (then the train resumes, or does nothing once
the card exists); on kubernetes it also builds and checks the pod spec. Then one of:

- `train_local` (backend `local`; one mapped task per drafter): the trainer as a subprocess in the trainers'
  venv on this worker (CPU), its log streamed here, `drafter/` + `train_log.json` uploaded;
- `train_pod` (backend `kubernetes`; one mapped task per drafter running the cncf.kubernetes provider's
  KubernetesPodOperator): SpecForge's `scripts/train_dflash.py` under torchrun on the GPUs of a pod
  (`kubernetes_*` params),

(`local_jobs` / `pod_specs` hand each its list; the other backend's task is skipped)

→ `card` writes `card.json` last (If-None-Match) and emits the `dflash_drafter` asset event.

Scheduled on the `dflash_tokenized` asset (a drafter per tokenization an event names, default settings);
triggered by hand:

    airflow dags trigger dflash_train --conf '{"dataset_uri": "s3://bucket/datasets/qwen3-8b-2026-12",
      "tokenization": "default", "drafter_name": "qwen3-8b-dflash-a", "steps": 20000}'

Params, card and routes: docs/train.md.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from airflow.sdk import TriggerRule, dag, get_current_context, task

from dflash_pipeline.config import TRAIN_ESSENTIAL_PARAMS, TRAIN_PARAM_SCHEMAS
from dflash_pipeline.tasks import drafter_asset, params_from, tokenized_asset

PARAMS = params_from(TRAIN_PARAM_SCHEMAS, TRAIN_ESSENTIAL_PARAMS)


@dag(
    dag_id="dflash_train",
    schedule=[tokenized_asset()],
    catchup=False,
    params=PARAMS,
    tags=["dflash", "train"],
    doc_md=__doc__,
    max_active_runs=1,
    default_args={"retries": 1, "retry_delay": timedelta(minutes=1)},
)
def dflash_train() -> None:
    @task(inlets=[tokenized_asset()])
    def check() -> dict[str, list[dict[str, Any]]]:
        from dflash_pipeline import tasks

        ctx = get_current_context()
        return tasks.train_check(ctx["params"], ctx.get("triggering_asset_events"))

    # Mapping needs a task's whole return value: these two hand each backend its list (empty = skipped).
    @task
    def local_jobs(checked: dict[str, Any]) -> list[dict[str, Any]]:
        return checked["local"]

    @task
    def pod_specs(checked: dict[str, Any]) -> list[dict[str, Any]]:
        return checked["pods"]

    # A retry resumes from the trainer's state in the same work folder (steps/train/local.py).
    @task(retries=2, retry_delay=timedelta(seconds=20))
    def train_local(job: dict[str, Any]) -> dict[str, Any]:
        from dflash_pipeline import tasks

        return tasks.train_local(get_current_context()["params"], job)

    # The provider's KubernetesPodOperator, built and run inside the task (tasks.train_pod): importing it at
    # parse time costs ~1 s per parse of this file. A retry reattaches to the pod a killed try left running
    # (the provider's `durable`).
    @task(retries=2, retry_delay=timedelta(minutes=1))
    def train_pod(pod: dict[str, Any]) -> None:
        from dflash_pipeline import tasks

        tasks.train_pod(pod, get_current_context())

    @task(trigger_rule=TriggerRule.NONE_FAILED, outlets=[drafter_asset()])
    def card(checked: dict[str, Any], trained: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
        from dflash_pipeline import tasks

        ctx = get_current_context()
        return tasks.train_cards(ctx["params"], checked, list(trained or []), ctx["run_id"], ctx["outlet_events"])

    checked = check()
    local = train_local.expand(job=local_jobs(checked))
    pod = train_pod.expand(pod=pod_specs(checked))
    [local, pod] >> card(checked, local)


dflash_train()
