"""Per-row quality signals of a completion row: facts about the text a drafter would be trained on.

A drafter learns loops, thinking cut at max_tokens and refusals as readily as good answers (issue 32).
Validation counts these signals (steps/quality/tally.py); tokenize drops the flagged rows it is told to
(`drop_quality`). Both call `row_signals` on the same row dict, so they agree on what a flag means.

A row of an `all_turns` run holds several regenerated assistant turns: each turn is checked and the row
is flagged when any turn is. Copied (not regenerated) assistant turns of the input are never checked.
Language is identified on the regenerated answers together (py3langid).
"""

from __future__ import annotations

import re
import threading
from itertools import islice
from collections.abc import Mapping
from typing import Any

import numpy as np

from dflash_pipeline.config.quality import QualitySettings

QUALITY_FLAGS = ("loop_reasoning", "loop_answer", "truncated_thinking", "empty_answer", "refusal",
                 "near_duplicate", "language")
"""Every flag a row can carry (tokenize's drop_quality takes a subset)."""

SIGNAL_COLUMNS = ("q_loop_reasoning", "q_loop_answer", "q_truncated_thinking", "q_empty_answer", "q_refusal",
                  "language", "language_score")
"""The keys `row_signals` returns (near_duplicate comes from near_duplicates.parquet, by id)."""

_CJK = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff"
TOKEN_RE = re.compile(rf"[{_CJK}]|[^\W{_CJK}]{{1,12}}|[^\w\s]{{1,8}}")
"""Loop tokens of a text with CJK characters: a CJK character, a word (a longer one cut into 12-character
pieces, so '1111...' repeats), or a run of punctuation (8 at most, so a '=====' rule is a few tokens)."""
_CJK_RE = re.compile(f"[{_CJK}]")
PIECE = 12


def loop_tokens(text: str) -> list[str]:
    """The tokens loops are counted in. Text without CJK: whitespace-separated words (punctuation attached),
    a word longer than 12 characters cut into 12-character pieces, so that '3333...' repeats; str.split runs
    ~10x faster than the regex, which only CJK text (no spaces between words) needs."""
    if _CJK_RE.search(text):
        return TOKEN_RE.findall(text)
    words = text.split()
    if not words:
        return words
    long = np.flatnonzero(np.fromiter(map(len, words), dtype=np.int64, count=len(words)) > PIECE).tolist()
    if not long:
        return words
    out: list[str] = []
    prev = 0
    for i in long:  # few: copy the runs of short words between them whole
        out.extend(words[prev:i])
        w = words[i]
        out.extend(w[k:k + PIECE] for k in range(0, len(w), PIECE))
        prev = i + 1
    out.extend(words[prev:])
    return out

_CODE_BLOCK = re.compile(r"```.*?(?:```|\Z)", re.DOTALL)
_MATH = re.compile(r"\$\$.*?\$\$|\$[^$\n]*\$|\\\[.*?\\\]|\\\(.*?\\\)", re.DOTALL)
_LATEX_CMD = re.compile(r"\\[A-Za-z]+")
_LETTER = re.compile(r"[^\W\d_]")
LANGUAGE_CHARS = 1000
"""Characters of the answer's prose language ID reads (its cost grows with the text; 1,000 decide it)."""


def loop_stretches(text: str, ngram: int = 8, max_period: int = 2048, min_span: int = 1) -> list[tuple[int, float]]:
    """(tokens, repeats) of each unbroken stretch of at least `min_span` tokens of `text` in which every
    n-gram occurred earlier within `max_period` tokens; repeats = tokens / the stretch's median distance to
    the earlier copy (its period), i.e. the copies of the repeating unit after its first.

    Vectorised: n-gram hashes are built with wrapping uint64 arithmetic and a stable argsort finds each
    one's previous occurrence (no Python loop over tokens).
    """
    tokens = loop_tokens(text)
    if len(tokens) - ngram + 1 < 2:
        return []
    return stretches_of_ids(np.array(list(map(hash, tokens)), dtype=np.int64).view(np.uint64), ngram, max_period,
                            min_span)


