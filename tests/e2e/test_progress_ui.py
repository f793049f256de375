"""The progress page plugin in a real Airflow: listed, authenticated, right figures, seen in a browser.

One dflash_generate run (two simulated servers, ~30 s of generation) is followed through the
plugin's JSON endpoint while it runs and after it finished; the browser test logs in through
Airflow's login page and looks at the finished run's page, its DAG-run tab and the trigger form.
Screenshots go to artifacts/ (git-ignored); docs/progress-page.png is written when missing or
with UPDATE_DOCS_SCREENSHOTS=1.
"""

from __future__ import annotations

import json
import re
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import requests

from dflash_pipeline.dev.browser import CHROMIUM, CHROMIUM_ARGS, VIEWPORT, wait_for_plots
from dflash_pipeline.dev.stack import AirflowStack, MotoServer

pytestmark = pytest.mark.slow

DAG = "dflash_generate"
REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "artifacts"
DOCS_SHOT = REPO / "docs" / "progress-page.png"
N = 800
SAVE_EVERY = 50

_finished: dict[str, Any] = {}


@pytest.fixture(scope="module")
def ui_bucket(moto_server: MotoServer) -> Iterator[str]:
    """A bucket kept for the whole module (the browser test reads the run the first test made)."""
    name = f"ui-{uuid.uuid4().hex[:12]}"
    moto_server.create_bucket(name)
    yield name
    client = moto_server.client()
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=name):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=name, Delete={"Objects": keys})
    client.delete_bucket(Bucket=name)


@pytest.fixture(scope="module")
def ui_fleet() -> Iterator[Any]:
    from dflash_pipeline.dev.sim import SimFleet

    fleet = SimFleet.uniform(2, token_time_s=0.005, length_scale=0.05, max_running_requests=8).start()
    yield fleet
    fleet.stop()


def _run_path(run_id: str) -> str:
    return f"{quote(DAG, safe='')}/{quote(run_id, safe='')}"


def _view(stack: AirflowStack, run_id: str) -> dict[str, Any]:
    resp = stack.rest("GET", f"/dflash/api/runs/{_run_path(run_id)}", timeout_s=120)  # a loaded 2-core runner
    assert resp.status_code == 200, resp.text[:500]
    return dict(resp.json())


def _start_run(stack: AirflowStack, s3: Any, bucket: str, fleet: Any) -> tuple[str, dict[str, Any]]:
    body = "\n".join(json.dumps({"id": f"ui-{i}", "prompt": f"ui question {i}: what is {i} plus {i * 7}?"})
                     for i in range(N))
    s3.put_object(Bucket=bucket, Key="p/ui.jsonl", Body=body.encode())
    conf = {"prompts_uri": f"s3://{bucket}/p/ui.jsonl", "output_uri": f"s3://{bucket}/ds/ui",
            "servers": fleet.urls, "save_every": SAVE_EVERY}
    stack.wait_dag(DAG)
    run_id = f"manual__ui_{uuid.uuid4().hex[:8]}"
    resp = stack.rest("POST", f"/api/v2/dags/{DAG}/dagRuns", json={"dag_run_id": run_id, "logical_date": None,
                                                                  "conf": conf})
    assert resp.status_code in (200, 201), resp.text[:1000]
    return run_id, conf


def _finished_run(stack: AirflowStack, s3: Any, bucket: str, fleet: Any) -> str:
    if "run_id" not in _finished:
        run_id, _ = _start_run(stack, s3, bucket, fleet)
        assert stack.wait_run(DAG, run_id, timeout_s=400) == "success"
        _finished["run_id"] = run_id
    return str(_finished["run_id"])


