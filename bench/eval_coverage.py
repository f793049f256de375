"""Measured coverage of every interval the eval and validation reports print, side by side with nominal.

    .venv/bin/python bench/eval_coverage.py [--reps 300] [--reps-large 100] [--sizes 3,10,20,30,100,300,3000]
        [--confidence 0.95] [--power]

Each cell: the share of repetitions whose interval holds the truth, for that many prompts. Where the
report prints no interval (fewer than specstats.MIN_PROMPTS_FOR_CI prompts) the cell reads
"none (x)": x is what the interval would have covered had it been printed, which is why it is not.

The intervals, each computed by the function the report calls (so what is measured is what is printed):
- **acceptance length**: `specstats.group_figure` over one row per prompt: each (drafter, condition)
  of the eval, each domain, the plot's bars;
- **pooled, 4 rows per prompt**: `group_figure` over the same prompts under 4 conditions: the eval's
  "by thinking mode" (each mode pools its conditions);
- **validation, 4 samples per prompt**: `steps.validate.acceptance.AcceptanceTally` over parts with 4
  samples per prompt (its overall figure; by domain, thinking mode, length and server it calls the same
  interval on fewer prompts);
- **paired difference**: `specstats.paired_difference` of two drafters on the same prompts (the
  ranking's "not separable");
- and, for reference, "before": what the report printed until issue 37 (scipy BCa over rows taken as
  independent), on the single and the pooled rows.

`--power` then measures what the paired comparison buys: two drafters a small gap apart (B accepts
each step's drafts at POWER_FACTOR x A's per-step rate, on the same prompts), the share of
repetitions in which their separate intervals are disjoint and in which the paired difference's
interval excludes 0 (the ranking's "separable").

The rows (a prompt: tokens T, per-step acceptance p; a row: verify steps S = T / (1 + g(p)) and the
accepted drafts of S steps, each step accepting n = 0..k drafts with P(n) = p^n (1 - p), P(k) = p^k;
g(p) = Σ_{i=1..k} p^i; k = 4):
- p ~ Beta with mean 0.6 and concentration 4 (prompts differ a lot: domains, easy and hard prompts);
- lengths, three ways: **homogeneous** T uniform on [300, 600]; **job-like** lognormal (sigma 1) capped
  at 2.25 x its mean, as the job's max_tokens caps it (bench/README.md); **heavy-tailed** lognormal
  (sigma 1.5, median 300) capped at 12,000 tokens (40 x the median): harsher than any max_tokens cap;
- a prompt's samples / conditions: the prompt's p, tokens T x lognormal(sigma 0.3) each;
- paired: drafter B's per-step acceptance is 0.9 p on every prompt (same tokens, its own steps).
The truth of each figure is its population value, Σ S g(p) / Σ S over 2,000,000 simulated prompts.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "include"))

from dflash_pipeline.serving import specstats  # noqa: E402
from dflash_pipeline.steps.validate.acceptance import AcceptanceTally  # noqa: E402

K = 4
P_MEAN, P_CONC = 0.6, 4.0
B_FACTOR = 0.9
POWER_FACTOR = 0.96
ROWS_PER_PROMPT = 4
LENGTHS = ("homogeneous", "job-like", "heavy-tailed")


def g(p: np.ndarray) -> np.ndarray:
    """Expected accepted drafts per verify step at per-step acceptance p (k drafts)."""
    return sum(p**i for i in range(1, K + 1))


def tokens(rng: np.random.Generator, n: int, kind: str) -> np.ndarray:
    if kind == "homogeneous":
        return rng.uniform(300, 600, size=n)
    if kind == "job-like":
        sigma = 1.0
        mean = 300 * np.exp(sigma**2 / 2)
        return np.minimum(rng.lognormal(np.log(300), sigma, size=n), 2.25 * mean)
    return np.minimum(rng.lognormal(np.log(300), 1.5, size=n), 12_000)


def steps_of(t: np.ndarray, p: np.ndarray) -> np.ndarray:
    return np.maximum(1, np.rint(t / (1 + g(p)))).astype(np.int64)


def accepted_of(rng: np.random.Generator, steps: np.ndarray, p: np.ndarray) -> np.ndarray:
    probs = np.stack([p**j * (1 - p) for j in range(K)] + [p**K], axis=1)
    return rng.multinomial(steps, probs) @ np.arange(K + 1)


def prompts(rng: np.random.Generator, n: int, kind: str) -> tuple[np.ndarray, np.ndarray]:
    return tokens(rng, n, kind), rng.beta(P_MEAN * P_CONC, (1 - P_MEAN) * P_CONC, size=n)


def truths(kind: str, b_factor: float = B_FACTOR) -> dict[str, float]:
    """Population values (expected accepted drafts per step given S and p, summed over many prompts)."""
    rng = np.random.default_rng(20_370)
    t, p = prompts(rng, 2_000_000, kind)
    s = steps_of(t, p)
    single = 1 + float((s * g(p)).sum() / s.sum())
    jit = t[:, None] * rng.lognormal(0, 0.3, size=(len(t), ROWS_PER_PROMPT))
    sj = steps_of(jit, p[:, None])
    pooled = 1 + float((sj * g(p)[:, None]).sum() / sj.sum())
    pb = b_factor * p
    sb = steps_of(t, pb)
    diff = single - (1 + float((sb * g(pb)).sum() / sb.sum()))
    return {"single": single, "pooled": pooled, "diff": diff}


def rows_for(ids: list[str], s: np.ndarray, a: np.ndarray) -> list[dict[str, Any]]:
    return [{"id": i, "spec_verify_steps": int(x), "spec_accepted_tokens": int(y)} for i, x, y in zip(ids, s, a)]


def draw(rng: np.random.Generator, n: int, kind: str, b_factor: float = B_FACTOR) -> dict[str, Any]:
    """One repetition's data: n prompts, one row each (drafter A and B), and 4 rows each (pooled)."""
    t, p = prompts(rng, n, kind)
    ids = [f"q{i}" for i in range(n)]
    s = steps_of(t, p)
    a = accepted_of(rng, s, p)
    pb = b_factor * p
    sb = steps_of(t, pb)
    ab = accepted_of(rng, sb, pb)
    tj = t[:, None] * rng.lognormal(0, 0.3, size=(n, ROWS_PER_PROMPT))
    sj = steps_of(tj, np.repeat(p[:, None], ROWS_PER_PROMPT, axis=1)).ravel()
    pj = np.repeat(p, ROWS_PER_PROMPT)
    aj = accepted_of(rng, sj, pj)
    ids_j = [f"q{i}" for i in range(n) for _ in range(ROWS_PER_PROMPT)]
    return {"a": rows_for(ids, s, a), "b": rows_for(ids, sb, ab), "pooled": rows_for(ids_j, sj, aj),
            "pooled_ids": ids_j, "pooled_steps": sj, "pooled_acc": aj, "steps": s, "acc": a}


