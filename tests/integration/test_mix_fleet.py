"""A thinking/sampling mix through plan, preflight, the real Workers, the S3 server and simulated SGLang
and vLLM servers over HTTP: the requested thinking share is met (within 1 %), every row is labelled
with its mode and the sampling it was sent with, and each server received exactly those fields (its
`/sim/requests` record), for the run's extras, the sample's ladder entry and the row's own overrides."""

from __future__ import annotations

import json
import threading
from collections import Counter
from typing import Any

import pytest
import requests

from dflash_pipeline.config import ConfigError, RunConfig
from dflash_pipeline.dataset.layout import DatasetLayout
from dflash_pipeline.dataset.records import decode_part
from dflash_pipeline.dataset.store import Store
from dflash_pipeline.serving.sglang import ServerSpec, request_seed
from dflash_pipeline.steps.generate import Worker
from dflash_pipeline.steps.generate.settings import settings_for
from dflash_pipeline.steps.plan import run_plan
from dflash_pipeline.steps.preflight import run_preflight
from dflash_pipeline.steps.validate import run_validation

RUN_ID = "manual__2026-01-02T00:00:00+00:00"
SIM = {"token_time_s": 0.0005, "length_scale": 0.01, "max_running_requests": 32}
EXTRA = {"top_k": 20, "min_p": 0.0, "presence_penalty": 0.5, "stop": ["<|endoftext|>"]}
LADDER = [{"temperature": 0.6}, {"temperature": 1.0, "top_p": 1.0}]
ROW_SAMPLING = {"top_k": 5, "repetition_penalty": 1.1}


def _rows(n: int) -> bytes:
    """n prompt rows: every 25th says thinking off itself, every 40th carries its own sampling."""
    out = []
    for i in range(n):
        row: dict[str, Any] = {"id": f"p{i:05d}", "prompt": f"Question {i}: what is {i} plus {i % 13}?",
                               "source": "odd" if i % 2 else "even"}
        if i % 25 == 0:
            row["enable_thinking"] = False
        if i % 40 == 0:
            row["sampling"] = ROW_SAMPLING
        out.append(row)
    return ("\n".join(json.dumps(r) for r in out) + "\n").encode()


def _run_workers(s3: Any, bucket: str, cfg: RunConfig, infos: list[dict[str, Any]]) -> None:
    layout = DatasetLayout.from_uri(cfg.output_uri)
    store = Store(s3, bucket)
    manifest = json.loads(store.get(layout.manifest_key)[0])
    workers = [Worker(Store(s3, bucket), layout, manifest,
                      settings_for(cfg, run_id=RUN_ID, map_index=i, server=ServerSpec(u, u), server_info=infos[i],
                                   poll_s=0.2))
               for i, u in enumerate(cfg.servers)]
    errors: list[BaseException] = []

    def go(w: Worker) -> None:
        try:
            w.run()
        except BaseException as exc:  # noqa: BLE001 - asserted below
            errors.append(exc)

    threads = [threading.Thread(target=go, args=(w,), daemon=True) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=240)
    assert not any(t.is_alive() for t in threads), "a worker did not finish"
    assert not errors, errors


