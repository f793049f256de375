"""Near-duplicate prompts (MinHash LSH): known pairs and non-pairs, id-order determinism, samples, and the
parquet file validation writes (on moto) and tokenize reads."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import quality_texts as qt

from dflash_pipeline.dataset.layout import DatasetLayout
from dflash_pipeline.dataset.store import Store
from dflash_pipeline.steps.quality.near_dup import (
    NearDuplicateFinder,
    load_near_duplicates,
    prompt_text,
    shingles,
    write_near_duplicates,
)

REPO = Path(__file__).resolve().parents[2]

BASE = ("A farmer has 17 sheep and all but 9 run away. How many sheep does the farmer have left? Explain the trick "
        "in the wording, then give the number and say why a quick reader often answers 8 instead.")
PAIRS = {
    "recased": BASE.upper(),
    "punctuation": BASE.replace(".", "!").replace(",", " ;").replace("?", " ??"),
    "whitespace": "  " + BASE.replace(" ", "\n", 5) + "\n\n",
}
NON_PAIRS = {
    "other_problem": "Two trains leave stations 300 km apart at 60 and 90 km/h towards each other. When do they meet?",
    "same_topic": "A farmer has sheep and goats. There are 30 heads and 74 legs in total. How many goats are there?",
    "short": "How many sheep?",
}


def find(prompts: dict[str, str], threshold: float = 0.9, num_perm: int = 128) -> dict[str, tuple[str, float]]:
    f = NearDuplicateFinder(threshold, num_perm)
    f.add(list(prompts), list(prompts.values()))
    return {i: (d, s) for i, d, s in f.finish()}


def test_known_pairs_are_found_and_non_pairs_are_not() -> None:
    prompts = {"a-base": BASE, **{f"b-{k}": v for k, v in PAIRS.items()}, **{f"c-{k}": v for k, v in NON_PAIRS.items()}}
    got = find(prompts)
    assert {k: d for k, (d, _) in got.items()} == {f"b-{k}": "a-base" for k in PAIRS}
    assert all(s == 1.0 for _, s in got.values())  # the same word 3-grams after normalisation


def test_a_small_edit_in_a_long_prompt_is_a_pair_and_a_rewrite_is_not() -> None:
    words = qt.PROBABILITY_THINKING.split()[:150]  # a long prompt: ~150 words, one edit changes 3 of ~148 3-grams
    one_edit = list(words)
    one_edit[40] = "goats"
    rewritten = list(words)
    for i in range(0, len(rewritten), 4):
        rewritten[i] = f"w{i}"
    got = find({"a": " ".join(words), "b": " ".join(one_edit), "c": " ".join(rewritten)})
    assert set(got) == {"b"} and got["b"][0] == "a" and got["b"][1] >= 0.9


def test_first_by_id_order_keeps_whatever_the_read_order() -> None:
    prompts = {"x3": BASE, "x1": PAIRS["recased"], "x2": NON_PAIRS["other_problem"], "x0": PAIRS["punctuation"]}
    items = list(prompts.items())
    results = []
    for seed in range(4):
        random.Random(seed).shuffle(items)
        f = NearDuplicateFinder()
        f.add([k for k, _ in items], [v for _, v in items])
        results.append(f.finish())
    assert all(r == results[0] for r in results)
    assert [(i, d) for i, d, _ in results[0]] == [("x1", "x0"), ("x3", "x0")]


def test_samples_of_one_id_are_one_prompt_and_count_as_its_rows() -> None:
    f = NearDuplicateFinder()
    f.add(["a", "b", "b", "b"], [BASE, PAIRS["recased"], PAIRS["recased"], PAIRS["recased"]], tags=[1, 2, 2, 2])
    assert f.finish() == [("b", "a", 1.0)]
    assert f.rows == [3] and f.tags == [2] and f.prompts == 2


def test_only_user_turns_make_the_prompt() -> None:
    msgs = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Hello there"},
            {"role": "assistant", "content": "Hi"}, {"role": "user", "content": "What is 2+2?"}]
    assert prompt_text(msgs) == "Hello there\nWhat is 2+2?"
    assert len(shingles("")) == 0 and len(shingles("Hi!")) == 1 and len(shingles("一二三四")) == 2
    assert set(shingles("One two three, one TWO three!")) == set(shingles("one two three one two three"))
    assert len(shingles("one two three one two three")) == 3  # a set: "one two three" once


def test_templated_sample_prompts_differ_enough() -> None:
    """data/sample_prompts.jsonl: 2,000 templated prompts whose numbers differ. At the default threshold only
    near-verbatim ones are pairs (docs/quality.md gives the counts at lower thresholds)."""
    rows = [json.loads(line) for line in (REPO / "data" / "sample_prompts.jsonl").read_text().splitlines()]
    ids = [r.get("id") or f"row{i}" for i, r in enumerate(rows)]
    texts = [prompt_text(r.get("messages") or [{"role": "user", "content": r["prompt"]}]) for r in rows]
    f = NearDuplicateFinder()
    f.add(ids, texts)
    found = f.finish()
    assert len(found) < 0.01 * len(rows)
    by_id = dict(zip(ids, texts))
    for pid, dup_of, sim in found:
        assert sim >= 0.9 and pid > dup_of and by_id[pid] != "" and by_id[dup_of] != ""


def test_written_idempotently_and_read_by_id(s3_client: Any, bucket: str) -> None:
    layout = DatasetLayout(bucket, "ds/near")
    store = Store(s3_client, bucket)
    assert load_near_duplicates(store, layout) == {}  # never validated with quality signals
    rows = [("b", "a", 1.0), ("c", "a", 0.93)]
    key = write_near_duplicates(store, layout, rows)
    assert key == "ds/near/quality/near_duplicates.parquet"
    first = s3_client.get_object(Bucket=bucket, Key=key)["Body"].read()
    write_near_duplicates(store, layout, rows)
    assert s3_client.get_object(Bucket=bucket, Key=key)["Body"].read() == first
    assert load_near_duplicates(store, layout) == {"b": "a", "c": "a"}
    write_near_duplicates(store, layout, [])
    assert load_near_duplicates(store, layout) == {}