def _tokenize_run(stack: AirflowStack, generate_run: str) -> str:
    """dflash_tokenize of the finished dataset, triggered by hand so that every row is dropped (min_loss_tokens
    100000; with the sim tokenizer the rows' ids are already refused as differing from the engine's counts),
    for a reason the table names; the gate then fails the run after writing its report, which the page shows."""
    from dflash_pipeline.dev.sim.tokenizer import build_sim_tokenizer

    view = _view(stack, generate_run)
    tok = build_sim_tokenizer(ARTIFACTS / "sim-tokenizer")
    stack.wait_dag("dflash_tokenize")
    run_id = f"manual__tok_{uuid.uuid4().hex[:8]}"
    conf = {"output_uri": view["output_uri"], "tokenizer": str(tok), "min_kept_share": 0.0, "drop_quality": [],
            "min_loss_tokens": 100000, "tokenization": "ui-drops"}
    resp = stack.rest("POST", "/api/v2/dags/dflash_tokenize/dagRuns", json={"dag_run_id": run_id,
                                                                           "logical_date": None, "conf": conf})
    assert resp.status_code in (200, 201), resp.text[:1000]
    stack.wait_run("dflash_tokenize", run_id, timeout_s=400)
    return run_id


def test_airflow_lists_the_plugin(airflow_stack: AirflowStack) -> None:
    res = airflow_stack.cli("plugins", "--output", "json")
    assert res.returncode == 0, res.stderr[-2000:]
    plugins = {p["name"]: p for p in json.loads(res.stdout[res.stdout.index("["):])}
    assert "dflash_progress" in plugins, res.stdout[-2000:]
    shown = json.dumps(plugins["dflash_progress"])
    assert "/dflash" in shown and "dag_run" in shown


