"""Issue 41: a failed try's reason is recorded under the run (moto over HTTP) and the run's page shows it;
after a failed plan the page says the plan failed, not "No plan yet"."""

from __future__ import annotations

from typing import Any

from dflash_pipeline.dataset.layout import DatasetLayout
from dflash_pipeline.dataset.store import Store
from dflash_pipeline.monitor import ui
from dflash_pipeline.monitor.failures import failure_doc, read_failures, record_failure


class ConfigError(ValueError):
    pass


def _view(failures: list[dict[str, Any]]) -> dict[str, Any]:
    return {"dag_id": "dflash_generate", "run_id": "r1", "run_state": "failed", "output_uri": "s3://b/ds",
            "tasks": [], "failures": failures, "progress": None, "report": None}


def test_each_tasks_latest_try_is_read_back_failed_first(s3_client: Any, bucket: str) -> None:
    layout = DatasetLayout.from_uri(f"s3://{bucket}/ds/failing")
    store = Store(s3_client, bucket)
    wrong = ConfigError("param sampling_extra: unknown sampling key 'top_kk'; accepted keys are [...]")
    record_failure(store, layout, "r1", failure_doc("generate", 1, 1, "up_for_retry", RuntimeError("HTTP 401")))
    record_failure(store, layout, "r1", failure_doc("generate", 1, 2, "failed", RuntimeError("HTTP 401 again")))
    record_failure(store, layout, "r1", failure_doc("plan", -1, 1, "failed", wrong))
    record_failure(store, layout, "r1", failure_doc("plan", -1, 1, "failed", wrong))  # a callback run twice
    record_failure(store, layout, "r2", failure_doc("plan", -1, 1, "failed", RuntimeError("another run")))
    got = read_failures(store, layout, "r1")
    assert [(f["task_id"], f["map_index"], f["try_number"]) for f in got] == [("generate", 1, 2), ("plan", -1, 1)]
    assert got[1]["error_class"] == "ConfigError" and "unknown sampling key 'top_kk'" in got[1]["message"]


def test_the_page_shows_the_reason_and_says_the_plan_failed() -> None:
    doc = failure_doc("plan", -1, 1, "failed", ConfigError("prompts_uri s3://b/p.jsonl does not exist"))
    html = ui.run_main(_view([doc]))
    assert "Why it failed" in html and "prompts_uri s3://b/p.jsonl does not exist" in html
    assert "No plan yet" not in html and "the plan task failed" in html
    retried = failure_doc("generate", 0, 1, "up_for_retry", RuntimeError("reset"))
    html = ui.run_main(_view([retried]))
    assert "will be retried" in html and "No plan yet" in html  # a plan that has not run yet


def test_a_page_without_failures_has_no_section() -> None:
    assert "Why it failed" not in ui.run_main(_view([]))
