"""Output profiles, the DFlash filter, provenance and the dataset card, on small hand-made training rows.

The trainers' own loaders read these files in tests/trainers (slow, .venv-trainers); here: the rules.
"""

from __future__ import annotations

import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from dflash_pipeline.config import TOKENIZE_PARAM_SCHEMAS, ConfigError, TokenizeConfig
from dflash_pipeline.steps.tokenize.card import dataset_card, front_matter
from dflash_pipeline.steps.tokenize.dflash import (
    DEFAULT_MAX_LENGTH,
    DEFAULT_MIN_LOSS_TOKENS,
    DFLASH_BLOCK_SIZE,
    DROP_FEW_LOSS,
    DROP_NO_LOSS,
    DROP_NO_PAIR,
    dflash_ready,
)
from dflash_pipeline.steps.tokenize.profiles import (
    HF_FEATURES,
    SKIP_EMPTY_CONTENT,
    SKIP_EMPTY_REASONING,
    SKIP_LENGTH,
    SKIP_NOT_CANONICAL,
    SKIP_ROLE_ORDER,
    TRAINING_ROW_SCHEMA,
    build_profile_files,
    check_profiles,
    profile_keys,
)
from dflash_pipeline.steps.tokenize.provenance import manifest_provenance, provenance, sha256_hex, specforge_template_name


def row(key: str, mask: list[int], *, finish: str = "stop", sample: int = 0, turn: int = 0) -> dict:
    ids = list(range(100, 100 + len(mask)))
    return {"id": key.split("#")[0], "sample": sample, "turn": turn, "key": key, "input_ids": ids, "loss_mask": mask,
            "num_tokens": len(ids), "num_loss_tokens": sum(mask), "truncated_to_max_length": False,
            "finish_reason": finish, "ids_source": "engine"}


def table(rows: list[dict]) -> pa.Table:
    return pa.Table.from_pylist(rows, schema=TRAINING_ROW_SCHEMA)


def test_defaults_come_from_the_dflash_recipe() -> None:
    # SpecForge 0.2.0's DFlash rule (dflash_min_loss_tokens: 2), not 2 x its block size: docs/quality.md
    assert DEFAULT_MIN_LOSS_TOKENS == 2 and DFLASH_BLOCK_SIZE == 16
    assert DEFAULT_MAX_LENGTH == 4096 == TokenizeConfig.from_params({}).max_length


def test_filter_cuts_then_drops_by_first_reason() -> None:
    t = table([
        row("keep", [0] * 3 + [1] * 5),
        row("cut", [0] * 3 + [1] * 4 + [1] * 5),          # 12 tokens, cut to 8: 5 loss tokens left
        row("context-too-long", [0] * 9 + [1] * 3),       # nothing trained within 8
        row("few", [0] * 6 + [1] * 2),                    # 2 < 3
        row("no-pair", [0, 1, 0, 1, 0, 1, 0, 1]),         # 4 loss tokens, none adjacent
    ])
    r = dflash_ready(t, max_length=8, min_loss_tokens=3)
    assert r.dropped == {DROP_NO_LOSS: 1, DROP_FEW_LOSS: 1, DROP_NO_PAIR: 1}
    assert r.table.column("key").to_pylist() == ["keep", "cut"] and list(r.kept) == [0, 1] and r.cut == 1
    cut = r.table.to_pylist()[1]
    assert cut["input_ids"] == list(range(100, 108)) and cut["loss_mask"] == [0, 0, 0, 1, 1, 1, 1, 1]
    assert (cut["num_tokens"], cut["num_loss_tokens"], cut["truncated_to_max_length"]) == (8, 5, True)
    assert r.table.to_pylist()[0] == t.to_pylist()[0]  # an uncut row is untouched
    # the pair rule off: the alternating row stays; min 0 keeps a row with 1 loss token but never one with none
    r2 = dflash_ready(t, max_length=8, min_loss_tokens=0, require_consecutive=False)
    assert r2.dropped == {DROP_NO_LOSS: 1} and "no-pair" in r2.table.column("key").to_pylist()


