"""
### dflash_eval

Measures speculative-decoding drafters on held-out prompts (or a benchmark file): each drafter is a
group of servers serving the same target with one speculative configuration, plus an optional
baseline group without speculation.

`prepare` finds the prompts and plans + preflights one generate dataset per (group, condition) under
`<output_uri>/<group>/<condition>/` → `evaluate` (one mapped task per server; each runs its group's
conditions in turn with the generate step's dispatch, scraping the server's `/metrics` around each)
→ `report` writes `report.json`, `report.md` and `report-acceptance.png` at `output_uri` and emits
the `dflash_eval` asset event.

Trigger (the only required params are `output_uri`, `drafters` and one of `dataset_uri` /
`prompts_uri`):

    airflow dags trigger dflash_eval --conf '{
      "prompts_uri": "s3://bucket/bench/mt-bench.jsonl",
      "output_uri": "s3://bucket/evals/qwen3-8b-2026-12",
      "drafters": [{"name": "dflash", "servers": ["http://gpu0:30000"]},
                   {"name": "eagle3", "servers": ["http://gpu1:30000"]}],
      "baseline": {"name": "no-spec", "servers": ["http://gpu2:30000"]},
      "max_tokens": 2048, "concurrency": [1], "greedy": true, "max_prompts": 200}'

Conditions: production sampling (`temperature`, `top_p`) and, with `greedy`, temperature 0; each
thinking mode of `thinking_modes`; each entry of `concurrency` (integers, or "production" = the
in-flight limit generate discovers). A rerun with the same conf only does what is missing.
Figures and their definitions: docs/evaluation.md.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from airflow.sdk import TriggerRule, dag, get_current_context, task

from dflash_pipeline.config import EVAL_ESSENTIAL_PARAMS, EVAL_PARAM_SCHEMAS
from dflash_pipeline.tasks import eval_asset, on_task_failure, on_task_retry, params_from

PARAMS = params_from(EVAL_PARAM_SCHEMAS, EVAL_ESSENTIAL_PARAMS)


@dag(
    dag_id="dflash_eval",
    schedule=None,
    catchup=False,
    params=PARAMS,
    tags=["dflash", "speculative-decoding", "eval"],
    doc_md=__doc__,
    max_active_runs=2,
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
def dflash_eval() -> None:
    @task
    def prepare() -> list[dict[str, Any]]:
        from dflash_pipeline import tasks

        ctx = get_current_context()
        return tasks.eval_prepare(ctx["params"], ctx["run_id"])

    @task(retries=3, retry_delay=timedelta(seconds=20))
    def evaluate(assignment: dict[str, Any]) -> dict[str, Any]:
        from dflash_pipeline import tasks

        ctx = get_current_context()
        return tasks.eval_server(ctx["params"], ctx["run_id"], assignment, ctx["ti"].try_number)

    # ALL_DONE: the report shows what was measured even when a server's task failed; it fails
    # (and emits no event) when a condition misses rows.
    @task(trigger_rule=TriggerRule.ALL_DONE, retries=1, outlets=[eval_asset()])
    def report(assignments: list[dict[str, Any]]) -> dict[str, Any]:
        from dflash_pipeline import tasks

        ctx = get_current_context()
        return tasks.eval_report(ctx["params"], ctx["run_id"], assignments, ctx["outlet_events"])

    assignments = prepare()
    evaluate.expand(assignment=assignments) >> report(assignments)


dflash_eval()
