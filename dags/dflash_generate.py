"""
### dflash_generate

Regenerate every completion of a prompt set with the target reasoning model on a fleet of SGLang
servers (one per GPU), writing drafter training data to S3.

`plan` checks the prompt file and splits it into chunks → `preflight` checks every server →
`generate` (one mapped task per server; chunks move to whichever server has free slots; each part's
digest and live quality figures are computed as it lands) → `digest_parts` (mapped: the digests still
missing) → `validate_and_count` merges the digests, checks that every prompt is present exactly once and
counts tokens. `near_duplicates` searches the plan's prompts beside generation.

Rerunning into the same `output_uri` only does what is missing. Running it: README.md; outputs and
their layout: docs/architecture.md; every param: docs/params.md.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from airflow.sdk import TriggerRule, dag, get_current_context, task

from dflash_pipeline.config import ESSENTIAL_PARAMS, PARAM_SCHEMAS
from dflash_pipeline.tasks import completions_asset, on_task_failure, on_task_retry, params_from

# Params are built from the package's schemas: one source for the UI form, the CLI and the tests.
PARAMS = params_from(PARAM_SCHEMAS, ESSENTIAL_PARAMS)


@dag(
    dag_id="dflash_generate",
    schedule=None,
    catchup=False,
    params=PARAMS,
    tags=["dflash", "sglang", "training-data"],
    doc_md=__doc__,
    max_active_runs=4,
    default_args={
        "retries": 2,
        "retry_delay": timedelta(seconds=30),
        "retry_exponential_backoff": True,
        "max_retry_delay": timedelta(minutes=10),
        # Each failed try's reason is recorded for the run's page (tasks.on_task_failure).
        "on_failure_callback": on_task_failure,
        "on_retry_callback": on_task_retry,
    },
)
def dflash_generate() -> None:
    @task
    def plan() -> dict[str, Any]:
        from dflash_pipeline import tasks

        ctx = get_current_context()
        return tasks.plan(ctx["params"], ctx["run_id"])

    @task
    def preflight(plan_info: dict[str, Any]) -> list[dict[str, Any]]:
        from dflash_pipeline import tasks

        ctx = get_current_context()
        return tasks.preflight(ctx["params"], ctx["run_id"])

    @task(retries=3, retry_delay=timedelta(seconds=20))
    def generate(server: dict[str, Any]) -> dict[str, Any]:
        from dflash_pipeline import tasks

        ctx = get_current_context()
        ti = ctx["ti"]
        return tasks.generate(ctx["params"], ctx["run_id"], server, ti.map_index, ti.try_number)

    # On success the hand-off asset gets an event naming the dataset (dags/dflash_tokenize.py consumes it).
    @task(trigger_rule=TriggerRule.ALL_DONE, retries=1, outlets=[completions_asset()])
    def validate_and_count() -> dict[str, Any]:
        from dflash_pipeline import tasks

        ctx = get_current_context()
        return tasks.validate(ctx["params"], ctx["outlet_events"], ctx["run_id"])

    @task(retries=1)
    def near_duplicates(plan_info: dict[str, Any]) -> dict[str, Any]:
        from dflash_pipeline import tasks

        return tasks.near_duplicates(get_current_context()["params"])

    @task
    def digest_shards(plan_info: dict[str, Any]) -> list[int]:
        from dflash_pipeline import tasks

        return tasks.digest_shards(get_current_context()["params"])

    @task(trigger_rule=TriggerRule.ALL_DONE, retries=1)
    def digest_parts(shard: int) -> dict[str, Any]:
        from dflash_pipeline import tasks

        return tasks.digest_parts(get_current_context()["params"], shard)

    planned = plan()
    servers = preflight(planned)
    # ALL_DONE: a server lost for good fails its own task, but the others finished its work, so the
    # dataset is judged on its contents. Validation fails if anything is missing; it computes the
    # near-duplicates and any digest itself when their tasks failed.
    digests = digest_parts.expand(shard=digest_shards(planned))
    validate = validate_and_count()
    generated = generate.expand(server=servers)
    generated >> digests >> validate
    # Directly too: a backfill that clears only the failed generate tasks and validation (digests and
    # near-duplicates stay done) must still validate after generation, not beside it.
    generated >> validate
    near_duplicates(planned) >> validate


dflash_generate()