def test_filter_of_an_empty_part() -> None:
    r = dflash_ready(table([]))
    assert r.table.num_rows == 0 and r.dropped == {} and r.cut == 0


def test_filter_pairs_do_not_cross_rows_and_carry_other_columns() -> None:
    # row a ends with a loss token, row b starts with one: no pair in either
    t = table([row("a", [0, 0, 0, 1]), row("b", [1, 0, 0, 0])]).append_column("conversation", pa.array([["x"], ["y"]]))
    r = dflash_ready(t, max_length=16, min_loss_tokens=1)
    assert r.dropped == {DROP_NO_PAIR: 2} and r.table.num_rows == 0
    r = dflash_ready(table([row("a", [0, 1, 1])]).append_column("conversation", pa.array([["x"]])), max_length=2,
                     min_loss_tokens=1, require_consecutive=False)
    assert r.table.column("conversation").to_pylist() == [["x"]] and r.table.column("loss_mask").to_pylist() == [[0, 1]]


CONV = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1", "reasoning": None},
        {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2", "reasoning": "r2"}]


def test_profiles_carry_the_rows_labels() -> None:
    labelled = {"source": "gsm8k", "domain": "math", "metadata": '{"level":3}', "thinking": False}
    t = table([row("a", [0, 1, 1]) | labelled, row("b#sample=1", [0, 1, 1], sample=1)])
    out = build_profile_files(t, 3, ["speculators", "parquet", "specforge"], thinking=True, conversations=[CONV, CONV])
    sf = [json.loads(x) for x in out.files["tokenized/specforge/part-000003.jsonl"].splitlines()]
    assert {k: sf[0][k] for k in labelled} == labelled
    assert {k: sf[1][k] for k in labelled} == {"source": "", "domain": "", "metadata": "", "thinking": True}
    sp = [json.loads(x) for x in out.files["tokenized/speculators/part-000003.jsonl"].splitlines()]
    assert {k: sp[0]["metadata"][k] for k in labelled} == labelled
    ev = [json.loads(x) for x in out.files["tokenized/specforge-conversations/part-000003.jsonl"].splitlines()]
    assert {k: ev[0][k] for k in labelled} == labelled
    pf = pq.read_table(io.BytesIO(out.files["tokenized/parquet/part-000003.parquet"])).to_pylist()
    assert {k: pf[0][k] for k in labelled} == labelled
    assert [pf[1][k] for k in ("source", "domain", "metadata", "thinking")] == [None, None, None, None]


def test_profile_files_layout_and_contents() -> None:
    t = table([row("p#sample=1#turn=1", [0, 1, 1], sample=1, turn=1)])
    out = build_profile_files(t, 7, ["speculators", "parquet", "specforge"], thinking=True, conversations=[CONV])
    assert sorted(out.files) == ["tokenized/parquet/part-000007.parquet", "tokenized/specforge-conversations/part-000007.jsonl",
                                 "tokenized/specforge/part-000007.jsonl", "tokenized/speculators/part-000007.jsonl"]
    assert profile_keys("specforge", 7)["tokens"] == "tokenized/specforge/part-000007.jsonl"
    sf = json.loads(out.files["tokenized/specforge/part-000007.jsonl"])
    # the row's labels ride along ("" for none: datasets' json builder fixes a column's type from its first file)
    assert sf == {"id": "p#sample=1#turn=1", "input_ids": [100, 101, 102], "loss_mask": [0, 1, 1],
                  "source": "", "domain": "", "thinking": True, "metadata": "", "sampling": ""}
    sp = json.loads(out.files["tokenized/speculators/part-000007.jsonl"])
    assert (sp["id"], sp["primary_id"], sp["input_ids"], sp["loss_mask"]) == ("p#sample=1#turn=1", "p#sample=1", [100, 101, 102], [0, 1, 1])
    assert sp["metadata"]["finish_reason"] == "stop" and sp["metadata"]["turn"] == 1
    ev = json.loads(out.files["tokenized/specforge-conversations/part-000007.jsonl"])
    assert ev["status"] == "success" and ev["source_id"] == "p#sample=1" and ev["assistant_turn_index"] == 1
    # history answers without reasoning, the trained turn with it
    assert ev["conversations"] == [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
                                   {"role": "user", "content": "q2"},
                                   {"role": "assistant", "content": "a2", "reasoning_content": "r2"}]
    pf = pq.read_table(io.BytesIO(out.files["tokenized/parquet/part-000007.parquet"]))
    assert pf.schema.remove_metadata() == TRAINING_ROW_SCHEMA and pf.to_pylist() == t.to_pylist()
    assert json.loads(pf.schema.metadata[b"huggingface"])["info"]["features"] == HF_FEATURES
    assert HF_FEATURES["input_ids"] == {"feature": {"dtype": "int32", "_type": "Value"}, "_type": "List"}
    assert HF_FEATURES["thinking"] == {"dtype": "bool", "_type": "Value"}
    assert HF_FEATURES["domain"] == HF_FEATURES["metadata"] == {"dtype": "string", "_type": "Value"}
    again = build_profile_files(t, 7, ["parquet", "specforge", "speculators"], thinking=True, conversations=[CONV])
    assert again.files == out.files


def test_conversation_export_leaves_out_what_specforge_cannot_render_as_generated() -> None:
    bad_order = [{"role": "assistant", "content": "a"}, {"role": "user", "content": "q"}, {"role": "assistant", "content": "b", "reasoning": "r"}]
    empty_user = [{"role": "user", "content": " "}, {"role": "assistant", "content": "a", "reasoning": "r"}]
    no_reasoning = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning": ""}]
    ok = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning": "r"}]
    rows = [row(f"k{i}", [0, 1, 1]) for i in range(6)]
    rows[4]["finish_reason"] = "length"
    t = table(rows)
    t = t.set_column(t.schema.get_field_index("ids_canonical"), "ids_canonical",
                     pa.array([True, True, True, True, True, False]))
    out = build_profile_files(t, 0, ["specforge"], thinking=True, conversations=[bad_order, empty_user, no_reasoning, ok, ok, ok])
    stats = out.conversations
    assert stats.skipped == {SKIP_ROLE_ORDER: 1, SKIP_EMPTY_CONTENT: 1, SKIP_EMPTY_REASONING: 1, SKIP_LENGTH: 1, SKIP_NOT_CANONICAL: 1}
    assert stats.rows == 1 and stats.without_system_message == 0 and out.rows == {"specforge": 6, "specforge_conversations": 1}
    # thinking off: no reasoning is demanded
    out = build_profile_files(table([row("k", [0, 1, 1])]), 0, ["specforge"], thinking=False,
                              conversations=[[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning": None}]])
    assert out.conversations.rows == 1 and out.conversations.without_system_message == 1
    with pytest.raises(ValueError, match="conversations"):
        build_profile_files(table([row("k", [0, 1, 1])]), 0, ["specforge"], thinking=True)


def test_profiles_param_refused_with_a_clear_message() -> None:
    cfg = TokenizeConfig.from_params({"profiles": ["speculators", "parquet"], "min_loss_tokens": 2})
    assert cfg.profiles == ("parquet", "speculators") and cfg.min_loss_tokens == 2
    assert TokenizeConfig.from_params({"formats": ["speculators"]}).profiles == ("speculators",)
    # the DAG's default: Parquet (exactness checks, datasets) and SpecForge's files (DFlash training)
    assert TokenizeConfig.from_params({}).profiles == ("parquet", "specforge")
    for conf, msg in [({"profiles": ["nemo"]}, "is not one of"), ({"profiles": []}, "at least 1"),
                      ({"profiles": ["parquet", "parquet"]}, "unique"), ({"min_loss_tokens": -1}, "minimum of 0"),
                      ({"require_consecutive_loss_tokens": 1}, "not of type boolean"), ({"max_length": 8}, "minimum of 16")]:
        with pytest.raises(ConfigError, match=msg):
            TokenizeConfig.from_params(conf)
    for name in ("formats", "min_loss_tokens", "require_consecutive_loss_tokens", "max_length"):
        assert TOKENIZE_PARAM_SCHEMAS[name]["description"]
    with pytest.raises(ConfigError, match="profiles"):
        check_profiles(["parquet", "eagle"])


MANIFEST = {
    "plan_id": "p1", "model_resolved": "Qwen/Qwen3.6-27B",
    "pinned": {"sampling": {"temperature": 0.6, "top_p": 0.95, "max_tokens": 4096, "enable_thinking": True, "seed": 7}},
    "input": {"uri": "s3://b/p.jsonl", "sha256": "ab", "prompts": 10, "samples_per_prompt": 2, "regenerate": "all_turns"},
    "servers": [{"name": "a", "engine": "vllm", "version": "0.32.0", "served_model_name": "Qwen/Qwen3.6-27B"},
                {"name": "b", "engine": "vllm", "version": "0.32.0", "served_model_name": "Qwen/Qwen3.6-27B"},
                {"name": "c", "engine": "sglang", "version": "0.5.14", "model_path": "/m"},
                {"name": "d", "base_url": "http://x", "unreachable": "refused"}],
}


def test_provenance_hashes_and_manifest_facts() -> None:
    p = provenance(MANIFEST, b'{"model": {}}', "{{ messages }}", "s3://b/tok/")
    assert p["tokenizer"]["tokenizer_json_sha256"] == sha256_hex(b'{"model": {}}')
    assert p["tokenizer"]["specforge_template_hash"] == sha256_hex("{{ messages }}")[:12]
    g = manifest_provenance(MANIFEST)
    assert g["engines"] == [{"engine": "sglang", "version": "0.5.14"}, {"engine": "vllm", "version": "0.32.0"}]
    assert g["model"] == "Qwen/Qwen3.6-27B" and g["sampling"]["seed"] == 7 and g["samples_per_prompt"] == 2 and g["servers"] == 4
    assert specforge_template_name("<|im_start|>assistant\n<think>\n", True) == "qwen3.5"
    assert specforge_template_name("<|im_start|>assistant\n", True) == "qwen3-thinking"
    assert specforge_template_name("<|im_start|>assistant\n<think>\n\n</think>\n\n", False) == "qwen3-instruct"
    assert specforge_template_name("<|start_header_id|>assistant<|end_header_id|>\n\n", True) is None


def test_dataset_card_front_matter_and_body() -> None:
    settings = {"profiles": ["parquet", "specforge", "speculators"], "max_length": 4096, "min_loss_tokens": 32,
                "enable_thinking": True, "specforge_template": "qwen3.5",
                "provenance": provenance(MANIFEST, b"tok", "tmpl", "s3://b/tok/")}
    report = {"rows_in": 120, "rows_out": 100, "dropped_by_reason": {"fewer_than_min_loss_tokens": 20},
              "tokens": 123456, "loss_tokens": 65432, "truncated_to_max_length": 3,
              "profiles": {"specforge": {"specforge_conversations": {"rows": 95, "skipped": {"finish_reason_length": 5}}}}}
    card = dataset_card(report, settings, MANIFEST)
    assert card == dataset_card(report, settings, MANIFEST)
    head = yaml.safe_load(card.split("---\n")[1])
    assert head["configs"] == [{"config_name": "parquet", "data_files": [{"split": "train", "path": "tokenized/parquet/part-*.parquet"}],
                                "default": True}]
    assert {f["name"]: f.get("list", f.get("dtype")) for f in head["dataset_info"][0]["features"]}["loss_mask"] == "int8"
    for text in ("Qwen/Qwen3.6-27B", "vllm 0.32.0", "sglang 0.5.14", "| dropped: fewer_than_min_loss_tokens | 20 |",
                 "prompts_path", "chat_template: qwen3.5", "train_only_last_turn: true", "speculators prepare-data",
                 sha256_hex("tmpl")[:12], "finish_reason_length 5", "max_length: 4096"):
        assert text in card, text
    # without Parquet, the JSONL configs are declared (one format per folder for `datasets`)
    assert [c["config_name"] for c in front_matter(["specforge", "speculators"])["configs"]] == \
        ["specforge", "specforge_conversations", "speculators"]
