"""Token recount with a real `tokenizers` file built offline over the simulator's vocabulary."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dflash_pipeline.config import ConfigError
from dflash_pipeline.sglang import split_reasoning
from dflash_pipeline.sim.lengths import count_tokens, plan_lengths, render_completion
from dflash_pipeline.sim.tokenizer import build_sim_tokenizer
from dflash_pipeline.tokencount import FALLBACK_CHAT_TEMPLATE, fetch_tokenizer, load_recounter
from dflash_pipeline.validate import Thresholds, run_validation

from test_validate_checks import get, write_dataset  # the sibling module's dataset builder

PROMPT_WORDS = ("What", "is", "plus", "Explain", "step", "by")
LAX = Thresholds(max_error_rate=1.0, max_truncation_rate=1.0, min_coverage=0.0)


def _no_s3(bucket: str, key: str) -> bytes | None:
    raise AssertionError("local tokenizer must not touch S3")


def _char_tokenizer(path: Path) -> Path:
    """A deliberately different tokenizer: one token per character."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{ch: i + 1 for i, ch in enumerate("abcdefghijklmnopqrstuvwxyz")}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Split(Regex("."), behavior="isolated")]
    )
    path.mkdir(parents=True)
    tok.save(str(path / "tokenizer.json"))
    return path


def _sim_rows(n: int, inline_every: int = 2, max_tokens: int = 60) -> list[dict[str, Any]]:
    """Rows exactly as the pipeline saves the simulator's answers (parser and inline servers)."""
    rows = []
    for i in range(n):
        messages = [{"role": "user", "content": f"What is {i} plus {i * 3}? Explain step by step."}]
        plan = plan_lengths(messages, length_scale=0.05)
        inline = i % inline_every == 0
        comp = render_completion(plan, max_tokens=max_tokens, separate_reasoning=not inline)
        reasoning, content = split_reasoning(comp.content, comp.reasoning_content)
        rows.append({"id": f"q{i}", "messages": messages, "reasoning": reasoning, "content": content,
                     "finish_reason": comp.finish_reason, "completion_tokens": comp.completion_tokens,
                     "reasoning_tokens": comp.reasoning_tokens, "prompt_tokens": 1, "server": "inline" if inline else "parser",
                     "latency_s": 0.1})
    return rows


def test_sim_tokenizer_counts_whitespace_words_and_special_tokens(tmp_path: Path) -> None:
    rec = load_recounter(str(build_sim_tokenizer(tmp_path / "tok")), _no_s3, enable_thinking=True)
    text = "let me think about this step <think> wait </think> unknownword"
    assert rec.count([text])[0] == count_tokens(text) == 10
    assert rec.count(["<|im_start|>user\nhi<|im_end|>\n"])[0] == 4
    assert rec.marker_tokens == 2
    assert rec.template_source == "tokenizer_config.json"


def test_recount_agrees_with_the_simulator_exactly(tmp_path: Path) -> None:
    rec = load_recounter(str(build_sim_tokenizer(tmp_path / "tok", PROMPT_WORDS)), _no_s3, enable_thinking=True)
    rows = _sim_rows(80)
    assert any(r["finish_reason"] == "length" and r["content"] == "" for r in rows)
    res = rec.recount([r["messages"] for r in rows], [r["reasoning"] for r in rows], [r["content"] for r in rows])
    ct = np.array([r["completion_tokens"] for r in rows])
    has_r = np.array([bool(r["reasoning"]) for r in rows])
    delta = ct - res.output
    assert ((delta >= 0) & (delta <= rec.allowed_overhead(has_r))).all()
    # parser rows: server count == text; inline rows: + the markers the server generated
    assert all(d == 0 for d, r in zip(delta, rows) if r["server"] == "parser")
    for r, n in zip(rows, res.training):
        words = count_tokens(r["messages"][0]["content"])
        expected = (words + 3) + (3 + count_tokens(r["reasoning"] or "") + count_tokens(r["content"]))
        expected += 2 if r["reasoning"] else 0  # <think> </think>
        assert n == expected, r["id"]