def validation_ci(d: dict[str, Any]) -> tuple[float, float] | None:
    """The validation report's overall interval over the pooled rows read as 4 samples per prompt."""
    import pyarrow as pa

    n = len(d["pooled_ids"])
    part = pa.table({
        "id": d["pooled_ids"], "sample": [i % ROWS_PER_PROMPT for i in range(n)], "server": ["s0"] * n,
        "completion_tokens": [int(x) for x in d["pooled_steps"]],
        "spec_verify_steps": [int(x) for x in d["pooled_steps"]],
        "spec_accepted_tokens": [int(x) for x in d["pooled_acc"]],
    })
    tally = AcceptanceTally()
    tally.add(part)
    r = tally.report()
    return None if r.get("ci_low") is None else (r["ci_low"], r["ci_high"])


def before_ci(steps: np.ndarray, acc: np.ndarray, confidence: float) -> tuple[float, float] | None:
    """What the reports printed until issue 37: scipy BCa over rows taken as independent."""
    from scipy import stats

    v, a = np.asarray(steps, dtype=float), np.asarray(acc, dtype=float)
    if np.allclose(a / v, a[0] / v[0]):
        return None
    if len(v) > 2000:
        iv = specstats.ratio_ci(v, a, None, confidence=confidence, min_prompts=2)
        return None if iv is None else (iv.low, iv.high)
    res = stats.bootstrap((v, a), lambda x, y, axis=-1: 1 + y.sum(axis=axis) / x.sum(axis=axis), paired=True,
                          vectorized=True, n_resamples=2000, confidence_level=confidence, method="BCa",
                          rng=np.random.default_rng(0))
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def figure_ci(fig: Any) -> tuple[float, float] | None:
    d = fig.to_dict()
    return None if d["ci_low"] is None else (d["ci_low"], d["ci_high"])


