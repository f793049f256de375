"""The training sets of issue 38's experiment, each a named tokenization of one dataset, through a real S3 protocol
server (moto) and simulated vLLM / SGLang servers serving Qwen's BPE: a prompt set with original answers is
generated (thinking mixed per row, two samples per prompt, a held-out split), validated, tokenized with the
regenerated answers (`default`) and with the original ones (`answers: original` → `original`), and defects are
planted on them (dev/data_defects.py). What is proved:

* the original answers' rows: one per original answer at the regenerated turn's place (same key), sample 0 only,
  held-out ids refused, `ids_source` "original", the prompt token for token the one the regenerated row had, the
  trained text the input's answer (empty think block trained for thinking-on answers without reasoning,
  reasoning left out with thinking off), `answers: original` in settings.json, report and card; the same name
  with the other answers is refused;
* a planted defect is a tokenization like any other (same keys, settings.json naming the defect and its source,
  report, card) and differs from its source exactly by the defect; rerunning resumes, another defect under the
  same name is refused, and a tokenize run never mistakes it for a clean tokenization.
"""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer

from dflash_pipeline.config import ConfigError, RunConfig, TokenizeConfig
from dflash_pipeline.dataset.heldout import HeldoutSplit
from dflash_pipeline.dataset.layout import DatasetLayout, chunk_of_key
from dflash_pipeline.dataset.records import decode_part, unit_key
from dflash_pipeline.dataset.store import Store
from dflash_pipeline.dev.data_defects import DefectError, plant_defect
from dflash_pipeline.dev.faultlab import run_generation
from dflash_pipeline.steps.tokenize import plan, run_assignment, write_report
from dflash_pipeline.steps.tokenize.profiles import profile_keys
from dflash_pipeline.steps.validate import run_validation

SIM = {"token_time_s": 0.0005, "length_scale": 0.01, "max_running_requests": 16}
N = 72
EMPTY_BLOCK = "<think>\n\n</think>\n\n"


def _prompt_rows() -> list[dict[str, Any]]:
    """A prompt set with its original answers, in every shape the readers take: reasoning_content, none, inline
    <think>, two turns (regenerated last_turn: the first answer is history), no answer at all; a sixth of the
    rows ask for thinking off themselves (the rest follow thinking_fraction)."""
    rows = []
    for i in range(N):
        q = f"Question {i}: how does item {i} of the standard library behave when given {i % 7} arguments?"
        a = f"ORIGINAL answer {i}: it returns {i * 3} and raises nothing for {i % 7} arguments."
        r = f"ORIGINAL reasoning {i}: the user asks about item {i}; recall its signature first."
        shape = i % 6
        if shape == 0:
            row: dict[str, Any] = {"prompt": q}
        elif shape == 1:
            row = {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a,
                                                                  "reasoning_content": r}]}
        elif shape == 2:
            row = {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
        elif shape == 3:
            row = {"messages": [{"role": "user", "content": q},
                                {"role": "assistant", "content": f"<think>\n{r}\n</think>\n\n{a}"}]}
        elif shape == 4:
            row = {"messages": [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": q},
                                {"role": "assistant", "content": f"ORIGINAL first answer {i}."},
                                {"role": "user", "content": f"And for {i + 1} arguments?"},
                                {"role": "assistant", "content": a, "reasoning_content": r}]}
        else:
            row = {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a,
                                                                  "reasoning_content": r}],
                   "enable_thinking": False}
        rows.append({"id": f"q{i:03d}", **row})
    return rows


def _get(store: Store, key: str) -> bytes:
    got = store.get(key)
    assert got is not None, key
    return got[0]


def _rows(store: Store, layout: DatasetLayout, parts: list[int]) -> dict[str, dict[str, Any]]:
    tables = [pq.read_table(io.BytesIO(_get(store, layout.key(profile_keys("parquet", c)["rows"])))) for c in parts]
    return {r["key"]: r for r in pa.concat_tables(tables).to_pylist()}


def _tokenize(client: Any, uri: str, **params: Any) -> dict[str, Any]:
    planned = plan(client, [uri], TokenizeConfig.from_params({"workers": 1, **params}))
    for a in planned["assignments"]:
        run_assignment(client, a)
    return write_report(client, planned["datasets"][0])


