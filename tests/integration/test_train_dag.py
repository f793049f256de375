"""dflash_train through `dag.test()` against moto, local backend, with a test fixture as the trainer entry
(tests/integration/fixtures/train_entry_fixture.py: the entry's contract without torch; the real trainer's
own run is tests/trainers' business).

A dataset is tokenized with tokenize's own functions (Qwen's BPE, a held-out split in its manifest), then one
runner process runs five confs in turn:

1. train 'd1': the fixture is killed at step 3 (after its state at step 2), the task's retry resumes it from
   step 2; the drafter and train_log.json are uploaded, the card is written last with the lineage and the
   shards' sha256 (equal to the S3 objects'), the dflash_drafter event names it;
2. the same conf again: nothing trained (train_local skipped), the card untouched, the event repeats it;
3. the same name with other steps: refused by `check`, nothing written;
4. an unknown tokenization: refused, naming the dataset's tokenizations;
5. a dataset without a held-out split: refused;
6. backend kubernetes with a command naming an unknown placeholder: refused by `check`, no pod started;
7. the local backend with a Hugging Face id as target (its trainer takes a directory): refused.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from dflash_pipeline.config import TokenizeConfig
from dflash_pipeline.dataset.layout import DatasetLayout
from dflash_pipeline.dataset.records import encode_part
from dflash_pipeline.dev.sim.rows import engine_row
from dflash_pipeline.dev.sim.tokens import SimTokenModel
from dflash_pipeline.steps.tokenize import plan, run_assignment, write_report

REPO = Path(__file__).resolve().parents[2]
RUNNER = Path(__file__).with_name("train_runner.py")
FIXTURE_ENTRY = Path(__file__).parent / "fixtures" / "train_entry_fixture.py"
PARTS, ROWS = 2, 20

pytestmark = pytest.mark.slow


def _dataset(client: Any, bucket: str, root: str, tokenizer: Path, heldout: bool) -> DatasetLayout:
    layout = DatasetLayout(bucket, root)
    manifest: dict[str, Any] = {"format": "dflash-pipeline/manifest/1", "plan_id": "p1", "model_resolved": "tiny-target",
                                "pinned": {"sampling": {"enable_thinking": True}}, "chunks": {"sizes": [ROWS] * PARTS}}
    if heldout:
        manifest["heldout"] = {"fraction": 0.2, "salt": "dflash-heldout", "count": 9}
    client.put_object(Bucket=bucket, Key=layout.manifest_key, Body=json.dumps(manifest).encode())
    report = {"status": "passed", "completions": PARTS * ROWS, "token_recount": {"tokenizer": str(tokenizer)}}
    client.put_object(Bucket=bucket, Key=layout.report_key, Body=json.dumps(report).encode())
    tm = SimTokenModel(str(tokenizer))
    for c in range(PARTS):
        rows = [engine_row(tm, [{"role": "user", "content": f"What is {n} plus two?"}],
                           [("I add two to the number.", f"{n} plus two is {n + 2}.")], thinking=True, ids=True,
                           row_id=f"p{n}", chunk=c) for n in range(c * ROWS, (c + 1) * ROWS)]
        client.put_object(Bucket=bucket, Key=layout.part_key(c), Body=encode_part(rows))
    cfg = TokenizeConfig(workers=1)
    planned = plan(client, [layout.uri], cfg)
    for a in planned["assignments"]:
        run_assignment(client, a)
    write_report(client, planned["datasets"][0], cfg.min_kept_share)
    return layout


def _get(client: Any, bucket: str, key: str) -> bytes:
    return client.get_object(Bucket=bucket, Key=key)["Body"].read()


def _results(stdout: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    results = [json.loads(line[len("RESULT "):]) for line in stdout.splitlines() if line.startswith("RESULT ")]
    assets = next(json.loads(line[len("ASSETS "):]) for line in stdout.splitlines() if line.startswith("ASSETS "))
    return results, assets


def _states(result: dict[str, Any]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for task_id, _, state in result["tasks"]:
        out.setdefault(task_id, []).append(state)
    return out


def test_train_resumes_cards_refuses(moto_server: Any, s3_client: Any, bucket: str, qwen_tokenizer: Path,
                                     tmp_path: Path) -> None:
    good = _dataset(s3_client, bucket, "ds/good", qwen_tokenizer, heldout=True)
    bare = _dataset(s3_client, bucket, "ds/bare", qwen_tokenizer, heldout=False)
    (tmp_path / "tiny-target").mkdir()  # the fixture entry never opens it
    common = {"trainers_python": sys.executable, "trainer_entry": str(FIXTURE_ENTRY), "work_dir": str(tmp_path / "work"),
              "drafters_root": f"s3://{bucket}/drafters", "steps": 6, "save_every": 2, "target_model": str(tmp_path / "tiny-target"),
              "tokenization": "default", "backend": "local"}  # every conf names every key it sets: dag.test keeps a conf's params for the next
    confs = [
        {**common, "dataset_uri": good.uri, "drafter_name": "d1"},
        {**common, "dataset_uri": good.uri, "drafter_name": "d1"},
        {**common, "dataset_uri": good.uri, "drafter_name": "d1", "steps": 7},
        {**common, "dataset_uri": good.uri, "drafter_name": "d2", "tokenization": "nope"},
        {**common, "dataset_uri": bare.uri, "drafter_name": "d3"},
        {**common, "dataset_uri": good.uri, "drafter_name": "k1", "backend": "kubernetes", "kubernetes_image": "img:1",
         "kubernetes_command": ["bash", "-c", "train {dataset}"]},
        {**common, "dataset_uri": good.uri, "drafter_name": "h1", "target_model": "Qwen/Qwen3-8B"},
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
    env.update(moto_server.env())
    env.update({"AIRFLOW_HOME": str(tmp_path / "airflow"), "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
                "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"), "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
                "DFLASH_TRAIN_FIXTURE_CRASH_AT": "3"})
    proc = subprocess.run([sys.executable, str(RUNNER), str(REPO / "dags"), json.dumps(confs)],
                          capture_output=True, text=True, env=env, timeout=600)
    (tmp_path / "runner.out").write_text(proc.stdout + proc.stderr)  # kept for a failure's post-mortem
    assert proc.returncode == 0, proc.stderr[-4000:]
    results, assets = _results(proc.stdout)
    print("runner output:", tmp_path / "runner.out")
    first, again, other, unknown, no_split, bad_pod, hub_id = results

    # 1: killed at step 3, resumed by the retry from step 2; card last, with the lineage
    assert first["state"] == "success", (first, proc.stderr[-4000:])
    assert _states(first)["train_local"] == ["success"] and _states(first)["train_pod"] == ["skipped"]
    assert "fixture: crashing at step 3" in proc.stdout + proc.stderr
    card = json.loads(_get(s3_client, bucket, "drafters/d1/card.json"))
    assert card["format"] == "dflash-pipeline/drafter-card/1" and card["name"] == "d1"
    assert card["training"]["resumed_from_step"] == 2 and card["training"]["steps"] == 6
    assert card["training"]["loss"] == [[s, round(1 / (1 + s), 6)] for s in range(1, 7)]
    assert card["trainer"] == {"name": "test-fixture", "version": "0"}
    assert card["dataset"]["uri"] == good.uri and card["tokenization"]["name"] == "default"
    assert card["tokenization"]["settings_sha256"] == hashlib.sha256(
        _get(s3_client, bucket, good.tokenized_settings_key)).hexdigest()
    assert card["dataset"]["manifest_sha256"] == hashlib.sha256(_get(s3_client, bucket, good.manifest_key)).hexdigest()
    assert card["heldout"]["fraction"] == 0.2 and card["hyperparameters"]["steps"] == 6
    assert [s["key"] for s in card["shards"]] == [f"ds/good/tokenized/specforge/part-00000{c}.jsonl" for c in range(PARTS)]
    rows = 0
    for shard in card["shards"]:
        body = _get(s3_client, bucket, shard["key"])
        assert shard["sha256"] == hashlib.sha256(body).hexdigest()
        rows += len(body.splitlines())
    assert card["training"]["rows"] == rows > 0
    report = json.loads(_get(s3_client, bucket, good.tokenized_report_key))
    assert rows == report["rows_out"] and report["dropped_by_reason"].get("heldout", 0) > 0  # the split held some out
    assert set(card["files"]) == {"drafters/d1/drafter/config.json", "drafters/d1/drafter/model.safetensors",
                                  "drafters/d1/train_log.json"}
    etag = s3_client.head_object(Bucket=bucket, Key="drafters/d1/card.json")["ETag"]

    # 2: the same conf: nothing trained, the card untouched
    assert again["state"] == "success" and _states(again)["train_local"] == ["skipped"]
    assert s3_client.head_object(Bucket=bucket, Key="drafters/d1/card.json")["ETag"] == etag
    assert [e["extra"]["drafters"][0]["card_uri"] for e in assets] == [f"s3://{bucket}/drafters/d1/card.json"] * 2
    assert assets[0]["extra"]["drafters"][0]["tokenization"] == "default"
    assert assets[0]["extra"]["drafters"][0]["steps"] == 6

    # 3-5: refused by check before any work
    for result in (other, unknown, no_split, bad_pod, hub_id):
        assert result["state"] == "failed"
        states = _states(result)
        assert states["check"] == ["failed"] and "success" not in states.get("train_local", []), states
    out = proc.stdout + proc.stderr
    assert "drafter name s3://" in out and "already used with other settings" in out
    assert "has no tokenization 'nope'" in out and "['default']" in out
    assert "ds/bare has no held-out split" in out
    assert "kubernetes_command: unknown placeholder(s) ['dataset']" in out
    assert _states(bad_pod).get("train_pod") != ["success"] and "running" not in str(bad_pod["tasks"])
    assert "target_model 'Qwen/Qwen3-8B' is not a local model directory" in out
    listed = {o["Key"] for o in s3_client.list_objects_v2(Bucket=bucket, Prefix="drafters/")["Contents"]}
    assert not any(k.startswith(("drafters/d2/", "drafters/d3/", "drafters/k1/", "drafters/h1/")) for k in listed)
    assert s3_client.head_object(Bucket=bucket, Key="drafters/d1/card.json")["ETag"] == etag

    # the card as dflash_eval's prepare reads it (before any request): the lineage the report shows
    from dflash_pipeline.config import ConfigError, EvalConfig
    from dflash_pipeline.steps.evaluate.prepare import read_lineages

    def eval_cfg(card_uri: str) -> EvalConfig:
        return EvalConfig.from_params({"dataset_uri": good.uri, "output_uri": f"s3://{bucket}/evals/e1",
                                       "drafters": [{"name": "d1", "servers": ["http://127.0.0.1:9"],
                                                     "card_uri": card_uri}]})

    lin = read_lineages(s3_client, eval_cfg(f"s3://{bucket}/drafters/d1/card.json"),
                        {"kind": "heldout", "dataset_uri": good.uri})["d1"]
    assert {k: lin[k] for k in ("dataset", "tokenization", "answers", "trainer", "steps", "seed",
                                "heldout_of_training_data")} == {
        "dataset": good.uri, "tokenization": "default", "answers": "regenerated", "trainer": "test-fixture",
        "steps": 6, "seed": 0, "heldout_of_training_data": True}
    assert lin["final_loss"] == round(1 / 7, 6)
    other = read_lineages(s3_client, eval_cfg(f"s3://{bucket}/drafters/d1/"), {"kind": "prompts_uri"})["d1"]
    assert other["heldout_of_training_data"] is False  # a benchmark: nothing says the drafter never saw it
    with pytest.raises(ConfigError, match="drafters/d9/card.json does not exist"):
        read_lineages(s3_client, eval_cfg(f"s3://{bucket}/drafters/d9/card.json"), {})


DEFAULT_ENTRY = REPO / "include" / "dflash_pipeline" / "steps" / "train" / "specforge_entry.py"


def test_the_dag_trains_with_specforge_on_cpu(moto_server: Any, s3_client: Any, bucket: str, qwen_tokenizer: Path,
                                              trainers_python: Path, tmp_path: Path) -> None:
    """The same DAG with the default entry (SpecForge 0.2.0's DFlash training on CPU, in .venv-trainers) on the
    tiny target: the drafter vLLM's DFlash path takes, and its card with SpecForge's loss curve."""
    if not DEFAULT_ENTRY.is_file():  # written on branch trainer-cpu (issue 38 item 2), merged beside this
        pytest.skip(f"{DEFAULT_ENTRY.relative_to(REPO)} is not in this tree yet")
    from dflash_pipeline.dev.engine import tiny_qwen
    from dflash_pipeline.dev.engine.dflash_drafter import check_drafter

    good = _dataset(s3_client, bucket, "ds/sf", qwen_tokenizer, heldout=True)
    target = tiny_qwen.build_checkpoint(tmp_path / "target", tokenizer_source=qwen_tokenizer)
    conf = {"dataset_uri": good.uri, "tokenization": "default", "drafter_name": "sf1", "target_model": str(target),
            "drafters_root": f"s3://{bucket}/drafters", "trainers_python": str(trainers_python),
            "work_dir": str(tmp_path / "work"), "steps": 4, "save_every": 2, "batch_size": 4, "max_length": 512,
            "block_size": 4, "learning_rate": 1e-3}
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
    env.update(moto_server.env())
    env.update({"AIRFLOW_HOME": str(tmp_path / "airflow"), "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
                "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"), "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
                "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home"),
                "TOKENIZERS_PARALLELISM": "false"})
    proc = subprocess.run([sys.executable, str(RUNNER), str(REPO / "dags"), json.dumps([conf])],
                          capture_output=True, text=True, env=env, timeout=900)
    (tmp_path / "runner.out").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, proc.stderr[-4000:]
    [result], [event] = _results(proc.stdout)
    assert result["state"] == "success", (tmp_path / "runner.out", proc.stdout[-4000:])
    assert "trainer | " in proc.stdout + proc.stderr  # the entry's lines reached the task log
    card = json.loads(_get(s3_client, bucket, "drafters/sf1/card.json"))
    assert card["trainer"] == {"name": "specforge", "version": "0.2.0"}
    assert [s for s, _ in card["training"]["loss"]] == [1, 2, 3, 4]
    report = json.loads(_get(s3_client, bucket, good.tokenized_report_key))
    assert card["training"]["rows"] == report["rows_out"] and card["training"]["rows_per_s"] > 0
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    for name in ("config.json", "model.safetensors"):
        (drafter / name).write_bytes(_get(s3_client, bucket, f"drafters/sf1/drafter/{name}"))
    assert check_drafter(drafter, target) == []
    assert event["extra"]["drafters"][0]["trainer"] == "specforge"
