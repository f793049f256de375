#!/usr/bin/env python3
"""Write data/sample_prompts.jsonl: 2,000 deterministic, varied reasoning prompts for the demo.

Shapes, as real prompt files mix them:
  * most rows: {"id": "sample-00042", "messages": [{"role": "user", "content": ...}]}
  * some rows: the same with a system message first
  * some rows: {"prompt": "..."} with no id (the pipeline derives one from the content)
  * every 25th row with messages: a multi-turn conversation (the old answers included, sometimes
    also the final one), so regenerate=all_turns has turns to replay. Made with their own random
    stream, so the other rows are the same bytes as before.

Tasks are built from templates with numbers: math word problems, code questions, logic puzzles.
The same seed gives the same bytes (no time, no hash randomisation), and no two rows repeat.

    python scripts/make_sample_prompts.py [--count 2000] [--seed 7] [--out data/sample_prompts.jsonl]
"""

from __future__ import annotations

import argparse
import json
import logging
import random
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("make_sample_prompts")

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "data" / "sample_prompts.jsonl"

NAMES = ["Ana", "Bilal", "Chen", "Dara", "Emeka", "Farah", "Goran", "Hana", "Ivan", "Jia", "Kofi", "Lena",
         "Mateo", "Nadia", "Omar", "Priya", "Quinn", "Rosa", "Sven", "Tomas", "Uma", "Viktor", "Wen", "Yusuf"]
ITEMS = [("apple", "apples"), ("notebook", "notebooks"), ("marble", "marbles"), ("ticket", "tickets"),
         ("stamp", "stamps"), ("cookie", "cookies"), ("bolt", "bolts"), ("seedling", "seedlings")]
LANGS = ["Python", "JavaScript", "Go", "Rust", "Java", "C++", "TypeScript", "Kotlin"]
SYSTEMS = [
    "You are a careful math tutor. Show your reasoning, then give the final answer on its own line.",
    "You are a senior software engineer. Explain trade-offs briefly and give working code.",
    "You are a logic puzzle expert. Reason step by step and state the answer clearly.",
    "You are a helpful assistant. Think before you answer and be concise.",
    "You are a competition math coach. Put the final answer in \\boxed{}.",
]


# ----------------------------------------------------------------------------------- math


def math_shopping(r: random.Random) -> str:
    name = r.choice(NAMES)
    item, items = r.choice(ITEMS)
    n, price, paid = r.randint(3, 40), r.randint(2, 19), r.choice([50, 100, 200, 500])
    disc = r.choice([0, 5, 10, 15, 20, 25])
    extra = f" The shop gives a {disc}% discount on the total." if disc else ""
    return (f"{name} buys {n} {items} at ${price} per {item}.{extra} {name} pays with a ${paid} note. "
            f"How much change does {name} get back? If the money is not enough, say how much is missing.")


def math_rates(r: random.Random) -> str:
    a, b = r.randint(2, 12), r.randint(3, 15)
    tank = r.randint(60, 900)
    return (f"One pipe fills a tank in {a} hours and a second pipe fills it in {b} hours. A drain empties "
            f"the full tank in {a + b + r.randint(1, 9)} hours. If the tank holds {tank} litres and all "
            "three are opened on an empty tank, how long until it is full? Give the answer in hours and minutes.")


def math_trains(r: random.Random) -> str:
    d, v1, v2 = r.randint(120, 980), r.randint(40, 140), r.randint(35, 160)
    lag = r.choice([0, 15, 30, 45, 60, 90])
    return (f"Two trains start {d} km apart and travel towards each other, one at {v1} km/h and the other "
            f"at {v2} km/h. The second train leaves {lag} minutes after the first. At what distance from "
            "the first train's station do they meet?")


def math_number_theory(r: random.Random) -> str:
    k = r.randint(0, 4)
    if k == 0:
        n = r.randint(1_000, 999_999)
        return f"Find the prime factorisation of {n} and the number of its positive divisors."
    if k == 1:
        a, b = r.randint(100, 9_999), r.randint(100, 9_999)
        return f"Compute gcd({a}, {b}) and lcm({a}, {b}) using the Euclidean algorithm, showing each step."
    if k == 2:
        base, exp, mod = r.randint(2, 99), r.randint(10, 500), r.choice([7, 11, 13, 17, 19, 23, 97, 101, 1000])
        return f"What is {base}^{exp} mod {mod}? Explain how to compute it without a calculator."
    if k == 3:
        n = r.randint(5, 60)
        return f"How many integers from 1 to {n * 100} are divisible by 3 or 7 but not by both?"
    lo, hi = sorted(r.sample(range(10, 5_000), 2))
    return f"What is the sum of all multiples of {r.randint(3, 19)} between {lo} and {hi} inclusive?"


