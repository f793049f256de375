"""Token recount with a real `tokenizers` file built offline over the simulator's vocabulary."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_validate_checks import get, write_dataset  # the sibling module's dataset builder

from dflash_pipeline.config import ConfigError
from dflash_pipeline.dev.sim.lengths import count_tokens, plan_lengths, render_completion
from dflash_pipeline.dev.sim.tokenizer import build_sim_tokenizer
from dflash_pipeline.serving.sglang import split_reasoning
from dflash_pipeline.steps.validate import Thresholds, run_validation
from dflash_pipeline.steps.validate.tokencount import FALLBACK_CHAT_TEMPLATE, fetch_tokenizer, load_recounter

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
    assert rc["rows_encoded_alone"] == 0 and rc["output_tokens_per_s"] > 0 and rc["training_tokens_per_s"] > 0
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


# -- single pass: counts from one encoding of the rendered conversation ---------------------------
def _bpe_tokenizer(path: Path) -> Path:
    """A small byte-level BPE with Qwen2's split regex, so tokens can merge across span edges ('.\\n')."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    from dflash_pipeline.dev.sim.lengths import words
    from dflash_pipeline.dev.sim.tokenizer import SPECIAL_TOKENS

    qwen = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(qwen), behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    corpus = [words(i, "thinking", 50) + ".\n\n" + words(i, "answer", 10) + ".\n" for i in range(200)]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                        show_progress=False, special_tokens=list(SPECIAL_TOKENS)))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    path.mkdir(parents=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "chat_template": FALLBACK_CHAT_TEMPLATE}))
    return path


def _oracle(rec: Any, messages: list[dict[str, Any]], reasoning: str | None, content: str) -> tuple[int, int, int]:
    """Tokens whose start offset lies in the reasoning / answer span, found with a plain scan of all offsets."""
    conv = rec.render(messages, reasoning, content)
    enc = rec.tokenizer.encode(conv, add_special_tokens=False)
    r_span, c_span = rec.spans(conv, reasoning or "", content)
    assert c_span is not None and (r_span is not None or not reasoning)

    def inside(span: tuple[int, int] | None) -> int:
        return 0 if span is None else sum(span[0] <= start < span[1] for start, _ in enc.offsets)

    return inside(r_span), inside(c_span), len(enc)


def test_single_pass_equals_separate_encodings_on_sim_rows(tmp_path: Path) -> None:
    rec = load_recounter(str(build_sim_tokenizer(tmp_path / "tok", PROMPT_WORDS)), _no_s3, enable_thinking=True)
    rows = _sim_rows(120, inline_every=3)
    cols = ([r["messages"] for r in rows], [r["reasoning"] for r in rows], [r["content"] for r in rows])
    single, separate = rec.recount(*cols), rec.recount_separately(*cols)
    assert single.rows_encoded_alone == 0 and separate.rows_encoded_alone == len(rows)
    for name in ("reasoning", "content", "training"):
        assert (getattr(single, name) == getattr(separate, name)).all(), name


def test_single_pass_counts_tokens_by_start_offset_in_context(tmp_path: Path) -> None:
    rec = load_recounter(str(_bpe_tokenizer(tmp_path / "bpe")), _no_s3, enable_thinking=True)
    prompt = [{"role": "user", "content": "Solve it. the answer is five."}]
    cases: list[tuple[str | None, str]] = [
        ("we check the sum.", "the answer is five."),  # '.' + template '\n' merge into one token '.\n'
        ("\n\nwe think about this\n", "\n\nfinal answer"),  # newlines the template strips
        ("so the value is  ", " the answer  "),  # spaces kept by the template
        ("étape une: café ☕ ok", "réponse: 5 €"),  # char offsets, not bytes
        (None, "the answer is five."),  # also in the prompt: the answer is the last occurrence
        ("the answer is five.", "the answer is five."),  # the answer repeated at the end of the reasoning
        ("we are cut off in the middle", ""),  # truncated in the thinking: empty answer
    ]
    res = rec.recount([prompt] * len(cases), [r for r, _ in cases], [c for _, c in cases])
    assert res.rows_encoded_alone == 0
    for i, (r, c) in enumerate(cases):
        assert (res.reasoning[i], res.content[i], res.training[i]) == _oracle(rec, prompt, r, c), (r, c)
    assert res.reasoning[4] == 0 and res.content[6] == 0 and res.reasoning[6] > 0
    # '.\n' straddles the reasoning's end (the '\n' is the template's): one token, counted once, in
    # the reasoning, where it starts; the '\n</think>' template part is left with one token fewer
    conv = rec.render(prompt, cases[0][0], cases[0][1])
    r_span, _ = rec.spans(conv, cases[0][0] or "", cases[0][1])
    assert r_span is not None
    enc = rec.tokenizer.encode(conv, add_special_tokens=False)
    straddling = [conv[s:e] for s, e in enc.offsets if s < r_span[1] < e]
    assert straddling == [".\n"]
    # stripped by the template, the newlines around a text count with the template's markers
    assert (res.reasoning[1], res.content[1]) == (4, 2) == (rec.count(["we think about this"])[0], rec.count(["final answer"])[0])