def would_be(d: dict[str, Any], which: str, confidence: float) -> tuple[float, float] | None:
    """The interval the report's method gives when the prompt floor is lifted (for cells it prints none)."""
    if which == "diff":
        va, aa = d["steps"], d["acc"]
        vb = np.array([r["spec_verify_steps"] for r in d["b"]])
        ab = np.array([r["spec_accepted_tokens"] for r in d["b"]])
        _, iv = specstats.ratio_difference_ci(va, aa, vb, ab, confidence=confidence, min_prompts=2)
    elif which == "single":
        iv = specstats.ratio_ci(d["steps"], d["acc"], None, confidence=confidence, min_prompts=2)
    else:
        iv = specstats.ratio_ci(d["pooled_steps"], d["pooled_acc"], d["pooled_ids"], confidence=confidence,
                                min_prompts=2)
    return None if iv is None else (iv.low, iv.high)


# (label, truth key, the interval the report prints, its would-be twin)
Measure = tuple[str, str, Callable[[dict[str, Any], float], tuple[float, float] | None], str | None]
MEASURES: list[Measure] = [
    ("acceptance length (condition, domain, plot)", "single",
     lambda d, c: figure_ci(specstats.group_figure(d["a"], confidence=c)), "single"),
    (f"pooled, {ROWS_PER_PROMPT} rows per prompt (by thinking mode)", "pooled",
     lambda d, c: figure_ci(specstats.group_figure(d["pooled"], confidence=c)), "pooled"),
    (f"validation, {ROWS_PER_PROMPT} samples per prompt", "pooled", lambda d, c: validation_ci(d), "pooled"),
    ("paired difference (ranking)", "diff",
     lambda d, c: (lambda x: None if x["ci_low"] is None else (x["ci_low"], x["ci_high"]))(
         specstats.paired_difference(d["a"], d["b"], confidence=c)), "diff"),
    ("before #37: BCa, one row per prompt", "single", lambda d, c: before_ci(d["steps"], d["acc"], c), None),
    (f"before #37: BCa, {ROWS_PER_PROMPT} rows per prompt as independent", "pooled",
     lambda d, c: before_ci(d["pooled_steps"], d["pooled_acc"], c), None),
]