def math_probability(r: random.Random) -> str:
    red, blue, green = r.randint(2, 12), r.randint(2, 12), r.randint(0, 8)
    draws = r.randint(2, 4)
    bag = f"{red} red, {blue} blue" + (f" and {green} green" if green else "")
    return (f"A bag holds {bag} balls. {draws} balls are drawn without replacement. What is the probability "
            f"that at least {r.randint(1, draws)} of them are red? Give an exact fraction.")


def math_algebra(r: random.Random) -> str:
    a, b, c = r.randint(1, 9), r.randint(-20, 20), r.randint(-50, 50)
    x0 = r.randint(-9, 9)
    if r.random() < 0.5:
        return f"Solve {a}x^2 + ({b})x + ({c}) = 0 over the reals, and say whether the roots are rational."
    return (f"A line passes through ({x0}, {a * x0 + b}) and has slope {a}. Where does it cross the parabola "
            f"y = x^2 + ({c % 11})? Give exact coordinates.")


def math_ages(r: random.Random) -> str:
    p, q = r.sample(NAMES, 2)
    k, years, total = r.randint(2, 5), r.randint(2, 15), r.randint(30, 120)
    return (f"{p} is {k} times as old as {q}. In {years} years their ages will add up to {total}. "
            f"How old is each now? Check whether the answer is a whole number and explain.")


# ----------------------------------------------------------------------------------- code


def code_function(r: random.Random) -> str:
    lang = r.choice(LANGS)
    n = r.randint(2, 9)
    task = r.choice([
        f"returns the {n} most frequent words in a text, breaking ties alphabetically",
        f"merges {n} sorted lists into one sorted list in O(N log {n}) time",
        f"checks whether a string is a rotation of another using at most {n} passes",
        f"returns the length of the longest substring with at most {n} distinct characters",
        f"splits a list into chunks of {n} items, the last one possibly shorter",
        f"computes the {n * 10}th Fibonacci number modulo 1,000,000,007 in O(log n)",
        f"finds all pairs in an array that sum to {n * 7}, without duplicates",
        f"rate-limits calls to at most {n} per second (token bucket)",
    ])
    return f"Write a {lang} function that {task}. Include a few test cases and state the complexity."


def code_bug(r: random.Random) -> str:
    n = r.randint(3, 12)
    snippet = r.choice([
        f"def mean(xs):\n    total = 0\n    for i in range(1, len(xs)):\n        total += xs[i]\n    return total / len(xs)\n\nprint(mean([{', '.join(str(r.randint(1, 99)) for _ in range(n))}]))",
        f"def chunks(xs, k={n}):\n    return [xs[i:i + k] for i in range(0, len(xs) - k, k)]",
        f"def add_item(item, bucket=[]):\n    bucket.append(item)\n    return bucket\n\nfor i in range({n}):\n    print(add_item(i))",
        f"import threading\ncount = 0\ndef work():\n    global count\n    for _ in range({n * 10000}):\n        count += 1\nts = [threading.Thread(target=work) for _ in range(4)]\n[t.start() for t in ts]\nprint(count)",
        f"def binary_search(xs, x):\n    lo, hi = 0, len(xs)\n    while lo < hi:\n        mid = (lo + hi) // 2\n        if xs[mid] < x:\n            lo = mid\n        else:\n            hi = mid\n    return lo  # called with x={n}",
    ])
    return f"What is wrong with this Python code, and how would you fix it?\n\n```python\n{snippet}\n```"


def code_design(r: random.Random) -> str:
    qps, mb = r.choice([50, 200, 1_000, 5_000, 20_000]), r.choice([1, 10, 100, 512])
    return r.choice([
        f"Design a URL shortener that serves {qps} reads per second. Which storage would you use and why?",
        f"How would you deduplicate a stream of {qps} events per second with at most {mb} MB of memory? "
        "Discuss exact versus probabilistic approaches.",
        f"Explain how you would make a batch job that writes {mb} MB files to object storage safe to "
        "retry after a crash halfway through.",
        f"Compare optimistic and pessimistic locking for a table updated {qps} times per second by "
        "several workers.",
    ])


def code_complexity(r: random.Random) -> str:
    a, b = r.randint(2, 5), r.randint(2, 4)
    return (f"What is the time complexity of an algorithm with the recurrence T(n) = {a}T(n/{b}) + n^{r.randint(1, 3)}? "
            "Use the master theorem and explain which case applies.")


# ---------------------------------------------------------------------------------- logic


def logic_knights(r: random.Random) -> str:
    people = r.sample(NAMES, r.randint(2, 4))
    claims = []
    for i, p in enumerate(people):
        other = people[(i + 1) % len(people)]
        claims.append(r.choice([f"{p} says: \"{other} is a knave.\"",
                                f"{p} says: \"{other} and I are the same kind.\"",
                                f"{p} says: \"At least one of us is a knave.\"",
                                f"{p} says: \"Exactly {r.randint(1, len(people))} of us are knights.\""]))
    return ("On an island, knights always tell the truth and knaves always lie. " + " ".join(claims)
            + " Who is a knight and who is a knave? Check every case.")


