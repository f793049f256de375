"""regenerate=all_turns and samples_per_prompt through the real Worker, S3 server and simulated servers over HTTP.

The simulators audit the history they receive (`track_history`): every assistant turn in a request
must be an answer that very server generated earlier. So zero foreign history turns proves both
that no original answer was re-sent and that every conversation stayed on one server.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import requests

from test_dispatch import RUN_ID
from test_dispatch import Run as DispatchRun

from dflash_pipeline.config import RunConfig
from dflash_pipeline.dataset.layout import DatasetLayout
from dflash_pipeline.dataset.records import decode_part
from dflash_pipeline.dataset.store import Store
from dflash_pipeline.serving.sglang import ServerSpec, request_seed
from dflash_pipeline.steps.generate import TaskStopped, Worker, WorkerSettings
from dflash_pipeline.steps.plan import run_plan
from dflash_pipeline.steps.preflight import run_preflight
from dflash_pipeline.steps.validate import run_validation

REPO = Path(__file__).resolve().parents[2]
SIM = {"token_time_s": 0.001, "length_scale": 0.02, "max_running_requests": 8, "track_history": True}


def _conversations(n: int) -> bytes:
    """Multi-turn rows with their original answers (2 or 3 assistant turns to regenerate each)."""
    rows = []
    for i in range(n):
        msgs: list[dict[str, str]] = [{"role": "system", "content": f"You are assistant number {i % 7}."}]
        for k in range(2 + i % 2):
            msgs.append({"role": "user", "content": f"Conversation {i}, question {k}: what is {i} times {k + 3}?"})
            msgs.append({"role": "assistant", "content": f"ORIGINAL answer {i}.{k}: it is {i * (k + 3)}."})
        rows.append({"id": f"c{i:04d}", "messages": msgs})
    return ("\n".join(json.dumps(r) for r in rows) + "\n").encode()


class Run(DispatchRun):
    """test_dispatch's Run (settings, workers, run_all) over multi-turn rows in all_turns mode."""

    def __init__(self, s3: Any, bucket: str, urls: list[str], n: int, save_every: int, samples: int) -> None:
        s3.put_object(Bucket=bucket, Key="in/conv.jsonl", Body=_conversations(n))
        self.s3, self.bucket, self.n, self.samples = s3, bucket, n, samples
        self.cfg = RunConfig.from_params({
            "prompts_uri": f"s3://{bucket}/in/conv.jsonl", "output_uri": f"s3://{bucket}/ds", "servers": urls,
            "save_every": save_every, "regenerate": "all_turns", "samples_per_prompt": samples, "seed": 11,
        })
        self.specs = [ServerSpec(u, u) for u in urls]
        run_plan(s3, self.cfg, RUN_ID)
        self.infos = run_preflight(s3, self.cfg, self.specs, RUN_ID)
        self.layout = DatasetLayout.from_uri(self.cfg.output_uri)
        self.store = Store(s3, bucket)
        self.manifest = json.loads(self.store.get(self.layout.manifest_key)[0])

    def rows(self) -> list[dict[str, Any]]:
        out = []
        for obj in self.store.list(self.layout.completions_prefix):
            out += decode_part(self.store.get(obj.key)[0]).to_pylist()
        return out

    def check(self) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        report = run_validation(self.s3, self.cfg.output_uri, plots=False)  # raises unless exactly once
        assert report["prompts"] == self.n * self.samples
        assert report["missing"] == 0 and report["duplicates"] == 0 and report["unexpected_ids"] == 0
        rows = self.rows()
        per_unit = Counter((r["id"], r["sample"]) for r in rows)
        assert len(per_unit) == self.n * self.samples and set(per_unit.values()) == {1}
        return report, rows


def _audit(urls: list[str]) -> list[dict[str, Any]]:
    return [requests.get(f"{u}/sim/stats", timeout=5).json()["conversation"] for u in urls]


def _assert_replayed_on_policy(urls: list[str], rows: list[dict[str, Any]]) -> None:
    audits = _audit(urls)
    assert sum(a["foreign_history_turns"] for a in audits) == 0, audits
    assert sum(a["own_history_turns"] for a in audits) > 0, "no history was sent: the test tested nothing"
    for r in rows:
        assert r["error_class"] is None, r
        originals = {m["content"] for m in r["original_messages"] if m["role"] == "assistant"}
        answers = [m for m in r["conversation"] if m["role"] == "assistant"]
        assert answers and not originals & {m["content"] for m in answers}
        assert len(answers) == len(r["turns"])
        assert [m["content"] for m in r["conversation"] if m["role"] == "user"] == \
            [m["content"] for m in r["original_messages"] if m["role"] == "user"]


