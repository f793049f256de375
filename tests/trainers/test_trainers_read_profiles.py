"""The trainers read our files as they are: their own loaders, on files our profile functions wrote.

Training rows are built as the tokenizer builds them from an engine's answers: Qwen's real BPE, a chat
template of this project (Qwen3.6-style: the generation prompt opens ``<think>``; Qwen3-style: the model
writes it), real text (Python's documentation topics, some non-ASCII), one row per assistant turn with
the context the request carried (earlier answers without their reasoning), rows stopped by ``length``,
rows longer than max_length, a short answer, a context longer than max_length, and rows whose "engine"
ids are a valid but non-canonical encoding of their text (a token split in two, as sampling can produce).
Then every profile is written with steps/tokenize/profiles.py after the DFlash filter, and
tests/trainers/loaders.py loads each file in .venv-trainers with SpecForge 0.2.0, speculators 0.9.0 and
datasets, and dumps what they would train on.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from dflash_pipeline.dev.qwen_tokenizer import copy_with_template
from dflash_pipeline.steps.tokenize.card import dataset_card
from dflash_pipeline.steps.tokenize.dflash import DROP_FEW_LOSS, DROP_NO_LOSS, dflash_ready
from dflash_pipeline.steps.tokenize.profiles import (
    HF_FEATURES,
    SKIP_EMPTY_REASONING,
    SKIP_LENGTH,
    SKIP_NOT_CANONICAL,
    TRAINING_ROW_SCHEMA,
    build_profile_files,
)
from dflash_pipeline.steps.tokenize.provenance import specforge_template_name
from dflash_pipeline.steps.validate.tokencount import load_recounter

pytestmark = pytest.mark.slow

MAX_LENGTH = 1024
NEWLINE = "\n"


def _texts() -> list[str]:
    from pydoc_data.topics import topics

    return [topics[k].strip() for k in sorted(topics)]


def _conversations(seed: int, thinking: bool) -> list[list[dict[str, Any]]]:
    """Conversations as generated: user/system turns, assistant turns with reasoning, content, finish and
    flags for the special rows (`case`)."""
    rng = random.Random(seed)
    texts = _texts()
    corpus = "\n\n".join(texts)
    convs = []
    for c in range(18):
        msgs: list[dict[str, Any]] = []
        if c % 3 == 0:
            msgs.append({"role": "system", "content": "You answer questions about Python precisely."})
        turns = 1 + c % 3
        for k in range(turns):
            t = texts[(c * 5 + k) % len(texts)]
            start = rng.randrange(0, max(1, len(t) - 1500))
            question = t[start: start + rng.randrange(80, 400)].strip() + "\n\nExplain this. Grüße, 你好!"
            msgs.append({"role": "user", "content": question})
            b0 = rng.randrange(0, len(corpus) - 3000)
            reasoning = corpus[b0: b0 + rng.randrange(300, 1200)].strip() if thinking else None
            content = corpus[b0 + 1200: b0 + 1200 + rng.randrange(300, 1200)].strip()
            msgs.append({"role": "assistant", "reasoning": reasoning, "content": content, "finish": "stop", "case": None})
        last = msgs[-1]
        if c == 1:
            last["finish"], last["case"] = "length", "length"
        elif c == 2 and thinking:
            last["reasoning"] = " ".join(texts[c:c + 3])[:9000].strip()  # longer than MAX_LENGTH: cut
            last["case"] = "cut"
        elif c == 3:
            last["reasoning"], last["content"] = ("Sure." if thinking else None), "Yes."
            last["case"] = "short"
        elif c in (4, 5):
            last["case"] = "noncanonical"
        elif c == 7 and thinking:
            last["reasoning"] = ""  # finished without thinking: SpecForge's expand refuses such turns
            last["content"] = texts[30][:800].strip()
            last["case"] = "no_reasoning"
        elif c == 8:
            msgs[-2]["content"] = "\n\n".join(texts[20:40])[:12000]  # the context alone is longer than MAX_LENGTH
            last["case"] = "long_context"
        convs.append(msgs)
    return convs


def _split_token(rec: Any, ids: list[int], rng: random.Random) -> list[int]:
    """`ids` with one ASCII letter token split into two valid tokens: same text, not the canonical ids."""
    tok = rec.tokenizer
    for _ in range(1000):
        i = rng.randrange(len(ids) - 2)
        piece = tok.decode([ids[i]])
        if len(piece) >= 3 and piece.strip().isalpha() and piece.isascii():
            left, right = tok.encode(piece[:2], add_special_tokens=False).ids, tok.encode(piece[2:], add_special_tokens=False).ids
            if len(left) == 1 and len(right) == 1:
                return ids[:i] + left + right + ids[i + 1:]
    raise AssertionError("no splittable token found")


DOMAINS = ("math", "code", "chat")


def build_training_rows(rec: Any, convs: list[list[dict[str, Any]]], thinking: bool, seed: int) -> tuple[pa.Table, list[Any], dict[str, str]]:
    """The training rows a tokenizer builds from these generations: prompt ids as the engine rendered the
    request (history answers without reasoning), then the generated ids, then the template's "\\n" after
    <|im_end|> (trained, SpecForge's default). Returns the table, each row's conversation, key → case."""
    rng = random.Random(seed)
    tok = rec.tokenizer
    nl = tok.encode(NEWLINE, add_special_tokens=False).ids
    rows, conversations, cases = [], [], {}
    for c, msgs in enumerate(convs):
        history: list[dict[str, Any]] = []
        n_assist = sum(m["role"] == "assistant" for m in msgs)
        turn = 0
        for m in msgs:
            if m["role"] != "assistant":
                history.append({"role": m["role"], "content": m["content"]})
                continue
            prompt = rec.render_messages(history, add_generation_prompt=True)
            trained = {"role": "assistant", "content": m["content"]}
            if m["reasoning"] is not None:
                trained["reasoning_content"] = m["reasoning"]
            full = rec.render_messages([*history, trained])
            assert full.startswith(prompt) and full.endswith("<|im_end|>\n"), (prompt[-80:], full[-80:])
            gen_ids = tok.encode(full[len(prompt):-1], add_special_tokens=False).ids
            prompt_ids = tok.encode(prompt, add_special_tokens=False).ids
            finish, tail = m["finish"], nl
            if m["case"] == "length":
                gen_ids, tail = gen_ids[: len(gen_ids) // 3], []
            elif m["case"] == "noncanonical":
                gen_ids = _split_token(rec, gen_ids, rng)
                assert tok.encode(full, add_special_tokens=False).ids != prompt_ids + gen_ids + nl
            ids = prompt_ids + gen_ids + tail
            mask = [0] * len(prompt_ids) + [1] * (len(gen_ids) + len(tail))
            key = f"conv{c}" + (f"#turn={turn}" if n_assist > 1 else "")
            rows.append({"id": f"conv{c}", "sample": 0, "turn": turn, "key": key, "input_ids": ids, "loss_mask": mask,
                         "num_tokens": len(ids), "num_loss_tokens": sum(mask), "truncated_to_max_length": False,
                         "finish_reason": finish, "ids_source": "engine",
                         # the input row's labels on half the conversations ("" in the JSONL files for the rest)
                         **({"source": "set-a", "domain": DOMAINS[c % 3], "metadata": json.dumps({"c": c})}
                            if c % 2 == 0 else {}), "thinking": thinking})
            conversations.append([*history, {"role": "assistant", "content": m["content"] if finish == "stop" else "",
                                             "reasoning": m["reasoning"]}])
            cases[key] = m["case"] or ""
            history.append({"role": "assistant", "content": m["content"]})
            turn += 1
    return pa.Table.from_pylist(rows, schema=TRAINING_ROW_SCHEMA), conversations, cases


CASES = [
    # (our chat template, thinking, the SpecForge template for it)
    ("qwen3.6", True, "qwen3.5"),
    ("qwen3.6", False, "qwen3-instruct"),
    ("qwen3", True, "qwen3-thinking"),
]


@pytest.mark.parametrize(("template", "thinking", "sf_template"), CASES, ids=[f"{t}-{'think' if th else 'nothink'}" for t, th, _ in CASES])
def test_trainers_load_every_kept_row(template: str, thinking: bool, sf_template: str, qwen_tokenizer: Path,
                                      tmp_path: Path, run_loaders: Any) -> None:
    tok_dir = copy_with_template(tmp_path / "tokenizer", template, source=qwen_tokenizer)
    rec = load_recounter(str(tok_dir), lambda b, k: None, enable_thinking=thinking, workdir=tmp_path / "tok-work")
    header = rec.render_messages([{"role": "user", "content": "q"}], add_generation_prompt=True).split("<|im_end|>\n")[-1]
    assert specforge_template_name(header, thinking) == sf_template
    convs = _conversations(seed=23, thinking=thinking)
    table, conversations, cases = build_training_rows(rec, convs, thinking, seed=23)
    table = table.append_column("conversation", pa.array(conversations, type=pa.list_(pa.struct(
        [("role", pa.string()), ("content", pa.string()), ("reasoning", pa.string())]))))

    # min_loss_tokens 32 (not the default 2) so the "short" case is a drop the trainers never see.
    result = dflash_ready(table, max_length=MAX_LENGTH, min_loss_tokens=32)
    kept_keys = result.table.column("key").to_pylist()
    by_case = {cases[k] for k in kept_keys}
    assert result.dropped.get(DROP_NO_LOSS) == 1 and "long_context" not in by_case  # context alone > max_length
    assert result.dropped.get(DROP_FEW_LOSS) == 1 and "short" not in by_case  # "Yes." is < 32 loss tokens
    assert {"length", "noncanonical"} <= by_case and (result.cut >= 1 if thinking else True)

    root = tmp_path / "dataset"
    out = build_profile_files(result.table, 0, ["parquet", "specforge", "speculators"], thinking=thinking)
    again = build_profile_files(result.table, 0, ["parquet", "specforge", "speculators"], thinking=thinking)
    assert out.files == again.files, "profile bytes are deterministic"
    for key, data in out.files.items():
        (root / key).parent.mkdir(parents=True, exist_ok=True)
        (root / key).write_bytes(data)
    ours = {k: (i, m) for k, i, m in zip(kept_keys, result.table.column("input_ids").to_pylist(),
                                          result.table.column("loss_mask").to_pylist())}
    ordered = [(i, m) for i, m in ours.values()]
    multiset = Counter(json.dumps(v) for v in ordered)
    card = dataset_card({"rows_in": table.num_rows, "rows_out": result.table.num_rows, "dropped_by_reason": result.dropped},
                        {"profiles": ["parquet", "specforge", "speculators"], "max_length": MAX_LENGTH,
                         "min_loss_tokens": 32, "specforge_template": sf_template}, {"model_resolved": "test-model"})
    (root / "README.md").write_text(card)
    globs = ["tokenized/specforge/part-*.jsonl", "tokenized/specforge-conversations/part-*.jsonl",
             "tokenized/speculators/part-*.jsonl"]
    (sf_tok, sf_rows), (sp, sp_rows), (pq_sum, pq_rows), (conv_sum, conv_rows) = run_loaders([
        ("specforge-tokens", ["--file", str(root / "tokenized/specforge/part-000000.jsonl"), "--max-length", str(MAX_LENGTH)]),
        ("speculators", ["--data", str(root / "tokenized/speculators"), "--tokenizer", str(tok_dir),
                         "--prepared", str(tmp_path / "prepared"), "--max-length", str(MAX_LENGTH)]),
        ("parquet", ["--root", str(root), "--json-globs", *globs]),
        ("specforge-conversations", ["--file", str(root / "tokenized/specforge-conversations/part-000000.jsonl"),
                                     "--tokenizer", str(tok_dir), "--chat-template", sf_template,
                                     "--max-length", str(MAX_LENGTH)]),
    ])

    # SpecForge, pre-tokenized path: every kept row, in order, exactly our ids and mask.
    assert sf_tok["min_loss_tokens"] == 2 and sf_tok["loss_mask_filter"] == "has_consecutive_supervised_tokens"
    assert [(r["input_ids"], r["loss_mask"]) for r in sf_rows] == ordered

    # speculators: prepare-data's passthrough, then the training ArrowDataset (shuffled, keys dropped).
    assert sp["columns"] == ["input_ids", "loss_mask", "seq_len"]
    assert Counter(json.dumps((r["input_ids"], r["loss_mask"])) for r in sp_rows) == multiset

    # Parquet through datasets, directly and through the dataset card's config, with the declared features;
    # the JSONL profiles with the json builder.
    assert pq_sum["features"] == HF_FEATURES and pq_sum["config_names"] == ["parquet"]
    n_conv = out.conversations.rows
    assert pq_sum["configs"] == dict(zip(globs, [len(ours), n_conv, len(ours)]))
    assert {r["key"]: (r["input_ids"], r["loss_mask"]) for r in pq_rows} == ours

    # SpecForge, conversations path: its template re-renders and re-tokenizes the text.
    skipped = out.conversations.skipped
    assert skipped.get(SKIP_LENGTH) == 1
    assert skipped.get(SKIP_EMPTY_REASONING, 0) == (1 if thinking else 0)
    assert conv_sum["keyed_by"] == "entry" and conv_sum["entry_rows"] == n_conv, conv_sum  # SpecForge dropped none
    system_of = {k: c[0]["role"] == "system" for k, c in zip(kept_keys, result.table.column("conversation").to_pylist())}
    default_system = sf_template != "qwen3.5"  # specforge/data/template.py: qwen3.5's system_prompt is ""
    equal, differ = [], []
    for r in conv_rows:
        (equal if (r["input_ids"], r["loss_mask"]) == ours[r["key"]] else differ).append(r["key"])
    expected_differ = {k for k in (r["key"] for r in conv_rows)
                       if cases[k] == "noncanonical" or (default_system and not system_of[k])}
    assert set(differ) == expected_differ, (sorted(differ), sorted(expected_differ))
    assert len(equal) == n_conv - len(expected_differ) and equal
    # Non-canonical engine ids: when the tokenizer marks them, the export leaves them out, counted.
    marked = result.table.set_column(result.table.schema.get_field_index("ids_canonical"), "ids_canonical",
                                     pa.array([cases[k] != "noncanonical" for k in kept_keys]))
    out2 = build_profile_files(marked, 0, ["specforge"], thinking=thinking)
    assert out2.conversations.skipped.get(SKIP_NOT_CANONICAL) == 2
    assert out2.conversations.rows == n_conv - 2