def logic_ordering(r: random.Random) -> str:
    people = r.sample(NAMES, 5)
    a, b, c, d, e = people
    return (f"Five runners, {', '.join(people)}, finish a race with no ties. {a} finishes before {b}. "
            f"{c} is not last. {d} finishes immediately after {e}. {b} finishes {r.choice(['second', 'third', 'fourth'])}. "
            "List every possible finishing order.")


def logic_river(r: random.Random) -> str:
    cap, n = r.randint(2, 3), r.randint(3, 5)
    return (f"{n} explorers and {n} bears must cross a river in a boat that holds at most {cap}. Bears may "
            "never outnumber explorers on either bank (when explorers are present). What is the minimum "
            "number of crossings, or is it impossible? Explain.")


def logic_weighing(r: random.Random) -> str:
    coins = r.choice([8, 9, 12, 13, 24, 27])
    return (f"You have {coins} coins, one of which is counterfeit and {r.choice(['lighter', 'heavier', 'either lighter or heavier'])}. "
            "With a balance scale, what is the minimum number of weighings that guarantees finding it? Give a strategy.")


def logic_sequence(r: random.Random) -> str:
    start, step, mult = r.randint(1, 9), r.randint(2, 7), r.randint(2, 3)
    seq = [start]
    for i in range(5):
        seq.append(seq[-1] * mult + step if i % 2 else seq[-1] + step * (i + 1))
    return f"What comes next in the sequence {', '.join(map(str, seq))}, ...? Explain the rule you found."


TEMPLATES: list[tuple[float, Callable[[random.Random], str]]] = [
    (3, math_shopping), (2, math_rates), (2, math_trains), (3, math_number_theory), (2, math_probability),
    (2, math_algebra), (2, math_ages),
    (3, code_function), (2, code_bug), (1, code_design), (1, code_complexity),
    (2, logic_knights), (1, logic_ordering), (1, logic_river), (1, logic_weighing), (1, logic_sequence),
]


def make_rows(count: int, seed: int) -> list[dict[str, object]]:
    """``count`` distinct rows of mixed shape, the same for the same seed."""
    r = random.Random(seed)
    weights = [w for w, _ in TEMPLATES]
    funcs = [f for _, f in TEMPLATES]
    seen: set[str] = set()
    rows: list[dict[str, object]] = []
    while len(rows) < count:
        text = r.choices(funcs, weights)[0](r)
        if text in seen:
            continue
        seen.add(text)
        shape = r.random()
        if shape < 0.12:  # bare prompt, no id
            rows.append({"prompt": text})
            continue
        messages = [{"role": "user", "content": text}]
        if shape < 0.27:
            messages.insert(0, {"role": "system", "content": r.choice(SYSTEMS)})
        rows.append({"id": f"sample-{len(rows):05d}", "messages": messages})
    return rows


FOLLOW_UPS = [
    "Can you double-check that result another way?",
    "Now explain it to a twelve-year-old in three sentences.",
    "What would change if every number in the question were doubled?",
    "Which step is the easiest to get wrong, and why?",
    "Give a shorter version of your answer.",
]
OLD_ANSWERS = [
    "Let me work through it. The answer is {n}.",
    "Short version: {n}, after checking the edge cases.",
    "I get {n}; the key step is setting up the equation correctly.",
]


def make_multi_turn(rows: list[dict[str, object]], seed: int, every: int = 25) -> int:
    """Turn every `every`-th row with messages into a multi-turn conversation, in place."""
    r = random.Random(f"multi-turn:{seed}")
    made = 0
    for i in range(0, len(rows), every):
        row = rows[i]
        messages = row.get("messages")
        if not isinstance(messages, list):
            continue
        turns = r.randint(1, 3)  # old answers before the last user turn
        extra: list[dict[str, str]] = []
        for follow_up in r.sample(FOLLOW_UPS, turns):
            extra.append({"role": "assistant", "content": r.choice(OLD_ANSWERS).format(n=r.randint(2, 999))})
            extra.append({"role": "user", "content": follow_up})
        if r.random() < 0.5:  # the old final answer too (plan drops it: it is what gets regenerated)
            extra.append({"role": "assistant", "content": r.choice(OLD_ANSWERS).format(n=r.randint(2, 999))})
        row["messages"] = [*messages, *extra]
        made += 1
    return made


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rows = make_rows(args.count, args.seed)
    multi = make_multi_turn(rows, args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(args.out.suffix + ".tmp")
    with tmp.open("w", encoding="utf-8", newline="\n") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")
    tmp.replace(args.out)
    shapes = {"prompt": sum("prompt" in x for x in rows),
              "system": sum(len(x.get("messages", [])) == 2 for x in rows)}  # type: ignore[arg-type]
    log.info("wrote %d rows (%d bare prompts, %d with a system message, %d multi-turn), %d bytes to %s",
             len(rows), shapes["prompt"], shapes["system"], multi, args.out.stat().st_size, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
