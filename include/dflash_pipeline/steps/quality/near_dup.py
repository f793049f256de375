"""Near-duplicate prompts across the dataset, by MinHash LSH (datasketch), found from the plan's prompts
(`find_in_inputs`): beside generation (the DAG's `near_duplicates` task), or at validation when that list is
missing or was made for another plan or other settings.

Plan drops exact duplicate ids only; the same question reworded, re-cased or with a changed number
over-weights one prompt in the mix. The prompt of a completion row is the text of its user turns.

Deterministic whatever order the parts are read in: prompts are visited in id order (string order), the
first of a group is kept and each later one whose estimated Jaccard similarity (word 3-grams) with a kept
prompt reaches the threshold gets `duplicate_of` = the most similar kept prompt (on a tie the first).
Only kept prompts are indexed, so a chain a~b~c keeps a and c when c is not similar to a.
Every sample of an id has the same prompt: an id is one prompt.

Owner of `<root>/quality/near_duplicates.parquet` and `near_duplicates.json` (its plan and settings, written
last): the near_duplicates task, or validation when the pair does not match; both write the same bytes for
the same plan and settings. Tokenize reads the parquet by id.
"""

from __future__ import annotations

import io
import json
import logging
import re
import time
import zlib
from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dflash_pipeline.dataset.layout import DatasetLayout
from dflash_pipeline.dataset.store import Store, with_retries

logger = logging.getLogger(__name__)

SHINGLE = 3
"""Word n-gram size of a prompt's set (a CJK character is a word)."""
PROMPT_CHARS = 16_000
"""A longer prompt is read as its first and last PROMPT_CHARS characters (bounds the cost per prompt)."""
NEAR_DUP_SCHEMA = pa.schema([("id", pa.string()), ("duplicate_of", pa.string()), ("similarity", pa.float32())])
SEED = 1
SCHEME = "affine32"
"""datasketch 2.0's default permutation scheme: 32-bit hash values, stored as uint32 (4 bytes a permutation)."""

_CJK = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff"
_WORD_RE = re.compile(rf"[{_CJK}]|[^\W_{_CJK}]+")


def prompt_text(messages: Sequence[Mapping[str, Any]] | None) -> str:
    """The user turns' text of a request, joined by newlines."""
    return "\n".join((m.get("content") or "") for m in (messages or []) if m.get("role") == "user")


def words_of(text: str) -> list[str]:
    """The prompt's words, lower-cased, punctuation dropped (a CJK character is a word)."""
    if len(text) > 2 * PROMPT_CHARS:
        text = text[:PROMPT_CHARS] + "\n" + text[-PROMPT_CHARS:]
    return _WORD_RE.findall(text.lower())


