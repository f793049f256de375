"""Deterministic prompt files in the chat formats users bring (ShareGPT, OpenAI with developer and tool
turns, list-of-parts content), for tests and demos: generated, never committed.

Each format mixes the shapes real exports have: optional system/developer turns, multi-turn histories
ending with the old answer (sometimes empty), tool calls with their results, extra columns. Every row is
distinct (its index is in its text), so none is dropped as a duplicate. The same (format, count, seed)
gives the same rows.

    python scripts/make_input_formats.py --out /tmp/inputs --count 1200
"""

from __future__ import annotations

import gzip
import io
import json
import random
from collections.abc import Callable
from typing import Any

TOPICS = ["prime numbers", "binary search", "photosynthesis", "the French revolution", "hash maps",
          "compound interest", "plate tectonics", "recursion", "TCP handshakes", "matrix rank"]
TOOLS = [
    ("get_weather", {"city": ["Oslo", "Lagos", "Lima", "Hanoi"]}),
    ("search_docs", {"query": ["retry policy", "rate limits", "pagination"]}),
    ("calculator", {"expression": ["17*23", "2**10", "sqrt(144)"]}),
]


def _question(rng: random.Random, i: int, tag: str) -> str:
    """A question unique to (format tag, i), so no two generated rows, of one format or of two, are equal."""
    topic = rng.choice(TOPICS)
    return rng.choice([f"Explain {topic} to a beginner ({tag} case {i}).",
                       f"Give three facts about {topic}; {tag} number {i}.",
                       f"What is a common mistake with {topic}? {tag} example {i}."])


def _call(rng: random.Random, i: int) -> tuple[str, dict[str, Any]]:
    name, params = rng.choice(TOOLS)
    return name, {k: rng.choice(v) for k, v in params.items()} | {"request": i}


def sharegpt_row(rng: random.Random, i: int) -> dict[str, Any]:
    turns: list[dict[str, Any]] = []
    if rng.random() < 0.4:
        turns.append({"from": "system", "value": "You are a concise assistant."})
    for k in range(rng.randint(1, 3)):
        turns.append({"from": "human", "value": _question(rng, i * 10 + k, "chat")})
        if rng.random() < 0.2:
            name, args = _call(rng, i)
            turns.append({"from": "function_call", "value": json.dumps({"name": name, "arguments": args})})
            turns.append({"from": "observation", "value": json.dumps({"result": f"ok-{i}"})})
        turns.append({"from": "gpt", "value": f"Answer {i}.{k}"})
    r = rng.random()
    if r < 0.15:
        turns[-1]["value"] = ""  # an empty trailing answer: dropped
    elif r < 0.35:
        turns.pop()  # ends with the question
    row: dict[str, Any] = {"id": f"sharegpt-{i}", "conversations": turns}
    if rng.random() < 0.5:
        row["category"] = rng.choice(["chat", "tutoring", "qa"])
    return row


def openai_tools_row(rng: random.Random, i: int) -> dict[str, Any]:
    msgs: list[dict[str, Any]] = []
    if rng.random() < 0.6:
        msgs.append({"role": "developer", "content": "Use the tools when they help. Be brief."})
    msgs.append({"role": "user", "content": _question(rng, i, "tools")})
    if rng.random() < 0.7:
        calls = []
        for c in range(rng.randint(1, 2)):
            name, args = _call(rng, i)
            arguments = json.dumps(args) if rng.random() < 0.5 else args
            calls.append({"id": f"call_{i}_{c}", "type": "function", "function": {"name": name, "arguments": arguments}})
        msgs.append({"role": "assistant", "content": rng.choice([None, "", "Let me check."]), "tool_calls": calls})
        for c in calls:
            msgs.append({"role": "tool", "tool_call_id": c["id"], "content": json.dumps({"value": f"r{i}"})})
    r = rng.random()
    if r < 0.5:
        msgs.append({"role": "assistant", "content": f"Final answer {i}.", "reasoning_content": "thought"})
    elif r < 0.6:
        msgs.append({"role": "assistant", "content": None})
    row: dict[str, Any] = {"messages": msgs, "source": "openai-tools"}
    if rng.random() < 0.5:
        row["tools"] = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n, _ in TOOLS]
    return row


def list_content_row(rng: random.Random, i: int) -> dict[str, Any]:
    def parts(*texts: str) -> list[dict[str, str]]:
        return [{"type": "text", "text": t} for t in texts]

    msgs: list[dict[str, Any]] = []
    if rng.random() < 0.5:
        msgs.append({"role": "system", "content": parts("You are helpful.")})
    msgs.append({"role": "user", "content": parts(_question(rng, i, "parts"), f"Context block {i}.")})
    if rng.random() < 0.5:
        msgs.append({"role": "assistant", "content": parts(f"Earlier answer {i}.")})
        msgs.append({"role": "user", "content": rng.choice([f"And why? ({i})", parts(f"And why? ({i})")])})
    if rng.random() < 0.5:
        msgs.append({"role": "assistant", "content": rng.choice([parts(f"Old answer {i}."), []])})
    return {"id": f"parts-{i}", "messages": msgs, "domain": rng.choice(["general", "science"])}


FORMATS: dict[str, Callable[[random.Random, int], dict[str, Any]]] = {
    "sharegpt": sharegpt_row,
    "openai_tools": openai_tools_row,
    "list_content": list_content_row,
}


def rows(fmt: str, count: int, seed: int = 0, start: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(f"{fmt}:{seed}")
    return [FORMATS[fmt](rng, start + i) for i in range(count)]


def jsonl(rows_: list[dict[str, Any]], *, gz: bool = False) -> bytes:
    data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows_).encode()
    return gzip.compress(data, mtime=0) if gz else data


def parquet(rows_: list[dict[str, Any]]) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows_), buf)
    return buf.getvalue()