def test_endpoints_follow_a_run_and_refuse_anonymous_requests(
    airflow_stack: AirflowStack, moto_server: MotoServer, ui_bucket: str, ui_fleet: Any
) -> None:
    s3 = moto_server.client()
    run_id, _ = _start_run(airflow_stack, s3, ui_bucket, ui_fleet)
    base = f"{airflow_stack.url}/dflash"

    # Nobody logged in: refused, whatever the route; a browser is offered Airflow's login.
    for path in ("/", f"/runs/{_run_path(run_id)}", f"/api/runs/{_run_path(run_id)}",
                 f"/runs/{_run_path(run_id)}/plots/report-completion-lengths.png"):
        assert requests.get(base + path, timeout=30).status_code == 401, path
    html = requests.get(f"{base}/runs/{_run_path(run_id)}", headers={"Accept": "text/html"}, timeout=30)
    assert html.status_code == 401 and "/auth/login" in html.text and 'id="run-progress"' not in html.text
    bad = requests.get(f"{base}/api/runs/{_run_path(run_id)}", headers={"Authorization": "Bearer not-a-jwt"},
                       timeout=30)
    assert bad.status_code in (401, 403)
    assert airflow_stack.rest("GET", f"/dflash/api/runs/{DAG}/no-such-run").status_code == 404

    # While it runs: the servers report, done counts only what is finished, and there is an ETA.
    seen: dict[str, Any] | None = None
    live_seen: dict[str, Any] | None = None  # issue 40: live quality figures while the run generates
    deadline = time.monotonic() + 300
    while seen is None or live_seen is None:
        view = _view(airflow_stack, run_id)
        p = view["progress"]
        if view["run_state"] in ("success", "failed") or time.monotonic() > deadline:
            pytest.fail(f"never saw the run in progress{' (progress)' if seen is None else ''}"
                        f"{' (live quality)' if live_seen is None else ''}: {json.dumps(view)[:2000]}")
        lq = view.get("live_quality") or {}
        if live_seen is None and lq.get("overall", {}).get("completions") and p and p["prompts_done"] < N:
            live_seen = view
        live = [s for s in (p or {}).get("servers", []) if s["state"] == "running"]
        if seen is None and p and len(live) == 2 and 0 < p["prompts_done"] < N and p["eta_s"] is not None:
            seen = view
            committed = s3.list_objects_v2(Bucket=ui_bucket, Prefix="ds/ui/completions/").get("KeyCount", 0)
        else:
            time.sleep(1.0)
    p = seen["progress"]
    manifest = json.loads(s3.get_object(Bucket=ui_bucket, Key="ds/ui/manifest.json")["Body"].read())
    assert p["prompts_total"] == N and p["chunks_total"] == len(manifest["chunks"]["sizes"])
    assert p["prompts_committed"] <= committed * SAVE_EVERY
    assert p["prompts_done"] == p["prompts_committed"] + p["prompts_pending_commit"]
    assert p["output_tokens_per_s"] > 0 and p["eta_s"] > 0 and p["in_flight"] > 0
    assert sorted(s["server"] for s in p["servers"]) == sorted(ui_fleet.urls)
    assert len(p["series"]["t"]) >= 1 and seen["report"] is None
    # Live quality (issue 40): each rate with the rows it is over, per server and per thinking mode.
    lq = live_seen["live_quality"]
    assert 0 < lq["overall"]["completions"] < N and lq["overall"]["truncated"]["rows"] == lq["overall"]["completions"]
    assert set(lq["by_server"]) <= set(ui_fleet.urls) and set(lq["by_thinking"]) == {"on"}
    assert lq["overall"]["loop"]["rate"] is not None
    fragment = airflow_stack.rest("GET", f"/dflash/runs/{_run_path(run_id)}", params={"fragment": 1})
    assert fragment.status_code == 200 and 'id="run-progress"' in fragment.text and 'data-final="0"' in fragment.text

    # Finished: everything done, per-server rows add up, the report and its plots are served.
    assert airflow_stack.wait_run(DAG, run_id, timeout_s=400) == "success"
    _finished["run_id"] = run_id
    view = _view(airflow_stack, run_id)
    p = view["progress"]
    assert (p["prompts_done"], p["prompts_remaining"], p["fraction_done"], p["errors"]) == (N, 0, 1.0, 0)
    assert sum(s["completions"] for s in p["servers"]) == N
    assert {s["state"] for s in p["servers"]} == {"done"}
    report = view["report"]
    assert report["status"] == "passed" and report["prompts"] == N and report["completions"] == N
    assert view["plot_urls"], "validation wrote plots"
    for plot in view["plot_urls"]:
        resp = airflow_stack.rest("GET", plot["href"])
        assert resp.status_code == 200 and resp.headers["content-type"] == "image/png"
        assert resp.content[:8] == b"\x89PNG\r\n\x1a\n"
    md = airflow_stack.rest("GET", view["report_md_url"])
    assert md.status_code == 200 and "dflash-pipeline report" in md.text
    rendered = airflow_stack.rest("GET", view["report_url"])
    assert rendered.status_code == 200 and rendered.headers["content-type"].startswith("text/html")
    assert "<h1>dflash-pipeline report" in rendered.text and "<table>" in rendered.text
    # The throughput series spans the run from its start and has every server, busy mid-run.
    series = p["series"]
    assert series["span_s"] >= 20 and len(series["t"]) >= 10, series
    assert sorted(x["server"] for x in series["servers"]) == sorted(ui_fleet.urls)
    for x in series["servers"]:
        assert max(x["values"]) > 0 and sum(1 for v in x["values"] if v > 0) >= 5, x
    assert airflow_stack.rest("GET", f"/dflash/runs/{_run_path(run_id)}/plots/..%2Fmanifest.json").status_code == 404
    page = airflow_stack.rest("GET", f"/dflash/runs/{_run_path(run_id)}")
    assert page.status_code == 200 and 'data-final="1"' in page.text and 'id="report"' in page.text