def shingles(text: str) -> np.ndarray:
    """The prompt's set of word 3-grams as distinct uint32 hashes (fewer words: one shingle of them all).

    Each word is hashed once (CRC-32, deterministic across processes, unlike Python's `hash`) and a
    3-gram's hash combines its words' in numpy: ~4x faster than datasketch's SHA-1 of each joined 3-gram."""
    words = words_of(text)
    if not words:
        return np.zeros(0, dtype=np.uint32)
    h = np.fromiter((zlib.crc32(w.encode()) for w in words), dtype=np.uint64, count=len(words))
    if len(words) < SHINGLE:
        return np.array([zlib.crc32(" ".join(words).encode())], dtype=np.uint32)
    n = len(words) - SHINGLE + 1
    mixed = np.zeros(n, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for k, mult in enumerate(_MULTS):  # odd multipliers: each word reaches every bit of the low half
            mixed += h[k:k + n] * mult
    folded = (mixed ^ (mixed >> np.uint64(32))) & np.uint64(0xFFFFFFFF)
    return np.unique(folded.astype(np.uint32))


_MULTS = tuple(np.uint64(m) for m in (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9))


def _identity(x: int) -> int:
    """datasketch's hashfunc for values that are already 32-bit hashes."""
    return x


@dataclass
class Signatures:
    """The MinHash signatures of a run of prompts (a part's), as `prompt_signatures` returns them."""

    ids: list[str]
    sigs: np.ndarray
    """uint32, one row of num_perm values per id."""
    rows: list[int]
    """Rows read for each id (its consecutive samples)."""
    tags: list[int]
    empty: int
    seconds: float


_PROTOS: dict[int, Any] = {}


def prompt_signatures(ids: Iterable[str], prompts: Iterable[str], tags: Iterable[int] | None, num_perm: int) -> Signatures:
    """MinHash each prompt (consecutive rows of one id are one prompt; an empty prompt is skipped).
    A plain function of its inputs, so validation can run it in worker processes."""
    from datasketch import MinHash

    started = time.perf_counter()
    proto = _PROTOS.get(num_perm)
    if proto is None:
        proto = _PROTOS[num_perm] = MinHash(num_perm=num_perm, seed=SEED, scheme=SCHEME, hashfunc=_identity)
    out_ids: list[str] = []
    out_rows: list[int] = []
    out_tags: list[int] = []
    sigs: list[np.ndarray] = []
    empty = 0
    last = None
    for pid, text, tag in zip(ids, prompts, tags if tags is not None else _zeros()):
        if pid == last:
            if out_ids and out_ids[-1] == pid:
                out_rows[-1] += 1
            continue
        last = pid
        sh = shingles(text)
        if not len(sh):
            empty += 1
            continue
        m = proto.copy()
        m.update_batch(sh.tolist())
        out_ids.append(pid)
        out_rows.append(1)
        out_tags.append(tag)
        sigs.append(m.hashvalues.astype(np.uint32, copy=False))
    matrix = np.stack(sigs) if sigs else np.zeros((0, num_perm), dtype=np.uint32)
    return Signatures(out_ids, matrix, out_rows, out_tags, empty, time.perf_counter() - started)


class NearDuplicateFinder:
    """Folds prompts in (any order), then `finish()` finds the near-duplicates in id order.

    Memory: one uint32 signature of num_perm values per prompt (512 bytes at 128) plus its id, and at
    `finish` datasketch's LSH index of the kept prompts (measured in docs/quality.md)."""

    def __init__(self, threshold: float = 0.9, num_perm: int = 128) -> None:
        self.threshold = threshold
        self.num_perm = num_perm
        self._ids: list[str] = []
        self._tags = array("i")
        self._rows = array("i")
        self._sigs: list[np.ndarray] = []
        self.prompts = 0
        self.empty = 0
        self.seconds = 0.0
        self.tags: list[int] = []
        """The caller's tag of each near-duplicate `finish` returned (same order)."""
        self.rows: list[int] = []
        """Rows (samples) of each near-duplicate `finish` returned."""

    def add(self, ids: Iterable[str], prompts: Iterable[str], tags: Iterable[int] | None = None) -> None:
        """Prompts and their ids, with a small int tag each (the caller's label code; 0 if none). A
        repeated id (another sample of the prompt) counts as one more row of that prompt."""
        self.add_signatures(prompt_signatures(ids, prompts, tags, self.num_perm))

    def add_signatures(self, got: "Signatures") -> None:
        """Signatures computed by `prompt_signatures` (in this process or a worker's), in read order."""
        skip = 0
        if got.ids and self._ids and got.ids[0] == self._ids[-1]:  # a prompt's samples across two parts
            self._rows[-1] += got.rows[0]
            skip = 1
        self._ids.extend(got.ids[skip:])
        self._tags.extend(got.tags[skip:])
        self._rows.extend(got.rows[skip:])
        if len(got.ids) > skip:
            self._sigs.append(got.sigs[skip:])
        self.empty += got.empty
        self.seconds += got.seconds

    def finish(self) -> list[tuple[str, str, float]]:
        """(id, duplicate_of, similarity) of every near-duplicate, in id order."""
        from datasketch import LeanMinHash, MinHashLSH

        started = time.perf_counter()
        if not self._ids:
            return []
        sigs = np.concatenate(self._sigs) if len(self._sigs) > 1 else self._sigs[0]
        self._sigs = []
        ids = np.asarray(self._ids, dtype=object)
        order = sorted(range(len(ids)), key=ids.__getitem__)
        lsh = MinHashLSH(threshold=self.threshold, num_perm=self.num_perm)
        out: list[tuple[str, str, float]] = []
        self.tags, self.rows = [], []
        last = None
        self.prompts = 0
        for pos in order:
            pid = ids[pos]
            if pid == last:
                if out and out[-1][0] == pid:
                    self.rows[-1] += self._rows[pos]
                continue  # another sample of the same prompt (its rows count with the first)
            last = pid
            self.prompts += 1
            sig = sigs[pos]
            m = LeanMinHash(seed=SEED, hashvalues=sig, scheme=SCHEME)
            best, best_sim = None, -1.0
            for cand in lsh.query(m):
                sim = float(np.count_nonzero(sigs[cand] == sig)) / self.num_perm
                if sim > best_sim or (sim == best_sim and ids[cand] < ids[best]):
                    best, best_sim = cand, sim
            if best is not None and best_sim >= self.threshold:
                out.append((pid, ids[best], round(best_sim, 4)))
                self.tags.append(self._tags[pos])
                self.rows.append(self._rows[pos])
            else:
                lsh.insert(int(pos), m, check_duplication=False)
        self.seconds += time.perf_counter() - started
        return out


def _zeros() -> Iterable[int]:
    while True:
        yield 0


def encode_near_duplicates(rows: Sequence[tuple[str, str, float]]) -> bytes:
    table = pa.Table.from_pylist([{"id": i, "duplicate_of": d, "similarity": s} for i, d, s in rows],
                                 schema=NEAR_DUP_SCHEMA)
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    return buf.getvalue()


def write_near_duplicates(store: Store, layout: DatasetLayout, rows: Sequence[tuple[str, str, float]]) -> str:
    """Write the whole list (an empty file when there is none: the search ran); same input, same bytes."""
    data = encode_near_duplicates(rows)
    key = layout.near_duplicates_key
    with_retries(lambda: store.put(key, data, content_type="application/vnd.apache.parquet"), what=f"write {key}")
    return key


def near_settings(threshold: float, num_perm: int, plan_id: str) -> dict[str, Any]:
    """What a near-duplicate list depends on: the plan's prompts and the search's settings."""
    return {"plan_id": plan_id, "threshold": threshold, "num_perm": num_perm, "version": 2}


def find_in_inputs(store: Store, layout: DatasetLayout, plan_id: str, n_chunks: int, threshold: float,
                   num_perm: int) -> tuple[list[tuple[str, str, float]], dict[str, Any]]:
    """The near-duplicates among the plan's prompts, read from `inputs/` (the prompts only: it runs beside
    generation, or at validation when that did not finish). Returns the rows and a summary."""
    from dflash_pipeline.dataset.records import read_parquet

    started = time.perf_counter()
    finder = NearDuplicateFinder(threshold, num_perm)
    for c in range(n_chunks):
        got = with_retries(lambda: store.get(layout.input_key(plan_id, c)), what=f"read input {c}")
        if got is None:
            raise FileNotFoundError(f"input of chunk {c} is missing under {layout.uri}")
        table = read_parquet(got[0], ["id", "messages"])
        finder.add(table.column("id").to_pylist(), (prompt_text(m) for m in table.column("messages").to_pylist()))
        if c and c % 200 == 0:
            logger.info("near-duplicates: %d of %d chunks read", c, n_chunks)
    rows = finder.finish()
    summary = {"prompts": finder.prompts, "empty_prompts": finder.empty, "duplicates": len(rows),
               "seconds": round(time.perf_counter() - started, 2)}
    return rows, summary


def write_near_duplicates_for(store: Store, layout: DatasetLayout, rows: Sequence[tuple[str, str, float]],
                              settings: Mapping[str, Any], summary: Mapping[str, Any]) -> str:
    """near_duplicates.parquet, then near_duplicates.json (its settings and summary: the commit point)."""
    key = write_near_duplicates(store, layout, rows)
    body = json.dumps({"settings": dict(settings), "summary": dict(summary)}, sort_keys=True).encode()
    with_retries(lambda: store.put(layout.near_duplicates_meta_key, body, content_type="application/json"),
                 what="write near_duplicates.json")
    return key


def load_near_duplicates_for(store: Store, layout: DatasetLayout,
                             settings: Mapping[str, Any]) -> tuple[dict[str, tuple[str, float]], dict[str, Any]] | None:
    """{id: (duplicate_of, similarity)} and the summary, when the stored list was found under `settings`
    (this plan, this threshold and num_perm); None otherwise (not computed yet, or for something else)."""
    got = with_retries(lambda: store.get(layout.near_duplicates_meta_key), what="read near_duplicates.json")
    if got is None:
        return None
    meta = json.loads(got[0])
    if meta.get("settings") != dict(settings):
        return None
    data = with_retries(lambda: store.get(layout.near_duplicates_key), what="read near_duplicates")
    if data is None:
        return None
    table = pq.ParquetFile(io.BytesIO(data[0])).read()
    found = {i: (d, round(float(s), 4)) for i, d, s in zip(table.column("id").to_pylist(),
                                                           table.column("duplicate_of").to_pylist(),
                                                           table.column("similarity").to_pylist())}
    return found, dict(meta.get("summary") or {})


def load_near_duplicates(store: Store, layout: DatasetLayout) -> dict[str, str]:
    """id -> duplicate_of from `<root>/quality/near_duplicates.parquet`; {} when validation never wrote it
    (a dataset validated before quality signals, or with quality_signals off)."""
    got = with_retries(lambda: store.get(layout.near_duplicates_key), what="read near_duplicates")
    if got is None:
        logger.info("no %s: no near-duplicate prompts are known for %s", layout.near_duplicates_key, layout.uri)
        return {}
    table = pq.ParquetFile(io.BytesIO(got[0])).read(columns=["id", "duplicate_of"])
    return dict(zip(table.column("id").to_pylist(), table.column("duplicate_of").to_pylist()))
