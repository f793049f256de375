"""Quality-signal benchmark: what validation's quality signals cost, to choose their defaults.

    .venv/bin/python bench/quality_bench.py                       # near-dup 100k prompts x num_perm 64/128/256 + row signals
    .venv/bin/python bench/quality_bench.py --prompts 20000 --num-perm 128 --rows 500   # a quick look
    .venv/bin/python bench/quality_bench.py --examples   # loop stretches, language scores, sample-prompt pairs
    .venv/bin/python bench/quality_bench.py --skip-near-dup --rows 0 --tally-parts 8 --workers 1,2   # worker processes

Near-duplicate prompts (MinHash LSH, steps/quality/near_dup.py), one child process per num_perm so each
peak RSS (VmHWM) is its own: the child builds `--prompts` synthetic chat prompts (Zipf-distributed
words from a 30k-word vocabulary, lognormal lengths with a median of ~60 words and a long tail), of which
`--dup-share` are planted near-copies of another prompt (k random words replaced, k drawn so the true
word-3-gram Jaccard spreads over 0.5-1), reads its RSS, resets the peak (`/proc/self/clear_refs`), then times
`NearDuplicateFinder.add` (MinHash of every prompt) and `finish` (LSH over the prompts in id order) and
reads VmHWM. Printed: seconds per
phase, peak memory above the prompts' own, and recall/precision against the planted pairs whose true
Jaccard is at or above the threshold (`--threshold`, default the param's default). 900k figures are the
100k ones x 9 (both phases are linear in the prompts: one MinHash each, one LSH query/insert each).

Row signals (steps/quality/signals.py `row_signals`): `--rows` rows like a thinking run's, each with a
~4k-token reasoning (paragraphs of tests/unit/quality_texts.py's Qwen3-style thinking in a shuffled
order) and a ~300-word answer; 5% of them loop. Prints ms per row and per signal.

The machine is shared: the 1-minute load average is printed with the figures.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "include"))
sys.path.insert(0, str(REPO / "tests" / "unit"))


def loadavg() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _word_set(words: list[str]) -> set[str]:
    return {" ".join(words[i:i + 3]) for i in range(len(words) - 2)} if len(words) >= 3 else {" ".join(words)}


def make_prompts(n: int, dup_share: float, seed: int) -> tuple[list[str], list[str], dict[str, tuple[str, float]]]:
    """Ids, prompt texts, and the planted pairs: id -> (original id, true word-3-gram Jaccard)."""
    rng = np.random.default_rng(seed)
    vocab = [f"w{i:05d}" for i in range(30_000)]
    ranks = rng.zipf(1.2, size=min(n * 100, 20_000_000)) % len(vocab)
    lengths = np.clip(rng.lognormal(mean=np.log(60), sigma=1.0, size=n), 3, 3000).astype(int)
    ids, texts, words_of = [], [], []
    pos = 0
    planted: dict[str, tuple[str, float]] = {}
    for i in range(n):
        pid = f"p{i:07d}"
        if i > 10 and rng.random() < dup_share:
            j = int(rng.integers(0, i))
            base = list(words_of[j])
            k = int(rng.integers(0, max(1, len(base) // 6) + 1))
            for _ in range(k):
                base[int(rng.integers(0, len(base)))] = vocab[int(rng.integers(0, len(vocab)))]
            a, b = _word_set(words_of[j]), _word_set(base)
            planted[pid] = (ids[j], len(a & b) / len(a | b))
            words = base
        else:
            m = int(lengths[i])
            if pos + m > len(ranks):
                pos = 0
            words = [vocab[r] for r in ranks[pos:pos + m]]
            pos += m
        ids.append(pid)
        words_of.append(words)
        texts.append(" ".join(words))
    order = rng.permutation(n)  # the parts are not read in id order
    return [ids[k] for k in order], [texts[k] for k in order], planted


def near_dup_child(args: tuple[int, int, float, float, int], out: Any) -> None:
    n, num_perm, threshold, dup_share, seed = args
    from dflash_pipeline.steps.quality.near_dup import NearDuplicateFinder

    ids, texts, planted = make_prompts(n, dup_share, seed)
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM: the peak from here on is the finder's
    rss0 = _status_kb("VmRSS")
    f = NearDuplicateFinder(threshold, num_perm)
    t0 = time.perf_counter()
    for k in range(0, n, 500):  # as validation feeds it: one part at a time
        f.add(ids[k:k + 500], texts[k:k + 500])
    t1 = time.perf_counter()
    rss1 = _status_kb("VmRSS")
    found = f.finish()
    t2 = time.perf_counter()
    hwm = _status_kb("VmHWM")
    got = {d: o for d, o, _ in found}
    # A planted copy may also (correctly) match another copy of its original: count it found if flagged.
    should = {d for d, (_, j) in planted.items() if j >= threshold}
    tp = len(should & set(got))
    out.put({
        "prompts": n, "num_perm": num_perm, "threshold": threshold, "minhash_s": round(t1 - t0, 2),
        "lsh_s": round(t2 - t1, 2), "signatures_mb": round((rss1 - rss0) / 1024, 1),
        "peak_above_prompts_mb": round((hwm - rss0) / 1024, 1), "found": len(found),
        "planted_at_or_above_threshold": len(should), "recall": round(tp / len(should), 4) if should else None,
        "flagged_not_planted_above": len(set(got) - should),
    })


def bench_near_dup(n: int, perms: list[int], threshold: float, dup_share: float, seed: int) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    results = []
    for p in perms:
        q = ctx.Queue()
        proc = ctx.Process(target=near_dup_child, args=((n, p, threshold, dup_share, seed), q))
        proc.start()
        res = q.get()
        proc.join()
        res["load_1min"] = loadavg()
        print(json.dumps(res), flush=True)
        results.append(res)
    return results


def make_rows(n: int, seed: int) -> list[dict[str, Any]]:
    import quality_texts as qt

    rng = random.Random(seed)
    paragraphs = [p for t in (qt.MATH_THINKING, qt.PROBABILITY_THINKING, qt.CODE_THINKING, qt.ENUMERATION_THINKING)
                  for p in t.split("\n\n") if p.strip()]
    rows = []
    for i in range(n):
        parts: list[str] = []
        while sum(map(len, parts)) < 14_000:  # ~4k tokens of thinking
            parts.append(rng.choice(paragraphs))
        reasoning = "\n\n".join(parts)
        if i % 20 == 0:
            reasoning = reasoning[:6000] + "\n\n" + "\n\n".join([qt.LOOP_TAIL] * 40)
        answer = qt.ENGLISH_ANSWER + "\n\n" + qt.CODE_ANSWER + "\n\n" + qt.PROBABILITY_THINKING[:600]
        rows.append({"id": f"r{i}", "reasoning": reasoning, "content": answer,
                     "finish_reason": "length" if i % 20 == 0 else "stop",
                     "messages": [{"role": "user", "content": "Solve the problem and explain."}]})
    return rows


def bench_rows(n: int, seed: int) -> dict[str, Any]:
    from dflash_pipeline.config.quality import QualitySettings
    from dflash_pipeline.steps.quality import signals as sg

    s = QualitySettings()
    rows = make_rows(n, seed)
    sg.identify_language("warm up the identifier model, loaded once per process", s)
    timings: dict[str, float] = {}

    def timed(name: str, fn: Any) -> None:
        t = time.perf_counter()
        for r in rows:
            fn(r)
        timings[name] = (time.perf_counter() - t) / n * 1e3

    timed("loop_reasoning", lambda r: sg.is_loop(r["reasoning"], s))
    timed("loop_answer", lambda r: sg.is_loop(r["content"], s))
    timed("refusal", lambda r: sg.is_refusal(r["content"], s))
    timed("language", lambda r: sg.identify_language(r["content"], s))
    timed("row_signals", lambda r: sg.row_signals(r, s))
    flagged = sum(1 for r in rows if sg.row_signals(r, s)["q_loop_reasoning"])
    res = {"rows": n, "reasoning_chars_mean": int(np.mean([len(r["reasoning"]) for r in rows])),
           "answer_chars": len(rows[0]["content"]), "ms_per_row": {k: round(v, 3) for k, v in timings.items()},
           "loops_flagged": flagged, "loops_planted": len(range(0, n, 20)), "load_1min": loadavg(),
           "row_signals_900k_cpu_min": round(timings["row_signals"] * 902_087 / 1e3 / 60, 1)}
    print(json.dumps(res), flush=True)
    return res


def bench_part_wise(n: int, seed: int, part_rows: int = 500, tokenizer: str | None = None) -> None:
    """Issue 40: each signal row by row (the functions validation called per row before) and part-wise (what a
    part's digest calls now), side by side, in ms per row; then a whole digest per part (`make_digest`: checks,
    signals and, with --qwen-tokenizer, the recount with Qwen's byte-level BPE) as the generate worker makes it."""
    from dflash_pipeline.config.quality import QualitySettings
    from dflash_pipeline.dataset.records import decode_part, encode_part
    from dflash_pipeline.steps.quality import signals as sg

    s = QualitySettings()
    rows = make_rows(n, seed)
    sg.identify_language("warm up the identifier model, loaded once per process", s)
    parts = [rows[i:i + part_rows] for i in range(0, n, part_rows)]
    cases = {
        "loop, reasoning": (lambda: [sg.is_loop(r["reasoning"], s) for r in rows],
                            lambda: [sg.loop_flags([r["reasoning"] for r in p], s) for p in parts]),
        "loop, answer": (lambda: [sg.is_loop(r["content"], s) for r in rows],
                         lambda: [sg.loop_flags([r["content"] for r in p], s) for p in parts]),
        "language": (lambda: [sg.identify_language(r["content"], s) for r in rows],
                     lambda: [sg.identify_language(r["content"], s) for r in rows]),
        "refusal": (lambda: [sg.is_refusal(r["content"], s) for r in rows],
                    lambda: [sg.is_refusal(r["content"], s) for r in rows]),
        "row_signals (all)": (lambda: [sg.row_signals(r, s) for r in rows],
                              lambda: [sg.part_row_signals(p, s) for p in parts]),
    }
    print(f"| signal | row by row (ms/row) | part-wise (ms/row) | ratio | load |  ({n} rows, {part_rows}-row parts)")
    print("|---|---:|---:|---:|---:|")
    for name, (before, after) in cases.items():
        t0 = time.perf_counter()
        before()
        t1 = time.perf_counter()
        after()
        t2 = time.perf_counter()
        b, a = (t1 - t0) / n * 1e3, (t2 - t1) / n * 1e3
        print(f"| {name} | {b:.3f} | {a:.3f} | {b / a:.1f}x | {loadavg()} |", flush=True)
    from dflash_pipeline.steps.validate.digest import DigestContext, make_digest

    recounter = None
    if tokenizer:
        from dflash_pipeline.steps.validate.tokencount import load_recounter

        recounter = load_recounter(tokenizer, lambda b, k: None, enable_thinking=True)
    for i, r in enumerate(rows):
        r.update(id=f"r{i}", server="s0", latency_s=1.0, prompt_tokens=20, completion_tokens=4000, thinking=True)
    tables = [decode_part(encode_part(p)) for p in parts]
    for label, ctx in (("digest, signals", DigestContext("p", True, s)),
                       ("digest, no signals", DigestContext("p", True, None)),
                       *((("digest, signals + Qwen BPE recount", DigestContext("p", True, s, recounter, tokenizer)),)
                         if recounter else ())):
        t0 = time.perf_counter()
        for p, table in zip(parts, tables):
            make_digest(table, [r["id"] for r in p], 0, "", ctx)
        wall = time.perf_counter() - t0
        print(f"{label}: {wall / n * 1e3:.3f} ms/row, {wall / len(parts):.2f} s per {part_rows}-row part "
              f"(load {loadavg()})", flush=True)


def bench_examples() -> None:
    """The figures docs/quality.md quotes about known texts: longest repeating stretch of each test text,
    language scores of the test answers, near-duplicates of data/sample_prompts.jsonl per threshold."""
    import quality_texts as qt

    from dflash_pipeline.config.quality import QualitySettings
    from dflash_pipeline.steps.quality.near_dup import NearDuplicateFinder, prompt_text
    from dflash_pipeline.steps.quality.signals import identify_language, loop_stretches

    s = QualitySettings()
    for kind, texts in (("not_loop", qt.NOT_LOOPS), ("loop", qt.LOOPS)):
        for name, text in texts.items():
            st = loop_stretches(text, s.loop_ngram, s.loop_max_period)
            span, rep = max(st) if st else (0, 0.0)
            print(json.dumps({kind: name, "longest_stretch_tokens": span, "repeats": round(rep, 1)}))
    for name in ("ENGLISH_ANSWER", "CODE_ANSWER", "FRENCH_ANSWER", "GERMAN_ANSWER", "CHINESE_ANSWER", "TABLE_ANSWER"):
        print(json.dumps({"answer": name, "language": identify_language(getattr(qt, name), s)}))
    rows = [json.loads(line) for line in (REPO / "data" / "sample_prompts.jsonl").read_text().splitlines()]
    ids = [r.get("id") or f"row{i}" for i, r in enumerate(rows)]
    texts_ = [prompt_text(r.get("messages") or [{"role": "user", "content": r["prompt"]}]) for r in rows]
    for th in (0.7, 0.8, 0.85, 0.9):
        f = NearDuplicateFinder(th, 128)
        f.add(ids, texts_)
        print(json.dumps({"sample_prompts": len(rows), "threshold": th, "near_duplicates": len(f.finish())}))


def main() -> None:
    from dflash_pipeline.config.quality import QUALITY_PARAM_SCHEMAS

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=100_000)
    ap.add_argument("--num-perm", default="64,128,256")
    ap.add_argument("--threshold", type=float, default=QUALITY_PARAM_SCHEMAS["near_duplicate_threshold"]["default"])
    ap.add_argument("--dup-share", type=float, default=0.05)
    ap.add_argument("--rows", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--skip-near-dup", action="store_true")
    ap.add_argument("--examples", action="store_true", help="only the figures about the known texts (seconds)")
    ap.add_argument("--part-wise", action="store_true", help="issue 40: each signal row by row vs part-wise, and "
                    "a part's digest")
    ap.add_argument("--qwen-tokenizer", help="tokenizer dir (make qwen-tokenizer) for the digest's recount")
    a = ap.parse_args()
    print(f"load average (1 min) at start: {loadavg()}", flush=True)
    if a.examples:
        bench_examples()
        return
    if not a.skip_near_dup:
        bench_near_dup(a.prompts, [int(x) for x in a.num_perm.split(",")], a.threshold, a.dup_share, a.seed)
    if a.part_wise:
        bench_part_wise(a.rows, a.seed, tokenizer=a.qwen_tokenizer)
    elif a.rows:
        bench_rows(a.rows, a.seed)


if __name__ == "__main__":
    main()