def test_browser_logs_in_and_sees_the_finished_run(
    airflow_stack: AirflowStack, moto_server: MotoServer, ui_bucket: str, ui_fleet: Any
) -> None:
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is missing: run scripts/ci_system_deps.sh (apt-get install -y chromium)")
    from playwright.sync_api import sync_playwright

    run_id = _finished_run(airflow_stack, moto_server.client(), ui_bucket, ui_fleet)
    url = airflow_stack.url
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport=VIEWPORT)
            page.set_default_timeout(60_000)
            # Not logged in: the plugin refuses and offers Airflow's login.
            page.goto(f"{url}/dflash/runs/{_run_path(run_id)}")
            assert page.locator("#run-progress").count() == 0
            page.get_by_role("link", name="Log in to Airflow").click()
            page.get_by_label("Username").fill(airflow_stack.username)
            page.get_by_label("Password").fill(airflow_stack.password)
            page.get_by_role("button", name="Sign in").click()
            page.wait_for_url(f"{url}/dflash/runs/**")  # back where the login was asked for
            page.wait_for_selector("#run-progress")
            assert page.locator("#run-progress").get_attribute("aria-valuenow") == str(N)
            assert page.locator(".server-progress").count() == 2
            assert page.locator("#report .badge").first.inner_text() == "passed"
            wait_for_plots(page)
            # The throughput chart: a line per server plus the fleet's, time ticks from 0.
            assert page.locator("#throughput polyline.server-line").count() == 2
            assert page.locator("#throughput .xtick").first.text_content() == "0"
            assert page.locator("#throughput .xtick").count() >= 3
            # Issue 40: the live quality figures and the report's quality section.
            assert page.locator("#live-quality table.live-quality tr").count() >= 4  # head, all, 2 servers
            assert "of " in page.locator("#live-quality table.live-quality").inner_text()
            assert page.locator("#quality table.quality-flags").inner_text().count("loop_") == 2
            page.screenshot(path=str(ARTIFACTS / "progress-page.png"), full_page=True)
            if not DOCS_SHOT.exists() or os.environ.get("UPDATE_DOCS_SCREENSHOTS") == "1":
                page.screenshot(path=str(DOCS_SHOT), full_page=True)

            # The full report, rendered from report.md (not served as raw Markdown).
            page.locator("#report-link").click()
            page.wait_for_selector("#report-md table")
            assert page.locator("#report-md h1").inner_text().startswith("dflash-pipeline report")
            page.screenshot(path=str(ARTIFACTS / "report-page.png"), full_page=True)

            # The same page as a tab of the DAG run in Airflow's UI (an iframe, same cookie).
            page.goto(f"{url}/dags/{DAG}/runs/{quote(run_id, safe='')}/plugin/dflash-progress")
            page.frame_locator("iframe").locator("#run-progress").wait_for()
            page.get_by_text("DFlash progress").first.wait_for()
            page.screenshot(path=str(ARTIFACTS / "progress-tab.png"))

            # A dflash_tokenize run's page: what it dropped, by reason (it showed an error before issue 40).
            tok_run = _tokenize_run(airflow_stack, run_id)
            page.goto(f"{url}/dflash/runs/dflash_tokenize/{quote(tok_run, safe='')}")
            page.wait_for_selector("#tokenize")
            assert page.locator("#dflash-main .err").count() == 0
            page.locator("#tokenize table.tokenize-drops").wait_for()
            drops = page.locator("#tokenize table.tokenize-drops").inner_text()
            assert re.search(r"\n[a-z_:]+\t800\ton: 800", drops), drops  # every row dropped, for a named reason
            page.screenshot(path=str(ARTIFACTS / "tokenize-page.png"), full_page=True)

            # The trigger form: the essentials in the section Airflow opens at load (no click), the
            # rest folded into "Advanced: <section>" items (config.run.form_layout).
            page.goto(f"{url}/dags/{DAG}")
            page.get_by_role("button", name="Trigger").first.click()
            dialog = page.get_by_role("dialog")
            for section in ("Run Parameters", "Advanced: Data", "Advanced: Servers", "Advanced: Sampling",
                            "Advanced: Run control", "Advanced: Validation"):
                dialog.get_by_text(section, exact=True).wait_for()
            dialog.get_by_text("dataset root. It is the resume key", exact=False).wait_for()
            assert not dialog.get_by_text("How long a chunk claimed by a task", exact=False).is_visible()
            dialog.get_by_text("Advanced: Run control", exact=True).click()
            dialog.get_by_text("How long a chunk claimed by a task", exact=False).wait_for()
            page.screenshot(path=str(ARTIFACTS / "trigger-form.png"), full_page=True)
        finally:
            browser.close()
