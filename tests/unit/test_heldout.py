"""Row labels (source, domain, metadata, extra keys) and the held-out split, without S3."""

from __future__ import annotations

import gzip
import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_pipeline.config import ConfigError, RunConfig, TokenizeConfig
from dflash_pipeline.dataset.heldout import (
    DEFAULT_SALT,
    HeldoutSplit,
    HeldoutWriter,
    heldout_score,
    ids_sha256,
    iter_heldout_prompts,
    read_heldout_ids,
)
from dflash_pipeline.dataset.prompts import Prompt, PromptFileError, Reject, derive_id, iter_prompt_file
from dflash_pipeline.dataset.records import (
    decode_inputs,
    decode_metadata,
    decode_part,
    encode_inputs,
    encode_metadata,
    encode_part,
)
from dflash_pipeline.serving.sglang import Completion, RequestFailure
from dflash_pipeline.steps.generate.outcomes import completion_row, error_row
from dflash_pipeline.steps.tokenize.heldout import drop_heldout
from dflash_pipeline.steps.tokenize.rowlabels import labels_by_unit, with_labels
from dflash_pipeline.steps.validate.breakdown import LabelTally, markdown

Q = [{"role": "user", "content": "q"}]


def _jsonl(*rows: object) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in rows)


def _parse(data: bytes, key: str = "p.jsonl") -> list[Prompt | Reject]:
    return list(iter_prompt_file(io.BytesIO(data), key))


# -- labels ---------------------------------------------------------------------------------------------
def test_source_domain_metadata_and_extra_keys_are_kept() -> None:
    a, b, c, d = _parse(_jsonl(
        {"id": "a", "prompt": "x", "source": "gsm8k", "domain": "math", "metadata": {"level": 3}, "split": "train",
         "difficulty": 0.5},
        {"id": "b", "prompt": "y", "metadata": {"domain": "code", "lang": "py"}},
        {"id": "c", "prompt": "z"},
        {"id": "d", "prompt": "w", "domain": "chat", "metadata": {"domain": "code"}, "note": None},
    ))
    assert isinstance(a, Prompt) and (a.source, a.domain) == ("gsm8k", "math")
    assert a.metadata == {"level": 3, "split": "train", "difficulty": 0.5}, "extra keys go into metadata"
    assert isinstance(b, Prompt) and b.domain == "code" and b.source is None, "domain from metadata['domain']"
    assert isinstance(c, Prompt) and (c.source, c.domain, c.metadata) == (None, None, None)
    assert isinstance(d, Prompt) and d.domain == "chat" and d.metadata == {"domain": "code"}, "the row's own domain wins"


def test_metadata_object_wins_over_a_clashing_extra_key_and_json_string_metadata_reads() -> None:
    a, b = _parse(_jsonl({"prompt": "x", "tag": "top", "metadata": {"tag": "inner"}},
                         {"prompt": "y", "metadata": json.dumps({"k": [1, 2]})}))
    assert isinstance(a, Prompt) and a.metadata == {"tag": "inner"}
    assert isinstance(b, Prompt) and b.metadata == {"k": [1, 2]}


@pytest.mark.parametrize("row, reason", [
    ({"prompt": "x", "source": 3}, "'source' must be a string"),
    ({"prompt": "x", "domain": ["a"]}, "'domain' must be a string"),
    ({"prompt": "x", "metadata": [1]}, "'metadata' must be a JSON object"),
    ({"prompt": "x", "metadata": "not json"}, "not a JSON object"),
    ({"prompt": "x", "domain": "d" * 300}, "longer than"),
])
def test_bad_labels_are_rejects_with_a_reason(row: dict, reason: str) -> None:
    (got,) = _parse(_jsonl(row))
    assert isinstance(got, Reject) and reason in got.reason


def test_labels_do_not_change_the_derived_id() -> None:
    (a,) = _parse(_jsonl({"prompt": "same", "domain": "x", "extra": 1}))
    (b,) = _parse(_jsonl({"prompt": "same"}))
    assert isinstance(a, Prompt) and isinstance(b, Prompt)
    assert a.id == b.id == derive_id([{"role": "user", "content": "same"}])