def test_template_that_drops_the_reasoning_falls_back_to_encoding_it_alone(tmp_path: Path) -> None:
    # knows reasoning_content (so it is not inlined) but never renders it
    template = "{# reasoning_content is dropped #}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    d = build_sim_tokenizer(tmp_path / "tok", PROMPT_WORDS, chat_template=template)
    rec = load_recounter(str(d), _no_s3, enable_thinking=True)
    assert rec.shape is not None and rec.shape.gap is None and not rec.inline_reasoning
    # the reasoning also appears in the prompt: it must not be counted there
    msgs = [[{"role": "user", "content": "What is plus step by step"}]] * 3
    reasoning, content = ["plus step by step", None, "a b c"], ["the answer", "two", ""]
    res = rec.recount(msgs, reasoning, content)
    ref = rec.recount_separately(msgs, reasoning, content)
    assert res.rows_encoded_alone == 2
    assert res.reasoning.tolist() == ref.reasoning.tolist() == [4, 0, 3]
    assert res.content.tolist() == ref.content.tolist() == [2, 1, 0]
    assert res.training.tolist() == ref.training.tolist() == [6 + 3 + 2 + 3, 6 + 3 + 1 + 3, 6 + 3 + 0 + 3]

    # and the mismatch rule still holds on sim rows with it, every row with reasoning encoded alone
    rows = _sim_rows(20)
    r = rec.recount([x["messages"] for x in rows], [x["reasoning"] for x in rows], [x["content"] for x in rows])
    ct = np.array([x["completion_tokens"] for x in rows])
    has_r = np.array([bool(x["reasoning"]) for x in rows])
    delta = ct - r.output
    assert ((delta >= 0) & (delta <= rec.allowed_overhead(has_r))).all()
    assert r.rows_encoded_alone == int(has_r.sum()) > 0


def test_reasoning_none_empty_content_and_answer_in_prompt(tmp_path: Path) -> None:
    rec = load_recounter(str(build_sim_tokenizer(tmp_path / "tok", PROMPT_WORDS)), _no_s3, enable_thinking=True)
    msgs = [
        [{"role": "user", "content": "the answer"}],  # the answer also in the prompt
        [{"role": "user", "content": "step by step"}],
        [{"role": "system", "content": "think"}, {"role": "user", "content": "the answer is"}],
    ]
    reasoning = [None, "let me think", "the answer is"]
    content = ["the answer", "", "the answer is"]  # empty answer (cut in the thinking)
    res = rec.recount(msgs, reasoning, content)
    assert res.rows_encoded_alone == 0
    assert res.reasoning.tolist() == [0, 3, 3]
    assert res.content.tolist() == [2, 0, 3]
    assert res.training.tolist() == [(3 + 2) + (3 + 2), (3 + 3) + (3 + 2 + 3), (3 + 1) + (3 + 3) + (3 + 2 + 3 + 3)]
    assert res.training.tolist() == rec.recount_separately(msgs, reasoning, content).training.tolist()


def test_padding_or_truncation_in_the_tokenizer_file_does_not_change_counts(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    d = build_sim_tokenizer(tmp_path / "tok")
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    tok.enable_truncation(max_length=4)
    tok.enable_padding(pad_token="<|endoftext|>")
    tok.save(str(d / "tokenizer.json"))
    rec = load_recounter(str(d), _no_s3, enable_thinking=True)
    res = rec.recount([[{"role": "user", "content": "a b c d e"}]] * 2, ["x y z", None], ["w", "v u"])
    assert res.reasoning.tolist() == [3, 0] and res.content.tolist() == [1, 2]
    assert res.training.tolist() == [8 + 3 + 2 + 3 + 1, 8 + 3 + 2]