def stretches_of_ids(ids: np.ndarray, ngram: int, max_period: int, min_span: int) -> list[tuple[int, float]]:
    """`loop_stretches` over token ids (uint64; equal tokens, equal ids)."""
    t = len(ids) - ngram + 1
    if t < 2:
        return []
    h = np.zeros(t, dtype=np.uint64)
    mult = np.uint64(0x100000001B3)
    with np.errstate(over="ignore"):
        for k in range(ngram):
            h = h * mult + ids[k:k + t]
    order = np.argsort(h, kind="stable")
    hs = h[order]
    same = hs[1:] == hs[:-1]
    prev = np.full(t, -1, dtype=np.int64)
    prev[order[1:][same]] = order[:-1][same]
    dist = np.arange(t, dtype=np.int64) - prev
    rep = (prev >= 0) & (dist <= max_period)
    if not rep.any():
        return []
    edges = np.diff(np.concatenate(([0], rep.astype(np.int8), [0])))
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    spans = ends - starts + ngram - 1
    long = spans >= min_span  # normal text has many short stretches: only long ones get a median
    out = []
    for s, e, span in zip(starts[long].tolist(), ends[long].tolist(), spans[long].tolist()):
        out.append((span, span / max(float(np.median(dist[s:e])), 1.0)))
    return out


def is_loop(text: str | None, settings: QualitySettings) -> bool:
    """Some stretch of at least loop_min_span_tokens repeating tokens holds loop_min_repeats copies of its
    unit (a long stretch with too few copies, e.g. a code block written out twice, is not a loop)."""
    if not text or len(text) < settings.loop_min_span_tokens:
        return False
    return any(span >= settings.loop_min_span_tokens and repeats >= settings.loop_min_repeats
               for span, repeats in loop_stretches(text, settings.loop_ngram, settings.loop_max_period,
                                                   settings.loop_min_span_tokens))


def is_refusal(answer: str | None, settings: QualitySettings) -> bool:
    """Any refusal pattern found in the first refusal_scan_chars of the answer."""
    if not answer or not settings.refusal_regexes:
        return False
    head = answer[: settings.refusal_scan_chars]
    return any(r.search(head) for r in settings.refusal_regexes)


NO_LANGUAGE = "zxx"
"""py3langid's label for text without linguistic content (tables, formulas): undetermined here."""
_IDENTIFIER: Any = None
_IDENTIFIER_LOCK = threading.Lock()


def _identifier() -> Any:
    """py3langid's identifier with normalised probabilities, loaded once per process (~0.3 s)."""
    global _IDENTIFIER
    if _IDENTIFIER is None:
        with _IDENTIFIER_LOCK:
            if _IDENTIFIER is None:
                from py3langid.langid import MODEL_FILE, LanguageIdentifier

                ident = LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)
                # The two-letter (ISO 639-1) languages and zxx (no linguistic content): py3langid 0.4 also
                # has varieties (wuu, yue next to zh; ary, arz next to ar) that would split one language.
                ident.set_languages([c for c in ident.nb_classes if len(c) == 2 or c == NO_LANGUAGE])
                _IDENTIFIER = ident
    return _IDENTIFIER


def prose_of(text: str) -> str:
    """The natural-language part of an answer: code blocks, LaTeX math and commands taken out."""
    text = _CODE_BLOCK.sub(" ", text[: LANGUAGE_CHARS * 4])
    text = _MATH.sub(" ", text)
    return _LATEX_CMD.sub(" ", text)[:LANGUAGE_CHARS]


def identify_language(answer: str | None, settings: QualitySettings) -> tuple[str | None, float | None]:
    """(language, score) of an answer's prose by py3langid; (None, None) when there are fewer than
    language_min_chars letters; (None, score) when py3langid's best guess scores below language_min_score."""
    if not answer:
        return None, None
    prose = prose_of(answer)
    if sum(1 for _ in islice(_LETTER.finditer(prose), settings.language_min_chars)) < settings.language_min_chars:
        return None, None
    lang, score = _identifier().classify(prose)
    score = round(float(score), 4)
    if score < settings.language_min_score or lang == NO_LANGUAGE:
        return None, score
    return str(lang), score


def _open_thinking(content: str) -> bool:
    """An answer that still holds an unclosed <think> (a server without a reasoning parser)."""
    i = content.rfind("<think>")
    return i >= 0 and content.find("</think>", i) < 0


def turns_of(row: Mapping[str, Any]) -> list[tuple[str, str, str | None]]:
    """(reasoning, answer, finish_reason) of each regenerated assistant turn, oldest first.

    Rows with `conversation` + `turns` regenerated the last len(turns) assistant turns of the conversation
    (steps/generate/conversation.py); older rows are one turn: `reasoning`, `content`, `finish_reason`."""
    conv = row.get("conversation")
    turns = row.get("turns")
    if conv is not None and turns is not None and len(turns) > 1:  # lists (pyarrow) or arrays (pandas)
        positions = [i for i, m in enumerate(conv) if m.get("role") == "assistant"]
        if len(turns) <= len(positions):
            picked = positions[len(positions) - len(turns):]
            return [(conv[p].get("reasoning") or "", conv[p].get("content") or "", (turns[k] or {}).get("finish_reason"))
                    for k, p in enumerate(picked)]
    return [(row.get("reasoning") or "", row.get("content") or "", row.get("finish_reason"))]