def _files(store: Store, layout: DatasetLayout) -> dict[str, str]:
    """{key relative to the tokenization's folder: ETag} of its own files (not a named tokenization's inside)."""
    prefix = layout.tokenized_prefix
    out = {}
    for o in store.list(prefix):
        rel = o.key[len(prefix):]
        if rel.count("/") <= 1 and (rel.split("/")[0] in ("parquet", "specforge", "specforge-conversations",
                                                           "speculators", "stats") or "/" not in rel):
            out[rel] = o.etag
    return out


@pytest.mark.timeout(600)
def test_original_answers_and_planted_defects_are_named_tokenizations(s3_client: Any, bucket: str, sim_fleet: Any,
                                                                      qwen_tokenizer: Path) -> None:
    prompts = {r["id"]: r for r in _prompt_rows()}
    s3_client.put_object(Bucket=bucket, Key="in/with-answers.jsonl",
                         Body=("\n".join(json.dumps(r) for r in prompts.values()) + "\n").encode())
    fleet = sim_fleet(engines=["vllm", "sglang"], tokenizer_dir=str(qwen_tokenizer), **SIM)
    fleet.servers[1].update_config(token_ids_supported=False)  # an SGLang that returns no ids
    cfg = RunConfig.from_params({
        "prompts_uri": f"s3://{bucket}/in/with-answers.jsonl", "output_uri": f"s3://{bucket}/exp", "servers": fleet.urls,
        "save_every": 24, "seed": 11, "samples_per_prompt": 2, "thinking_fraction": 0.5, "max_tokens": 512,
        "heldout_fraction": 0.15})
    out = run_generation(s3_client, cfg, fleet.urls, "run1")
    assert not any(isinstance(o, BaseException) for o in out), out
    assert run_validation(s3_client, cfg.output_uri, tokenizer=str(qwen_tokenizer), plots=False)["status"] == "passed"
    store = Store(s3_client, bucket)
    base = DatasetLayout.from_uri(cfg.output_uri)
    parts = sorted(c for c in (chunk_of_key(o.key, base.completions_prefix) for o in store.list(base.completions_prefix))
                   if c is not None)
    completions = [r for c in parts for r in decode_part(_get(store, base.part_key(c))).to_pylist()]
    held = {pid for pid in prompts if HeldoutSplit(0.15).holds(pid)}
    assert held and not held & {r["id"] for r in completions} and all(r["error_class"] is None for r in completions)
    # a benchmark named only at tokenize time: refused by both tokenizations
    named = sorted({r["id"] for r in completions})[:3]
    s3_client.put_object(Bucket=bucket, Key="in/bench.txt", Body="\n".join(named).encode())
    common = {"output_uri": cfg.output_uri, "tokenizer": str(qwen_tokenizer), "heldout_uri": f"s3://{bucket}/in/bench.txt"}

    regenerated = _tokenize(s3_client, cfg.output_uri, **common)
    assert regenerated["tokenization"] == "default" and regenerated["answers"] == "regenerated"
    original = _tokenize(s3_client, cfg.output_uri, **common, answers="original")
    assert original["tokenization"] == "original" and original["answers"] == "original"
    assert original["status"] == "complete" and original["ids_source"] == {"original": original["rows_out"]}

    # -- the original answers' rows ------------------------------------------------------------------------
    lay_o = base.tokenized_as("original")
    regen_rows, orig_rows = _rows(store, base, parts), _rows(store, lay_o, parts)
    tok = Tokenizer.from_file(str(qwen_tokenizer / "tokenizer.json"))
    expected: dict[str, dict[str, Any]] = {}
    no_reasoning_on = left_out_off = 0
    for r in completions:
        if r["sample"] != 0 or r["id"] in named:
            continue
        source = prompts[r["id"]]
        if "prompt" in source:
            continue
        two = sum(m["role"] == "assistant" for m in source["messages"]) > 1
        key = unit_key(r) + ("#turn=1" if two else "")
        last = source["messages"][-1]
        inline = last["content"].split("</think>\n\n")
        expected[key] = {"thinking": r["thinking"], "answer": inline[-1], "reasoning": last.get("reasoning_content") or
                         (inline[0].removeprefix("<think>\n").removesuffix("\n") if len(inline) > 1 else None)}
        no_reasoning_on += r["thinking"] and not expected[key]["reasoning"]
        left_out_off += (not r["thinking"]) and bool(expected[key]["reasoning"])
    assert set(orig_rows) == set(expected) and no_reasoning_on and left_out_off
    assert {r["thinking"] for r in orig_rows.values()} == {True, False}
    for key, want in expected.items():
        o = orig_rows[key]
        start = o["loss_mask"].index(1)
        trained = tok.decode(o["input_ids"][start:], skip_special_tokens=False)
        assert o["ids_source"] == "original" and o["thinking"] is want["thinking"] and "ORIGINAL answer" in trained
        assert trained.endswith(want["answer"] + "<|im_end|>\n") and "REGEN" not in trained
        if want["thinking"] and want["reasoning"]:
            assert want["reasoning"] in trained
        elif want["thinking"]:  # the Qwen3-style template: the model writes <think>, so the whole block is trained
            assert trained == EMPTY_BLOCK + want["answer"] + "<|im_end|>\n"
        else:
            assert "ORIGINAL reasoning" not in tok.decode(o["input_ids"], skip_special_tokens=False)
        if key in regen_rows:  # same context and mode: the prompt is the regenerated row's, token for token
            g = regen_rows[key]
            assert o["input_ids"][:start] == g["input_ids"][: g["loss_mask"].index(1)], key
    assert original["original_answers"] == {"thinking_off_reasoning_left_out": left_out_off,
                                            "thinking_on_without_reasoning": no_reasoning_on}
    drops = original["dropped_by_reason"]
    assert drops["original_answer_of_another_sample"] == len(completions) // 2 - len(named)  # held out first
    assert drops["heldout"] == 2 * len(named) and drops["no_original_answer"] == sum(
        1 for r in completions if r["sample"] == 0 and r["id"] not in named and "prompt" in prompts[r["id"]])
    assert original["gate"]["passed"] and original["gate"]["rows_counted"] == original["rows_out"] + drops[
        "no_original_answer"]
    settings_o = json.loads(_get(store, lay_o.tokenized_settings_key))
    assert settings_o["answers"] == "original" and settings_o["drop_quality"] == ["near_duplicate"]
    md = _get(store, lay_o.tokenized_report_md_key).decode()
    assert "**answers: original**" in md and "Not token-exact" in md
    card = _get(store, base.dataset_card_key).decode()
    assert "**answers: original.**" in card and "| `original` | `tokenized/original/` | original |" in card
    # the same name with the other answers, or the original answers as 'default', are refused
    with pytest.raises(ConfigError, match=r"tokenization 'original' .*other settings.*answers"):
        plan(s3_client, [cfg.output_uri], TokenizeConfig.from_params({**common, "tokenization": "original"}))
    with pytest.raises(ConfigError, match="cannot be the 'default' tokenization"):
        TokenizeConfig.from_params({**common, "answers": "original", "tokenization": "default"})

    # -- planted defects --------------------------------------------------------------------------------------
    shifted = plant_defect(s3_client, cfg.output_uri, "shifted_loss_mask")
    off_as_on = plant_defect(s3_client, cfg.output_uri, "thinking_off_as_on")
    orig_shifted = plant_defect(s3_client, cfg.output_uri, "shifted_loss_mask", source="original")
    default_settings = _get(store, base.tokenized_settings_key)
    for rep, name, source in ((shifted, "default-shifted_loss_mask", "default"),
                              (off_as_on, "default-thinking_off_as_on", "default"),
                              (orig_shifted, "original-shifted_loss_mask", "original")):
        lay = base.tokenized_as(name)
        assert rep["status"] == "complete" and rep["tokenization"] == name and rep["defect"]["name"] in name
        doc = json.loads(_get(store, lay.tokenized_settings_key))
        src = base.tokenized_as(source)
        assert doc["defect"]["source_tokenization"] == source and doc["tokenized_dir"] == f"tokenized/{name}"
        assert doc["defect"]["source_settings_sha256"] == hashlib.sha256(_get(store, src.tokenized_settings_key)).hexdigest()
        assert {k: v for k, v in doc.items() if k not in ("defect", "tokenization", "tokenized_dir")} == {
            k: v for k, v in json.loads(_get(store, src.tokenized_settings_key)).items()
            if k not in ("tokenization", "tokenized_dir")}
        assert set(_files(store, lay)) == set(_files(store, src))  # the same keys as a real tokenization
        conv = _get(store, lay.key(profile_keys("specforge", parts[0])["conversations"]))
        assert conv == b"" and rep["profiles"]["specforge"]["specforge_conversations"]["skipped"] == {
            "planted_defect": rep["rows_out"]}
        assert f"**PLANTED DEFECT `{rep['defect']['name']}`**" in _get(store, lay.tokenized_report_md_key).decode()
    assert json.loads(default_settings)["tokenization"] == "default"

    clean = regen_rows
    sh = _rows(store, base.tokenized_as("default-shifted_loss_mask"), parts)
    gone = set(clean) - set(sh)
    assert shifted["rows_out"] == len(sh) and shifted["defect"]["rows_changed"] == len(clean)
    assert len(gone) == sum(v for k, v in shifted["dropped_by_reason"].items()
                            if k in ("fewer_than_min_loss_tokens", "no_two_consecutive_loss_tokens")) - sum(
        v for k, v in regenerated["dropped_by_reason"].items()
        if k in ("fewer_than_min_loss_tokens", "no_two_consecutive_loss_tokens"))
    for key, d in sh.items():
        c = clean[key]
        assert d["input_ids"] == c["input_ids"] and d["loss_mask"] == [0, *c["loss_mask"][:-1]]
    oo = _rows(store, base.tokenized_as("default-thinking_off_as_on"), parts)
    assert set(oo) == set(clean)  # the on prompt is shorter: nothing cut, nothing dropped
    off_keys = {k for k, r in clean.items() if not r["thinking"]}
    assert off_as_on["defect"]["rows_changed"] == len(off_keys) > 0
    for key, d in oo.items():
        c = clean[key]
        if key not in off_keys:
            assert (d["input_ids"], d["loss_mask"]) == (c["input_ids"], c["loss_mask"])
            continue
        s_c, s_d = c["loss_mask"].index(1), d["loss_mask"].index(1)
        assert d["input_ids"][s_d:] == c["input_ids"][s_c:] and d["loss_mask"][s_d:] == c["loss_mask"][s_c:]
        clean_prompt = tok.decode(c["input_ids"][:s_c], skip_special_tokens=False)
        assert clean_prompt.endswith("<|im_start|>assistant\n" + EMPTY_BLOCK)
        assert tok.decode(d["input_ids"][:s_d], skip_special_tokens=False) == clean_prompt[: -len(EMPTY_BLOCK)]

    card = _get(store, base.dataset_card_key).decode()
    for name in ("default", "original", "default-shifted_loss_mask", "default-thinking_off_as_on"):
        assert f"| `{name}` |" in card
    assert "planted defect `thinking_off_as_on` (from `default`)" in card

    # rerun: resumes (no part rewritten); another defect under a taken name, or a defect on a defect, refused
    lay = base.tokenized_as("default-shifted_loss_mask")
    before = {k: v for k, v in _files(store, lay).items() if "/" in k}
    assert plant_defect(s3_client, cfg.output_uri, "shifted_loss_mask")["rows_out"] == shifted["rows_out"]
    assert {k: v for k, v in _files(store, lay).items() if "/" in k} == before
    with pytest.raises(DefectError, match="exists with"):
        plant_defect(s3_client, cfg.output_uri, "thinking_off_as_on", name="default-shifted_loss_mask")
    with pytest.raises(DefectError, match="already has a planted defect"):
        plant_defect(s3_client, cfg.output_uri, "thinking_off_as_on", source="default-shifted_loss_mask")
    # a tokenize run with the default settings and no name resumes 'default', never a defect made from it
    again = plan(s3_client, [cfg.output_uri], TokenizeConfig.from_params({**common, "workers": 1}))
    assert again["datasets"][0]["tokenization"] == "default" and again["datasets"][0]["already_done"] == len(parts)
    with pytest.raises(ConfigError, match=r"tokenization 'default-shifted_loss_mask' .*other settings.*defect"):
        plan(s3_client, [cfg.output_uri], TokenizeConfig.from_params({**common, "tokenization": "default-shifted_loss_mask"}))