def test_training_tokens_use_the_configured_chat_template(tmp_path: Path) -> None:
    plain = build_sim_tokenizer(tmp_path / "plain", chat_template=None)
    custom = build_sim_tokenizer(
        tmp_path / "custom", chat_template="{% for m in messages %}{{ m['content'] }} {% endfor %}"
    )
    fb = load_recounter(str(plain), _no_s3, enable_thinking=True)
    cu = load_recounter(str(custom / "tokenizer.json"), _no_s3, enable_thinking=True)
    assert fb.template_source == "fallback" and fb.files.chat_template is None
    assert cu.template_source == "tokenizer_config.json" and cu.inline_reasoning
    msgs, reasoning, content = [[{"role": "user", "content": "a b"}]], ["x y z"], ["w"]
    assert fb.recount(msgs, reasoning, content).training[0] == 5 + 3 + 2 + 3 + 1
    # a template without reasoning_content gets the reasoning inline, markers included
    assert cu.recount(msgs, reasoning, content).training[0] == 2 + 2 + 3 + 1
    assert "reasoning_content" in FALLBACK_CHAT_TEMPLATE


def test_missing_or_broken_tokenizer_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_recounter(str(tmp_path / "nope"), _no_s3, enable_thinking=True)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "tokenizer.json").write_text("{}")
    with pytest.raises(ConfigError, match="not a tokenizers file"):
        load_recounter(str(bad), _no_s3, enable_thinking=True)


def test_tokenizer_from_s3_prefix_and_file(s3_client: Any, bucket: str, tmp_path: Path) -> None:
    d = build_sim_tokenizer(tmp_path / "tok")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        s3_client.put_object(Bucket=bucket, Key=f"models/sim/{name}", Body=(d / name).read_bytes())

    def s3_get(b: str, k: str) -> bytes | None:
        try:
            return s3_client.get_object(Bucket=b, Key=k)["Body"].read()
        except s3_client.exceptions.NoSuchKey:
            return None

    for spec in (f"s3://{bucket}/models/sim", f"s3://{bucket}/models/sim/tokenizer.json"):
        files = fetch_tokenizer(spec, s3_get, tmp_path / spec.rsplit("/", 1)[-1])
        assert files.template_source == "tokenizer_config.json" and files.spec == spec
    with pytest.raises(ConfigError, match="does not exist"):
        fetch_tokenizer(f"s3://{bucket}/models/other", s3_get, tmp_path / "other")


def test_validation_recount_exact_with_sim_tokenizer_and_mismatches_with_another(
    s3_client: Any, bucket: str, tmp_path: Path
) -> None:
    rows = _sim_rows(40)
    uri = write_dataset(s3_client, bucket, "ds/recount", [[r["id"] for r in rows]], {0: rows})
    d = build_sim_tokenizer(tmp_path / "tok", PROMPT_WORDS)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        s3_client.put_object(Bucket=bucket, Key=f"tok/{name}", Body=(d / name).read_bytes())
    r = run_validation(s3_client, uri, thresholds=LAX, tokenizer=f"s3://{bucket}/tok", plots=False)
    rc = r["token_recount"]
    assert rc["mismatches"] == 0 and rc["compared"] == rc["rows"] == 40
    assert rc["output_tokens"] == sum(count_tokens((x["reasoning"] or "") + " " + x["content"]) for x in rows)
    assert r["training_tokens"] == rc["training_tokens"] > r["output_tokens"]
    assert "## recount with the training tokenizer" in get(s3_client, bucket, "ds/recount/report.md").decode()

    other = _char_tokenizer(tmp_path / "chars")
    r2 = run_validation(s3_client, uri, thresholds=LAX, tokenizer=str(other), plots=False)
    rc2 = r2["token_recount"]
    assert rc2["mismatches"] == 40 and rc2["mismatch_ids_sample"][:3] == ["q0", "q1", "q2"]
    assert rc2["chat_template"] == "fallback" and rc2["max_abs_delta"] > 100
    stored = json.loads(get(s3_client, bucket, "ds/recount/report.json"))
    assert stored["token_recount"]["mismatches"] == 40