def row_signals(row: Mapping[str, Any], settings: QualitySettings) -> dict[str, Any]:
    """The signal columns (SIGNAL_COLUMNS) of one completion row (a dict with the part's columns).

    - q_loop_reasoning / q_loop_answer: a repetition loop (`is_loop`) in a turn's reasoning / answer;
    - q_truncated_thinking: a turn stopped at max_tokens (finish_reason 'length') before its answer began
      (empty answer, or an answer still inside an unclosed <think>);
    - q_empty_answer: a turn that finished ('stop') with an empty answer;
    - q_refusal: a turn's answer starts like a refusal (`refusal_patterns`);
    - language, language_score: py3langid on the regenerated answers (None when undetermined).
    """
    out: dict[str, Any] = {"q_loop_reasoning": False, "q_loop_answer": False, "q_truncated_thinking": False,
                           "q_empty_answer": False, "q_refusal": False, "language": None, "language_score": None}
    answers: list[str] = []
    for reasoning, answer, finish in turns_of(row):
        empty = not answer.strip()
        out["q_loop_reasoning"] |= is_loop(reasoning, settings)
        out["q_loop_answer"] |= is_loop(answer, settings)
        if finish == "length" and (empty or _open_thinking(answer)):
            out["q_truncated_thinking"] = True
        if finish == "stop" and empty:
            out["q_empty_answer"] = True
        out["q_refusal"] |= is_refusal(answer, settings)
        if not empty:
            answers.append(answer)
    if answers:
        out["language"], out["language_score"] = identify_language("\n".join(answers), settings)
    return out


def flags_of(signals: Mapping[str, Any], settings: QualitySettings) -> list[str]:
    """The QUALITY_FLAGS a row's signals raise, in QUALITY_FLAGS order. `near_duplicate` when the signals
    carry a non-empty `duplicate_of` (tokenize adds it from `load_near_duplicates`); `language` only when
    `languages` is set and the identified language is not in it (an undetermined language is never flagged)."""
    out = [f for f in QUALITY_FLAGS[:5] if signals.get(f"q_{f}")]
    if signals.get("duplicate_of"):
        out.append("near_duplicate")
    lang = signals.get("language")
    if settings.languages is not None and lang is not None and lang not in settings.languages:
        out.append("language")
    return out