def test_parquet_extra_columns_become_metadata() -> None:
    t = pa.table({"id": ["a", "b"], "prompt": ["x", "y"], "domain": ["math", None], "score": [1.5, None]})
    buf = io.BytesIO()
    pq.write_table(t, buf)
    a, b = _parse(buf.getvalue(), "p.parquet")
    assert isinstance(a, Prompt) and a.domain == "math" and a.metadata == {"score": 1.5}
    assert isinstance(b, Prompt) and b.domain is None and b.metadata is None, "null cells carry nothing"


def test_labels_ride_through_inputs_completion_and_error_rows() -> None:
    meta = {"b": 2, "a": "é"}
    enc = decode_inputs(encode_inputs([{"id": "p", "messages": Q, "sample": 1, "source": "s", "domain": "d",
                                        "metadata": meta}]))[0]
    assert (enc["source"], enc["domain"]) == ("s", "d")
    assert enc["metadata"] == '{"a":"é","b":2}' and decode_metadata(enc["metadata"]) == meta
    comp = Completion(reasoning="r", content="ans", finish_reason="stop", matched_stop=None, prompt_tokens=1,
                      completion_tokens=2, reasoning_tokens=None, model=None)
    row = completion_row(enc, comp, model="m", server="s0", attempts=1, latency_s=0.1, chunk=0, run_id="r")
    err = error_row(enc, RequestFailure("Timeout", "t", kind="transient"), model="m", server="s0", attempts=1,
                    chunk=0, run_id="r")
    row["thinking"] = True
    back = decode_part(encode_part([row, err])).to_pylist()
    assert [(r["source"], r["domain"], r["metadata"]) for r in back] == [("s", "d", enc["metadata"])] * 2
    assert [r["thinking"] for r in back] == [True, None]
    assert encode_metadata({}) is None and encode_metadata(None) is None


# -- the split ------------------------------------------------------------------------------------------
def test_split_is_deterministic_and_salted() -> None:
    ids = [f"id-{i}" for i in range(2000)]
    a = [HeldoutSplit(0.1).holds(i) for i in ids]
    assert a == [HeldoutSplit(0.1, DEFAULT_SALT).holds(i) for i in ids]
    other = [HeldoutSplit(0.1, "another").holds(i) for i in ids]
    assert a != other
    assert heldout_score("x") == heldout_score("x") and 0 <= heldout_score("x") < 1
    assert not any(HeldoutSplit(0.0).holds(i) for i in ids)
    # a larger fraction holds a superset (the score is fixed per id)
    assert all(HeldoutSplit(0.2).holds(i) for i, held in zip(ids, a) if held)


@pytest.mark.parametrize("fraction", [0.01, 0.05, 0.1, 0.5])
def test_fraction_within_tolerance_on_20000_ids(fraction: float) -> None:
    n = 20_000
    held = sum(HeldoutSplit(fraction).holds(f"prompt-{i:06d}") for i in range(n))
    sd = (n * fraction * (1 - fraction)) ** 0.5
    assert abs(held - n * fraction) < 4 * sd, (held, n * fraction)


def test_named_ids_are_held_out_whatever_the_fraction() -> None:
    split = HeldoutSplit(0.0, ids=frozenset({"b"}), uri="s3://x/y")
    assert split.active and split.holds("b") and not split.holds("a")
    with pytest.raises(ValueError):
        HeldoutSplit(0.6)


def test_read_heldout_ids_from_every_shape() -> None:
    text = b"a\n7\n\n  spaced  \n"
    assert read_heldout_ids(io.BytesIO(text), "ids.txt") == {"a", "7", "spaced"}
    rows = _jsonl("s1", 5, {"id": "r1", "prompt": "x"}, {"prompt": "derive me"})
    want = {"s1", "5", "r1", derive_id([{"role": "user", "content": "derive me"}])}
    assert read_heldout_ids(io.BytesIO(rows), "h.jsonl") == want
    assert read_heldout_ids(io.BytesIO(gzip.compress(rows)), "h.jsonl.gz") == want
    buf = io.BytesIO()
    pq.write_table(pa.table({"id": ["p", "q"], "prompt": ["1", "2"]}), buf)
    assert read_heldout_ids(io.BytesIO(buf.getvalue()), "h.parquet") == {"p", "q"}
    with pytest.raises(PromptFileError, match="line 2"):
        read_heldout_ids(io.BytesIO(_jsonl("ok", {"messages": "bad"})), "h.jsonl")