@pytest.mark.timeout(90)
def test_all_turns_replays_only_fleet_answers_on_one_server(s3_client: Any, bucket: str, sim_fleet: Any) -> None:
    fleet = sim_fleet(3, **SIM)
    run = Run(s3_client, bucket, fleet.urls, n=120, save_every=10, samples=2)
    results = run.run_all([run.worker(i) for i in range(3)])
    assert all(isinstance(r, dict) for r in results), results
    report, rows = run.check()
    _assert_replayed_on_policy(fleet.urls, rows)
    # 60 conversations with 2 assistant turns and 60 with 3, twice each (cut_short would lower it).
    assert report["turns_generated"] == 2 * (60 * 2 + 60 * 3) - sum(
        len([m for m in r["original_messages"] if m["role"] == "assistant"]) - len(r["turns"]) for r in rows)
    assert report["multi_turn_rows"] == 240 and report["rows_by_sample"] == {"0": 120, "1": 120}
    # The radix cache: every later turn's prefix (the earlier request plus its answer) was cached.
    assert report["cached_prompt_tokens"] > 0
    assert all(r["turns"][1]["cached_tokens"] > 0 for r in rows if len(r["turns"]) > 1)
    assert all(r["completion_tokens"] == sum(t["completion_tokens"] for t in r["turns"]) for r in rows)
    # No conversation was generated twice (exactly one request per turn).
    assert sum(requests.get(f"{u}/sim/stats", timeout=5).json()["generation_requests"] for u in fleet.urls) == \
        report["turns_generated"]


@pytest.mark.timeout(90)
def test_three_samples_per_prompt_three_rows_with_their_own_seeds(s3_client: Any, bucket: str, sim_fleet: Any) -> None:
    fleet = sim_fleet(2, **SIM)
    run = Run(s3_client, bucket, fleet.urls, n=40, save_every=16, samples=3)
    results = run.run_all([run.worker(i) for i in range(2)])
    assert all(isinstance(r, dict) for r in results), results
    _, rows = run.check()
    by_id: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_id.setdefault(r["id"], []).append(r)
    assert len(by_id) == 40 and all(sorted(r["sample"] for r in v) == [0, 1, 2] for v in by_id.values())
    assert all(len({request_seed(11, pid, k) for k in range(3)}) == 3 for pid in by_id)
    # The simulator's answer depends on the request's seed: three samples, three different first answers.
    differ = sum(len({v[k]["conversation"][2]["content"] for k in range(3)}) == 3 for v in by_id.values())
    assert differ == 40