def part_row_signals(rows: list[Mapping[str, Any]], settings: QualitySettings,
                     columns: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """`row_signals` of every row of one part, the same values, computed part-wise: the loop rule over all the
    part's single-turn texts in one vectorised pass (`loop_flags`); language ID stays per answer (batching
    py3langid's scoring did not pay: its per-text DFA walk in Python dominates, docs/quality.md). Multi-turn
    rows take `row_signals` itself. `columns`: the part's
    `reasoning` and `content` as Arrow arrays (the same rows), so the loop pass reads them without a copy."""
    single = [i for i, r in enumerate(rows) if len(turns_of(r)) == 1]
    multi = set(range(len(rows))) - set(single)
    turns = {i: turns_of(rows[i])[0] for i in single}
    if columns is not None and len(single) == len(rows):
        loops_r = loop_flags(columns["reasoning"], settings)
        loops_a = loop_flags(columns["content"], settings)
    else:
        loops_r = loop_flags([turns[i][0] for i in single], settings)
        loops_a = loop_flags([turns[i][1] for i in single], settings)
    langs = {i: identify_language(turns[i][1], settings) for i in single if turns[i][1].strip()}
    out: list[dict[str, Any]] = []
    k = 0
    for i, row in enumerate(rows):
        if i in multi:
            out.append(row_signals(row, settings))
            continue
        reasoning, answer, finish = turns[i]
        empty = not answer.strip()
        lang, score = langs.get(i, (None, None))
        out.append({"q_loop_reasoning": bool(loops_r[k]), "q_loop_answer": bool(loops_a[k]),
                    "q_truncated_thinking": finish == "length" and (empty or _open_thinking(answer)),
                    "q_empty_answer": finish == "stop" and empty, "q_refusal": is_refusal(answer, settings),
                    "language": lang, "language_score": score})
        k += 1
    return out




def _word_ids(texts: Any) -> tuple[np.ndarray, np.ndarray]:
    """Loop tokens of non-CJK texts as per-batch integer ids (equal tokens, equal ids) and each text's token
    count: whitespace words, a word longer than PIECE characters cut into PIECE-character pieces (as
    `loop_tokens`). The split and the word ids come from pyarrow (C++); only distinct long words are cut in
    Python, and their pieces are spliced in with numpy."""
    import pyarrow as pa
    import pyarrow.compute as pc

    arr = texts if isinstance(texts, (pa.Array, pa.ChunkedArray)) else pa.array(texts, type=pa.large_string())
    words = pc.utf8_split_whitespace(pc.fill_null(arr, ""))
    flat = pc.list_flatten(words)
    parents = np.asarray(pc.list_parent_indices(words).to_numpy(zero_copy_only=False), dtype=np.int64)
    enc = pc.dictionary_encode(flat)
    idx = np.asarray(enc.indices.to_numpy(zero_copy_only=False), dtype=np.int64)
    vocab = enc.dictionary.to_pylist()
    # each distinct word -> the ids of its pieces (a short word: itself; "" from a leading space: nothing)
    ids_of: dict[str, int] = {}
    pieces: list[list[int]] = []
    for w in vocab:
        cut = [w] if len(w) <= PIECE else [w[k:k + PIECE] for k in range(0, len(w), PIECE)]
        pieces.append([ids_of.setdefault(p, len(ids_of)) for p in cut if p])
    lens = np.fromiter(map(len, pieces), dtype=np.int64, count=len(pieces))
    flat_pieces = np.fromiter((x for p in pieces for x in p), dtype=np.int64, count=int(lens.sum()))
    offs = np.concatenate(([0], np.cumsum(lens)[:-1]))
    per_word = lens[idx]
    start = np.repeat(offs[idx], per_word)
    within = np.arange(int(per_word.sum())) - np.repeat(np.cumsum(per_word) - per_word, per_word)
    ids = flat_pieces[start + within]
    counts = np.bincount(np.repeat(parents, per_word), minlength=len(texts)).astype(np.int64)
    return ids, counts


def loop_flags(texts: Any, settings: QualitySettings) -> np.ndarray:
    """`is_loop` of many texts at once (a list of str, or an Arrow string array: a part's column): the same
    rule, their tokens split and numbered in one pyarrow pass; texts with CJK characters, whose tokens need
    the regex, go through `is_loop` one by one."""
    import pyarrow as pa
    import pyarrow.compute as pc

    arr = texts if isinstance(texts, (pa.Array, pa.ChunkedArray)) else pa.array(texts, type=pa.large_string())
    arr = pc.fill_null(arr, "")
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    n = len(arr)
    out = np.zeros(n, dtype=bool)
    lens = np.asarray(pc.utf8_length(arr).to_numpy(zero_copy_only=False), dtype=np.int64)
    cjk = np.asarray(pc.match_substring_regex(arr, f"[{_CJK}]").to_numpy(zero_copy_only=False), dtype=bool)
    todo = lens >= settings.loop_min_span_tokens
    for i in np.flatnonzero(todo & cjk).tolist():
        out[i] = is_loop(arr[i].as_py(), settings)
    plain = np.flatnonzero(todo & ~cjk)
    if len(plain):
        ids, counts = _word_ids(pc.take(arr, pa.array(plain)))
        out[plain] = _loops_in_segments(ids, counts, settings)
    return out


def _loops_in_segments(ids: np.ndarray, counts: np.ndarray, settings: QualitySettings) -> np.ndarray:
    """`is_loop` of each consecutive segment of token ids (one per text): the same numpy core per text, without
    its Python tokenising and hashing (one sort per text: a text's sort is cache-sized, a part's is not)."""
    result = np.zeros(len(counts), dtype=bool)
    vals = (ids + 1).astype(np.uint64)
    ends = np.cumsum(counts)
    for g, (b, e) in enumerate(zip((ends - counts).tolist(), ends.tolist())):
        if e - b < settings.loop_min_span_tokens:  # as is_loop: a text shorter than the span holds no loop
            continue
        result[g] = any(span >= settings.loop_min_span_tokens and repeats >= settings.loop_min_repeats
                        for span, repeats in stretches_of_ids(vals[b:e], settings.loop_ngram,
                                                              settings.loop_max_period, settings.loop_min_span_tokens))
    return result