def power(reps: int, sizes: list[int], kinds: list[str], confidence: float) -> None:
    """Separate intervals against the paired difference, two drafters POWER_FACTOR apart."""
    print(f"\ntwo drafters on the same prompts, B's per-step acceptance {POWER_FACTOR} x A's; share of "
          f"{reps} repetitions in which the intervals tell them apart\n")
    print("| lengths | true gap | prompts | separate intervals disjoint | paired interval excludes 0 |")
    print("|---|---|---|---|---|")
    for kind in kinds:
        gap = truths(kind, POWER_FACTOR)["diff"]
        for n in sizes:
            rng = np.random.default_rng(7000 + n + LENGTHS.index(kind))
            disjoint = paired_sep = 0
            for _ in range(reps):
                d = draw(rng, n, kind, POWER_FACTOR)
                fa = specstats.group_figure(d["a"], confidence=confidence).to_dict()
                fb = specstats.group_figure(d["b"], confidence=confidence).to_dict()
                if fa["ci_low"] is not None and fb["ci_low"] is not None:
                    disjoint += fa["ci_low"] > fb["ci_high"] or fb["ci_low"] > fa["ci_high"]
                paired_sep += bool(specstats.paired_difference(d["a"], d["b"], confidence=confidence)["separable"])
            print(f"| {kind} | {gap:.3f} | {n} | {disjoint / reps:.2f} | {paired_sep / reps:.2f} |", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--reps-large", type=int, default=100,
                    help=f"repetitions for sizes above {specstats.BOOTSTRAP_MAX_PROMPTS} prompts (the delta method)")
    ap.add_argument("--sizes", default="3,10,20,30,100,300,3000")
    ap.add_argument("--confidence", type=float, default=0.95)
    ap.add_argument("--lengths", default=",".join(LENGTHS))
    ap.add_argument("--power", action="store_true", help="also measure separate vs paired intervals")
    ap.add_argument("--power-only", action="store_true")
    ap.add_argument("--power-sizes", default="30,100,200")
    args = ap.parse_args(argv)
    if args.power_only:
        warnings.simplefilter("ignore")
        power(args.reps, [int(x) for x in args.power_sizes.split(",")], args.lengths.split(","), args.confidence)
        return 0
    sizes = [int(x) for x in args.sizes.split(",")]
    warnings.simplefilter("ignore")  # scipy's degenerate-resample warnings on 3-prompt samples
    started = time.monotonic()
    se = np.sqrt(args.confidence * (1 - args.confidence) / np.array([args.reps, args.reps_large]))
    print(f"coverage at nominal {args.confidence:.2f}, {args.reps} repetitions per cell ({args.reps_large} above "
          f"{specstats.BOOTSTRAP_MAX_PROMPTS} prompts; a cell's standard error is about {se[0]:.3f} ({se[1]:.3f})); "
          f"no interval under {specstats.MIN_PROMPTS_FOR_CI} prompts: 'none (x)' = the coverage it would have had; "
          f"{specstats.EXPANDED_PERCENTILE} up to {specstats.BOOTSTRAP_MAX_PROMPTS} prompts, the "
          f"{specstats.DELTA} above\n")
    header = "| interval | lengths | " + " | ".join(f"{n} prompts" for n in sizes) + " | nominal |"
    print(header)
    print("|" + "---|" * (len(sizes) + 3))
    for kind in args.lengths.split(","):
        truth = truths(kind)
        cells: dict[str, list[str]] = {m[0]: [] for m in MEASURES}
        for n in sizes:
            hits = {m[0]: [0, 0, 0, 0] for m in MEASURES}  # printed: covered, total; would-be: covered, total
            rng = np.random.default_rng(1000 * n + LENGTHS.index(kind))
            reps = args.reps if n <= specstats.BOOTSTRAP_MAX_PROMPTS else args.reps_large
            for _ in range(reps):
                d = draw(rng, n, kind)
                for label, key, printed, twin in MEASURES:
                    iv = printed(d, args.confidence)
                    if iv is not None:
                        hits[label][0] += iv[0] <= truth[key] <= iv[1]
                        hits[label][1] += 1
                    elif twin is not None:
                        wb = would_be(d, twin, args.confidence)
                        if wb is not None:
                            hits[label][2] += wb[0] <= truth[key] <= wb[1]
                            hits[label][3] += 1
            print(f"{kind} {n} prompts done ({time.monotonic() - started:.0f} s)", file=sys.stderr, flush=True)
            for label, (c, t, wc, wt) in hits.items():
                if t >= reps // 2:
                    cells[label].append(f"{c / t:.3f}")
                elif wt:
                    cells[label].append(f"none ({wc / wt:.2f})")
                else:
                    cells[label].append("none")
        for label, _, _, _ in MEASURES:
            print(f"| {label} | {kind} | " + " | ".join(cells[label]) + f" | {args.confidence:.2f} |", flush=True)
    if args.power:
        power(args.reps, [int(x) for x in args.power_sizes.split(",")], args.lengths.split(","), args.confidence)
    print(f"\n{time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
