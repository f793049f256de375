"""The simulator's speculative decoding: a drafter with a known acceptance, and the server's counters.

Why: acceptance figures (per row, per domain, with confidence intervals) must be tested against a
known truth. The simulated drafter accepts each draft position with probability p, so the drafts
accepted per verify step are a geometric count truncated at the draft length k, and the truth is

    acceptance length = 1 + E[accepted per step] = 1 + sum_{i=1..k} p^i.

p depends on the request's domain: `SimConfig.spec_accept_by_keyword` ("math=0.9,chat=0.4") maps
a keyword, looked up case-insensitively in the request's messages (first keyword of the map
that matches), to p; otherwise `spec_accept_p`.

A request of n completion tokens: the first token comes from prefill, then verify steps each add
1 + a tokens until n are out. Every step's `a` stands as drawn (an engine that overshoots a stop
discards the extra tokens but has verified them), so by Wald's identity the token-weighted
figure over many requests is unbiased for the truth. Drawn from a generator seeded by the request
(the server seed, the prompt, the request's seed, its length): the same request gets the same
figures. The engine dialects that put them on the wire: spec_sglang.py, spec_vllm.py.

Counters (`SpecCounters`): what the server reports server-wide (vLLM `/metrics`, SGLang's
`avg_spec_accept_length`). Every chat request that ran counts, the client's preflight probes
included (a real engine counts those too); never reset (as a real server's, until a restart of
this object, which the simulator's crash/restart does not do).
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

SGLANG_ALGORITHMS = ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "NGRAM", "DFLASH")
VLLM_METHODS = ("ngram", "draft_model", "eagle", "eagle3", "medusa", "mtp", "suffix", "dflash")
PER_REQUEST_LEVELS = ("none", "summary", "detailed")


def parse_keyword_map(text: str | None) -> list[tuple[str, float]]:
    """"math=0.9, chat=0.4" -> [("math", 0.9), ("chat", 0.4)]; raises ValueError on a bad entry."""
    out: list[tuple[str, float]] = []
    for part in (text or "").split(","):
        if not part.strip():
            continue
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"spec_accept_by_keyword: {part!r} is not keyword=p")
        p = float(value)
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"spec_accept_by_keyword: p of {key.strip()!r} must be within [0, 1]")
        out.append((key.strip().lower(), p))
    return out


def validate(config: Any) -> None:
    """Refuse spec knobs the simulator cannot honour (called from SimConfig's validation)."""
    if config.spec_algorithm is None:
        return
    if config.spec_num_draft_tokens < 1:
        raise ValueError("spec_num_draft_tokens must be >= 1")
    if not 0.0 <= config.spec_accept_p <= 1.0:
        raise ValueError("spec_accept_p must be within [0, 1]")
    parse_keyword_map(config.spec_accept_by_keyword)
    if config.spec_per_request_metrics not in PER_REQUEST_LEVELS:
        raise ValueError(f"spec_per_request_metrics must be one of {PER_REQUEST_LEVELS}")


def true_acceptance_length(p: float, k: int) -> float:
    """The drafter's expected acceptance length: 1 + sum_{i=1..k} p^i."""
    return 1.0 + sum(p ** i for i in range(1, k + 1))


def accept_p(config: Any, messages: list[Any]) -> float:
    """p for a request: the first keyword of the map found in its messages, else the default."""
    keywords = parse_keyword_map(config.spec_accept_by_keyword)
    if keywords:
        text = " ".join(str(m.get("content") or "") for m in messages if isinstance(m, dict)).lower()
        for key, p in keywords:
            if key in text:
                return p
    return float(config.spec_accept_p)


@dataclass(frozen=True)
class Drafted:
    """One request's speculative decoding: per-step accepted drafts (k proposed per step)."""

    k: int
    per_step: tuple[int, ...]

    @property
    def verify_steps(self) -> int:
        return len(self.per_step)

    @property
    def accepted(self) -> int:
        return int(sum(self.per_step))

    @property
    def proposed(self) -> int:
        return self.k * len(self.per_step)

    def histogram(self) -> list[int]:
        """Dense: index j = steps that accepted exactly j drafts (length k + 1)."""
        hist = [0] * (self.k + 1)
        for a in self.per_step:
            hist[a] += 1
        return hist

    def per_position(self) -> list[int]:
        """Accepted count per 0-based draft position (position i accepted when a > i)."""
        hist = self.histogram()
        return [sum(hist[i + 1:]) for i in range(self.k)]


def draw(config: Any, messages: list[Any], completion_tokens: int, request_seed: int | None) -> Drafted:
    """The verify steps of one request of `completion_tokens` tokens (module docstring)."""
    k = int(config.spec_num_draft_tokens)
    p = accept_p(config, messages)
    key = f"{config.seed}|{request_seed}|{completion_tokens}|{messages!r}".encode()
    rng = np.random.default_rng(int.from_bytes(hashlib.sha256(key).digest()[:8], "little"))
    need = max(0, int(completion_tokens) - 1)  # the first token comes from prefill
    if need == 0:
        return Drafted(k, ())
    if p >= 1.0:
        a = np.full(need, k, dtype=np.int64)
    else:
        a = np.minimum(rng.geometric(1.0 - p, size=need) - 1, k)
    out = np.cumsum(a + 1)
    steps = int(np.searchsorted(out, need) + 1)  # the first step that reaches `need` tokens
    return Drafted(k, tuple(int(x) for x in a[:steps]))


def new_counters(config: Any) -> SpecCounters | None:
    """A speculating server's counters, zero at start (one per draft position, as vLLM publishes)."""
    if not config.spec_algorithm:
        return None
    k = int(config.spec_num_draft_tokens)
    return SpecCounters(k, per_position=[0] * k)


def draw_and_count(sim: Any, messages: list[Any], completion_tokens: int, request_seed: int | None) -> Drafted | None:
    """One answered request of `sim` (a SimServer): its draw, added to the server's counters; None
    when the server does not speculate. A runtime change of the draft length starts new counters."""
    config = sim.config
    if not config.spec_algorithm:
        return None
    drafted = draw(config, messages, completion_tokens, request_seed)
    with sim._sched.cv:
        if sim.spec_counters is None or sim.spec_counters.k != config.spec_num_draft_tokens:
            sim.spec_counters = new_counters(config)
        counters = sim.spec_counters
    counters.add(drafted)
    return drafted


@dataclass
class SpecCounters:
    """Server-wide totals since the server object was made (thread-safe)."""

    k: int
    drafts: int = 0  # verify steps (vLLM's spec_decode_num_drafts)
    draft_tokens: int = 0
    accepted_tokens: int = 0
    per_position: list[int] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, d: Drafted) -> None:
        with self.lock:
            if len(self.per_position) < d.k:
                self.per_position.extend([0] * (d.k - len(self.per_position)))
            self.drafts += d.verify_steps
            self.draft_tokens += d.proposed
            self.accepted_tokens += d.accepted
            for i, n in enumerate(d.per_position()):
                self.per_position[i] += n

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            return {"drafts": self.drafts, "draft_tokens": self.draft_tokens,
                    "accepted_tokens": self.accepted_tokens, "per_position": list(self.per_position)}