def test_heldout_file_reads_back_as_the_same_prompts() -> None:
    prompts = [p for p in _parse(_jsonl(
        {"id": "a", "messages": [{"role": "system", "content": "s"}, *Q], "source": "src", "domain": "dom",
         "metadata": {"k": 1}, "extra": "e"},
        {"prompt": "no id"},
    )) if isinstance(p, Prompt)]
    w = HeldoutWriter()
    for p in prompts:
        w.add(p)
    data = w.finish()
    w2 = HeldoutWriter()
    for p in prompts:
        w2.add(p)
    assert w2.finish() == data, "the same held-out prompts give the same bytes (retries rewrite them)"
    back = list(iter_heldout_prompts(data, "heldout/prompts.jsonl.gz"))
    assert [(p.id, p.messages, p.source, p.domain, p.metadata) for p in back] == \
        [(p.id, p.messages, p.source, p.domain, p.metadata) for p in prompts]
    assert w.ids == [p.id for p in prompts] and ids_sha256(w.ids) == ids_sha256(reversed(w.ids))


# -- tokenize's guard and carry ------------------------------------------------------------------------
def test_tokenize_drops_heldout_rows_and_carries_labels() -> None:
    ids = [f"p{i}" for i in range(200)]
    table = pa.table({"id": ids, "sample": [0] * 200, "domain": ["math"] * 200,
                      "thinking": pa.array([None] * 100 + [False] * 100, type=pa.bool_())})
    split = HeldoutSplit(0.2, ids=frozenset({"p0"}))
    kept, dropped = drop_heldout(table, split)
    held = {i for i in ids if split.holds(i)}
    assert dropped == len(held) > 20 and "p0" in held
    assert set(kept.column("id").to_pylist()) == set(ids) - held
    assert drop_heldout(table, HeldoutSplit()) == (table, 0)
    rows = pa.table({"id": ["p1", "p150", "zzz"], "sample": pa.array([0, 0, 0], type=pa.int32())})
    out = with_labels(rows, labels_by_unit(table, True), True).to_pylist()
    assert [(r["domain"], r["thinking"]) for r in out] == [("math", True), ("math", False), (None, True)]


def test_validation_counts_rows_by_label() -> None:
    t = LabelTally()
    t.add(pa.table({"id": ["a", "b", "c"], "domain": ["math", None, "math"], "source": ["s", "s", None],
                    "error_class": [None, "Timeout", None], "thinking": [True, True, False]}))
    t.add(pa.table({"id": ["d"]}))  # a part written before the columns existed
    d = t.to_dict()
    assert d["by_domain"]["math"] == {"rows": 2, "completions": 2, "errors": 0, "share": 0.5}
    assert d["by_domain"]["unknown"]["rows"] == 2 and d["by_domain"]["unknown"]["errors"] == 1
    assert d["by_source"]["s"]["rows"] == 2 and d["by_thinking"]["true"]["rows"] == 2
    md = markdown({"rows_by_label": d, "heldout": {"fraction": 0.1, "salt": "x", "count": 3, "key": "k"}})
    assert "| math | 2 | 2 | 0 | 50.0% |" in md and "Fraction 0.1, salt `x`, 3 prompts" in md


# -- params ---------------------------------------------------------------------------------------------
def test_heldout_params_are_checked() -> None:
    base = {"prompts_uri": "s3://bkt/p.jsonl", "output_uri": "s3://bkt/ds", "servers": ["http://x:1"]}
    cfg = RunConfig.from_params({**base, "heldout_fraction": 0.05, "heldout_uri": "s3://bkt/h.txt"})
    assert (cfg.heldout_fraction, cfg.heldout_salt, cfg.heldout_uri) == (0.05, DEFAULT_SALT, "s3://bkt/h.txt")
    assert RunConfig.from_params(base).heldout_fraction == 0.0
    for bad in ({"heldout_fraction": 0.6}, {"heldout_fraction": -0.1}, {"heldout_salt": ""},
                {"heldout_uri": "s3://bkt/../x"}, {"heldout_salt": "s" * 201}):
        with pytest.raises(ConfigError):
            RunConfig.from_params({**base, **bad})
    assert TokenizeConfig.from_params({"heldout_uri": "s3://bkt/h.txt"}).heldout_uri == "s3://bkt/h.txt"
    with pytest.raises(ConfigError):
        TokenizeConfig.from_params({"heldout_uri": "s3://bkt/./h"})