@pytest.mark.timeout(300)
def test_mixed_run_meets_the_fraction_and_every_server_got_what_each_row_records(
        s3_client: Any, bucket: str, sim_fleet: Any) -> None:
    n, fraction = 2000, 0.3
    fleet = sim_fleet(engines=["sglang", "vllm"], **SIM)
    s3_client.put_object(Bucket=bucket, Key="in/mix.jsonl", Body=_rows(n))
    cfg = RunConfig.from_params({
        "prompts_uri": f"s3://{bucket}/in/mix.jsonl", "output_uri": f"s3://{bucket}/mix", "servers": fleet.urls,
        "save_every": 100, "seed": 5, "samples_per_prompt": 2, "thinking_fraction": fraction,
        "sampling_extra": EXTRA, "sampling_ladder": LADDER, "max_tokens": 512,
    })
    run_plan(s3_client, cfg, RUN_ID)
    infos = run_preflight(s3_client, cfg, [ServerSpec(u, u) for u in fleet.urls], RUN_ID)
    assert sorted(i["engine"] for i in infos) == ["sglang", "vllm"]
    _run_workers(s3_client, bucket, cfg, infos)
    report = run_validation(s3_client, cfg.output_uri, plots=False)  # raises unless every unit has one row
    assert report["prompts"] == 2 * n and report["completions"] == 2 * n

    layout = DatasetLayout.from_uri(cfg.output_uri)
    store = Store(s3_client, bucket)
    manifest = json.loads(store.get(layout.manifest_key)[0])
    mix = manifest["input"]["thinking"]
    assert mix["from_rows"] == n // 25 and mix["from_fraction"] == n - n // 25
    assert manifest["pinned"]["input"]["thinking_fraction"] == fraction
    assert manifest["pinned"]["sampling"]["extra"] == EXTRA and manifest["pinned"]["sampling"]["ladder"] == LADDER
    assert manifest["input"]["sampling_keys"] == sorted(ROW_SAMPLING)
    # issue 41: the report's header says the run is mixed, not "thinking on"
    header = store.get(layout.report_md_key)[0].decode().splitlines()[2]
    assert f"thinking mixed ({mix['share_on']:.0%} of conversations on)" in header, header

    rows: list[dict[str, Any]] = []
    for obj in store.list(layout.completions_prefix):
        rows += decode_part(store.get(obj.key)[0]).to_pylist()
    assert len(rows) == 2 * n and all(r["error_class"] is None for r in rows)
    by_conv: dict[str, set[bool]] = {}
    for r in rows:
        by_conv.setdefault(r["id"], set()).add(r["thinking"])
    assert all(len(v) == 1 for v in by_conv.values()), "every sample of a conversation has its mode"
    own_off = {f"p{i:05d}" for i in range(0, n, 25)}
    assert all(by_conv[i] == {False} for i in own_off), "a row's own mode wins"
    quota = [next(iter(v)) for i, v in by_conv.items() if i not in own_off]
    share = sum(quota) / len(quota)
    assert abs(share - fraction) <= 0.01, share
    assert Counter(r["source"] for r in rows if r["thinking"])["odd"] > 0.35 * sum(r["thinking"] for r in rows), \
        "both interleaved sources think"

    # What each server received, keyed by the request's seed (unique per (id, sample)).
    received: dict[int, dict[str, Any]] = {}
    for url in fleet.urls:
        log = requests.get(f"{url}/sim/requests", timeout=10).json()["requests"]
        assert all(e["refused"] is None for e in log), [e for e in log if e["refused"]][:3]
        for e in log:
            if not e["request_id"].startswith("preflight-proof"):
                received[e["sampling"]["seed"]] = e
    assert len(received) == 2 * n, "exactly one request per row"
    for r in rows:
        sent = json.loads(r["sampling"])
        assert r["sampling"] == json.dumps(sent, sort_keys=True, separators=(",", ":")), "sorted keys"
        got = received[request_seed(5, r["id"], r["sample"])]
        assert got["sampling"] == sent, (r["id"], r["sample"], got, sent)
        assert got["enable_thinking"] is r["thinking"]
        expected = {"max_tokens": 512, "temperature": 0.6, "top_p": 0.95, **EXTRA, **LADDER[r["sample"] % 2],
                    "seed": request_seed(5, r["id"], r["sample"])}
        if int(r["id"][1:]) % 40 == 0:
            expected.update(ROW_SAMPLING)
        assert sent == expected


@pytest.mark.timeout(120)
def test_preflight_refuses_a_key_the_servers_engine_would_ignore(s3_client: Any, bucket: str, sim_fleet: Any) -> None:
    fleet = sim_fleet(engines=["sglang"], **SIM)
    s3_client.put_object(Bucket=bucket, Key="in/p.jsonl", Body=_rows(30))
    cfg = RunConfig.from_params({"prompts_uri": f"s3://{bucket}/in/p.jsonl", "output_uri": f"s3://{bucket}/ds",
                                 "servers": fleet.urls, "sampling_extra": {"bad_words": ["x"]}})
    run_plan(s3_client, cfg, RUN_ID)
    with pytest.raises(ConfigError, match=r"\(sglang\) does not accept \['bad_words'\]"):
        run_preflight(s3_client, cfg, [ServerSpec(u, u) for u in fleet.urls], RUN_ID)
    assert all(requests.get(f"{u}/sim/stats", timeout=5).json()["generation_requests"] == 0 for u in fleet.urls)
