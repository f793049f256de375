"""
### dflash_tokenize

Turns a validated dataset into what a drafter trainer reads: one training row per generated assistant
turn (`input_ids`, `loss_mask` on exactly the generated tokens), written per completions part, exactly
once, as one file per chosen profile: `tokenized/parquet/part-NNNNNN.parquet` (every column),
`tokenized/specforge/part-NNNNNN.jsonl` + `tokenized/specforge-conversations/part-NNNNNN.jsonl`
(SpecForge), `tokenized/speculators/part-NNNNNN.jsonl` (vLLM speculators). A part is committed by
`tokenized/stats/part-NNNNNN.json`, written last.

Scheduled on the `dflash_completions` asset (every validated `dflash_generate` run queues it, the
event names the dataset); triggered by hand it tokenizes the dataset named by `output_uri`.
`prepare` checks the hand-off and the tokenizer and splits the parts among `workers` →
`tokenize` (one mapped task per worker; parts already written are skipped) → `report` writes
`tokenized/report.json` + `.md` and emits the `dflash_tokenized` asset event.
`answers: original` tokenizes the input's own answers (`original_messages`) instead, as a named tokenization:
the baseline a drafter trained on the regenerated answers is measured against.
Params, rules and layout: docs/tokenize.md; training on the files: docs/trainers.md.
"""

from __future__ import annotations

from typing import Any

from airflow.sdk import dag, get_current_context, task

from dflash_pipeline.config import TOKENIZE_ESSENTIAL_PARAMS, TOKENIZE_PARAM_SCHEMAS
from dflash_pipeline.tasks import completions_asset, on_task_failure, on_task_retry, params_from, tokenized_asset

PARAMS = params_from(TOKENIZE_PARAM_SCHEMAS, TOKENIZE_ESSENTIAL_PARAMS)


@dag(
    dag_id="dflash_tokenize",
    schedule=[completions_asset()],
    catchup=False,
    tags=["dflash", "training-data", "tokenize"],
    doc_md=__doc__,
    default_args={"retries": 1, "on_failure_callback": on_task_failure, "on_retry_callback": on_task_retry},
    params=PARAMS,
)
def dflash_tokenize() -> None:
    @task(inlets=[completions_asset()])
    def prepare() -> list[dict[str, Any]]:
        from dflash_pipeline import tasks

        ctx = get_current_context()
        return tasks.tokenize_prepare(ctx["params"], ctx.get("triggering_asset_events"))

    @task(retries=2)
    def tokenize(assignment: dict[str, Any]) -> dict[str, Any]:
        from dflash_pipeline import tasks

        return tasks.tokenize_worker(get_current_context()["params"], assignment)

    @task(outlets=[tokenized_asset()])
    def report(assignments: list[dict[str, Any]]) -> list[dict[str, Any]]:
        from dflash_pipeline import tasks

        ctx = get_current_context()
        return tasks.tokenize_report(ctx["params"], assignments[0]["datasets"], ctx["outlet_events"])

    assignments = prepare()
    tokenize.expand(assignment=assignments) >> report(assignments)


dflash_tokenize()
