"""
### dflash_tokenize (example consumer)

Runs whenever `dflash_generate` validated a dataset: it is scheduled on the
`dflash_completions` asset, whose events carry the dataset's `output_uri`, `manifest_key`,
`report_key` and headline counts. This example only checks the hand-off (manifest and a passed
report exist, the counts agree); a real tokenization step starts from the same fields.

Triggered by hand, it checks the dataset named by the `output_uri` param instead.
"""

from __future__ import annotations

from typing import Any

from airflow.sdk import Param, dag, get_current_context, task

from dflash_pipeline.tasks import completions_asset


@dag(
    dag_id="dflash_tokenize",
    schedule=[completions_asset()],
    catchup=False,
    tags=["dflash", "training-data", "consumer"],
    doc_md=__doc__,
    default_args={"retries": 1},
    params={
        "aws_conn_id": Param("aws_default", type="string", minLength=1,
                             description="Airflow connection id (type aws) of the datasets' S3 store."),
        "output_uri": Param(None, type=["null", "string"],
                            description="Manual runs only: the dataset root to check (asset runs use the event)."),
    },
)
def dflash_tokenize() -> None:
    @task(inlets=[completions_asset()])
    def check_handoff() -> list[dict[str, Any]]:
        from airflow.sdk.exceptions import AirflowFailException

        from dflash_pipeline import tasks
        from dflash_pipeline.steps import handoff

        ctx = get_current_context()
        events = ctx["triggering_asset_events"].get(completions_asset(), []) if ctx.get("triggering_asset_events") else []
        extras = handoff.extras_from_events(events)
        if not extras and ctx["params"].get("output_uri"):
            extras = [{"output_uri": ctx["params"]["output_uri"]}]
        if not extras:
            raise AirflowFailException("no dflash_completions asset event and no output_uri param: nothing to check")
        client = tasks.s3_client(ctx["params"]["aws_conn_id"])
        try:
            return [dict(handoff.check_handoff(client, extra), event=extra) for extra in extras]
        except handoff.HandoffError as exc:
            raise AirflowFailException(f"HandoffError: {exc}") from exc

    check_handoff()


dflash_tokenize()