@pytest.mark.timeout(120)
def test_stopped_and_resumed_run_keeps_one_row_per_id_and_sample(s3_client: Any, bucket: str, sim_fleet: Any) -> None:
    fleet = sim_fleet(2, **SIM)
    run = Run(s3_client, bucket, fleet.urls, n=100, save_every=10, samples=2)
    first = run.worker(0)
    box: dict[str, Any] = {}
    t = threading.Thread(target=lambda: box.setdefault("r", _catch(first.run)), daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while first.stats.completions < 40 and time.monotonic() < deadline:
        time.sleep(0.02)
    first.request_stop()  # SIGTERM's path: commits complete chunks, saves partials, releases claims
    t.join(timeout=30)
    assert isinstance(box.get("r"), TaskStopped), box
    assert len(run.rows()) < 200, "the stop came too late to test a resume"
    results = run.run_all([run.worker(0, try_number=2), run.worker(1)])
    assert all(isinstance(r, dict) for r in results), results
    _, rows = run.check()
    _assert_replayed_on_policy(fleet.urls, rows)


_CHILD = r"""
import json, sys
from dflash_pipeline.config import Sampling
from dflash_pipeline.dev.stack import s3_client
from dflash_pipeline.steps.generate import Worker, WorkerSettings
from dflash_pipeline.dataset.layout import DatasetLayout
from dflash_pipeline.serving.sglang import ServerSpec
from dflash_pipeline.dataset.store import Store
a = json.loads(sys.argv[1])
layout = DatasetLayout.from_uri(a["output_uri"])
store = Store(s3_client(a["endpoint"]), layout.bucket)
manifest = json.loads(store.get(layout.manifest_key)[0])
s = WorkerSettings(run_id=a["run_id"], worker="w0000", server=ServerSpec(a["url"], a["url"]), model=a["model"],
                   sampling=Sampling(**a["sampling"]), concurrency=a["concurrency"], lease_s=a["lease_s"],
                   checkpoint_every_s=a.get("checkpoint_every_s", 60.0))
Worker(store, layout, manifest, s).run()
"""


@pytest.mark.timeout(120)
def test_killed_worker_process_then_resume_one_row_per_id_and_sample(
    s3_client: Any, bucket: str, sim_fleet: Any, moto_server: Any
) -> None:
    fleet = sim_fleet(2, **SIM)
    fleet[0].update_config(slow_factor=4.0)  # surely mid-conversation when killed
    run = Run(s3_client, bucket, fleet.urls, n=100, save_every=10, samples=2)
    s = run.settings(0)
    arg = {"endpoint": moto_server.endpoint_url, "output_uri": run.cfg.output_uri, "run_id": RUN_ID,
           "url": s.server.base_url, "model": s.model, "sampling": s.sampling.__dict__,
           "concurrency": s.concurrency, "lease_s": 2.0, "checkpoint_every_s": 0.3}
    child = subprocess.Popen([sys.executable, "-c", _CHILD, json.dumps(arg)], cwd=REPO,
                             env={**os.environ, **moto_server.env()}, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while fleet[0].stats()["completed"] < 60 and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert child.poll() is None, child.stderr.read().decode() if child.stderr else ""
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)
    finally:
        if child.poll() is None:
            child.kill()
    assert run.store.list(run.layout.claims_prefix), "the killed worker left no claim: nothing was tested"
    # What the killed task left: committed parts and the checkpoints (partials) of its open chunks.
    committed = sum(len(decode_part(run.store.get(o.key)[0])) for o in run.store.list(run.layout.completions_prefix))
    saved = {(r["id"], r["sample"]) for o in run.store.list(run.layout.partials_prefix)
             for r in decode_part(run.store.get(o.key)[0]).to_pylist()}
    assert saved, "no checkpoint was saved before the SIGKILL: nothing was tested"
    result = run.worker(1, lease_s=2.0).run()
    assert result["chunks_taken_over"] >= 1
    _, rows = run.check()
    _assert_replayed_on_policy(fleet.urls, rows)
    # Every checkpointed conversation was reused, not regenerated: the rows of the killed task's
    # server are exactly its committed rows plus its checkpoints.
    assert sum(1 for r in rows if r["server"] == fleet.urls[0]) == committed + len(saved)
    assert list(run.store.list(run.layout.partials_prefix)) == []


def _catch(fn: Any) -> Any:
    try:
        return fn()
    except BaseException as exc:  # noqa: BLE001 - asserted by the test
        return exc


@pytest.mark.timeout(60)
def test_the_audit_sees_original_answers_in_last_turn_mode(s3_client: Any, bucket: str, sim_fleet: Any) -> None:
    """The control: the same rows in last_turn mode send their original answers, and the audit says so."""
    fleet = sim_fleet(1, **SIM)
    s3_client.put_object(Bucket=bucket, Key="in/conv.jsonl", Body=_conversations(20))
    cfg = RunConfig.from_params({"prompts_uri": f"s3://{bucket}/in/conv.jsonl", "output_uri": f"s3://{bucket}/lt",
                                 "servers": fleet.urls, "save_every": 10})
    spec = ServerSpec(fleet.urls[0], fleet.urls[0])
    run_plan(s3_client, cfg, RUN_ID)
    info = run_preflight(s3_client, cfg, [spec], RUN_ID)[0]
    layout = DatasetLayout.from_uri(cfg.output_uri)
    store = Store(s3_client, bucket)
    manifest = json.loads(store.get(layout.manifest_key)[0])
    Worker(store, layout, manifest, WorkerSettings(run_id=RUN_ID, worker="w0000", server=spec, model=info["model"],
                                                   sampling=cfg.sampling, concurrency=int(info["concurrency"]),
                                                   poll_s=0.2)).run()
    audit = _audit(fleet.urls)[0]
    # 10 rows with 2 old answers and 10 with 3: the last is dropped, the others are history.
    assert audit["foreign_history_turns"] == 10 * 1 + 10 * 2 and audit["own_history_turns"] == 0
    report = run_validation(s3_client, cfg.output_uri, plots=False)
    assert report["turns_generated"] == 20 and report["multi_turn_rows"] == 0


@pytest.mark.timeout(180)
def test_regenerated_conversations_tokenize_one_row_per_turn_with_the_engine_ids(
    s3_client: Any, bucket: str, sim_fleet: Any, qwen_tokenizer: Path
) -> None:
    """Parts the generate step wrote in all_turns mode, fed to the tokenize step with Qwen's real BPE,
    the servers serving that tokenizer (one vLLM-wire server returning its token ids, one SGLang-wire
    server of a version that returns none). Every regenerated turn is one training row: its context is exactly the
    ids its request had, its trained tokens exactly the ids generated (engine ids kept as they are,
    re-encoded ones checked against the engine's counts), no user or system text and no original
    answer is trained, and no earlier turn's reasoning is in any context."""
    import io

    import pyarrow.parquet as pq
    from tokenizers import Tokenizer

    from dflash_pipeline.config import TokenizeConfig
    from dflash_pipeline.steps.tokenize import plan, run_assignment, write_report
    from dflash_pipeline.steps.tokenize.profiles import profile_keys

    fleet = sim_fleet(engines=["vllm", "sglang"], tokenizer_dir=str(qwen_tokenizer), noncanonical_rate=0.05, **SIM)
    # The SGLang-wire server plays a version older than 0.5.17 (no token ids). Without engine ids a
    # non-canonical generation cannot be told from a mangled one (the count check refuses it:
    # tests/unit/test_tokenize_exact.py), so that server samples canonically.
    fleet.servers[1].update_config(noncanonical_rate=0.0, token_ids_supported=False)
    run = Run(s3_client, bucket, fleet.urls, n=30, save_every=10, samples=2)
    assert all(isinstance(r, dict) for r in run.run_all([run.worker(i) for i in range(2)]))
    report_v, rows = run.check()
    turns = sum(len(r["turns"]) for r in rows)
    planned = plan(s3_client, [run.cfg.output_uri], TokenizeConfig(tokenizer=str(qwen_tokenizer), workers=2,
                                                                   min_loss_tokens=1))
    for a in planned["assignments"]:
        run_assignment(s3_client, a)
    report = write_report(s3_client, planned["datasets"][0])
    with_ids = [r for r in rows if r["output_token_ids"] is not None]
    assert 0 < len(with_ids) < len(rows), "both engines served conversations"
    assert report["rows_in"] == 60 and report["dropped_by_reason"] == {}, (report["dropped_by_reason"], report["unverified_examples"][:5])
    assert report["rows_out"] == turns
    assert report["ids_source"] == {"engine": sum(len(r["turns"]) for r in with_ids),
                                    "retokenized": turns - sum(len(r["turns"]) for r in with_ids)}
    assert report["unverified"] == 0 and report["prompt_template_differs"] == 0

    by_key = {(r["id"], r["sample"]): r for r in rows}
    tok = Tokenizer.from_file(str(qwen_tokenizer / "tokenizer.json"))
    newline = tok.encode("\n", add_special_tokens=False).ids
    seen = 0
    noncanonical = 0
    for c in range(len(run.manifest["chunks"]["sizes"])):
        table = pq.read_table(io.BytesIO(run.store.get(run.layout.key(profile_keys("parquet", c)["rows"]))[0]))
        for row in table.to_pylist():
            src = by_key[(row["id"], row["sample"])]
            k = row["turn"]
            answer = [m for m in src["conversation"] if m["role"] == "assistant"][k]
            ids, mask = row["input_ids"], row["loss_mask"]
            n_prompt = mask.index(1)
            assert all(mask[n_prompt:]) and not any(mask[:n_prompt])
            context = tok.decode(ids[:n_prompt], skip_special_tokens=False)
            trained = tok.decode(ids[n_prompt:], skip_special_tokens=False)
            if src["output_token_ids"] is not None:
                assert row["ids_source"] == "engine"
                out = list(src["output_token_ids"][k])
                assert ids[:n_prompt] == list(src["prompt_token_ids"][k])
                assert ids[n_prompt:] == out + (newline if src["turns"][k]["finish_reason"] == "stop" else [])
                noncanonical += tok.encode(tok.decode(out, skip_special_tokens=False), add_special_tokens=False).ids != out
            else:
                assert row["ids_source"] == "retokenized"
                assert n_prompt == src["turns"][k]["prompt_tokens"]
                assert len(ids) - n_prompt == src["turns"][k]["completion_tokens"] + (
                    len(newline) if src["turns"][k]["finish_reason"] == "stop" else 0)
            assert answer["content"].strip() in trained
            assert not answer["reasoning"] or answer["reasoning"].strip() in trained
            for earlier in [m for m in src["conversation"] if m["role"] == "assistant"][:k]:
                assert earlier["content"] in context
                assert not earlier["reasoning"] or earlier["reasoning"].strip() not in context
            for m in src["conversation"]:
                if m["role"] != "assistant":
                    assert m["content"] not in trained
            assert "ORIGINAL" not in context + trained, "an original answer reached the trainer"
            seen += 1
    assert seen == turns and noncanonical > 0
