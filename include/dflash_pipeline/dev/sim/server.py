"""A simulated SGLang server: SGLang's HTTP wire format over an event-driven batcher.

Why: the pipeline's dispatch, retry, resume and validation logic has to be exercised against
something that fails and queues like a real SGLang fleet, on a laptop or CI box, in
milliseconds.  The simulator speaks the endpoints and error bodies a client sees
(``/health``, ``/get_server_info``, ``/v1/chat/completions``, ...), runs continuous batching
(``max_running_requests`` slots, FIFO queue, optional ``max_queued_requests`` -> 503), and
injects faults (500, 503, hangs, TCP resets, crashes with restart on the same port) drawn from a
seeded RNG so runs are reproducible.

Scheduling is event-driven: one scheduler thread sleeps on a condition until the earliest
finish time in a heap (or until a request arrives); HTTP handler threads block on an Event.
Nothing polls, so a handful of servers with 16 slots each cost almost no CPU.

Wire details, and where they come from (SGLang ``tokenizer_manager.py``, ``serving_base.py``,
``utils.add_api_key_middleware``):

* context-length 400s use SGLang's exact messages (``CONTEXT_TOO_LONG_MSG``,
  ``TOTAL_TOO_LONG_MSG``); input ``>=`` context is rejected, input + max_tokens ``>`` context is.
* error bodies are ``{"object": "error", "message", "type", "param": null, "code"}``.
* 401 bodies are ``{"error": "Unauthorized"}`` (SGLang's middleware, not the error JSON);
  paths under ``/health`` (and the sim-only ``/sim/``) need no key.
* unknown paths give FastAPI's ``{"detail": "Not Found"}``.

Limits (documented, intended): ``stream=true`` is rejected with 400; ``n > 1`` is ignored; a
client that disconnects does not free its slot early; request ``seed``/``temperature`` do not
change the text (it depends only on the messages and ``SimConfig.seed``); other sampling fields
(``top_k``, ``stop``, ...) are type-checked as the engine checks them (``sampling_wire.py``) and
recorded as received (``GET /sim/requests``), not applied.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import json
import logging
import random
import selectors
import socket
import socketserver
import struct
import threading
import time
import uuid
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Iterable, Iterator, Sequence
from urllib.parse import urlsplit

from dflash_pipeline.dev.sim import lengths, slowprobe, tokens, vllm_wire
from dflash_pipeline.dev.sim.conversation import ConversationModel
from dflash_pipeline.dev.sim import sampling_wire, spec_drafter, spec_sglang, spec_vllm

logger = logging.getLogger(__name__)

SIM_VERSION = "0.5.23-sim"
HEALTH_GENERATE_TIMEOUT_S = 20.0
"""SGLang's /health_generate gives up after 20 s and answers 503."""

CONTEXT_TOO_LONG_MSG = (
    "The input ({input_tokens} tokens) is longer than the model's context length "
    "({context_length} tokens)."
)
"""SGLang TokenizerManager._validate_one_request, input >= context_length."""
TOTAL_TOO_LONG_MSG = (
    "Requested token count exceeds the model's maximum context length of {context_length} "
    "tokens. You requested a total of {total_tokens} tokens: {input_tokens} tokens from the "
    "input messages and {max_tokens} tokens for the completion. Please reduce the number of "
    "tokens in the input messages or the completion to fit within the limit."
)
"""SGLang TokenizerManager._validate_one_request, input + max_new_tokens > context_length."""
QUEUE_FULL_MSG = "The request queue is full."
"""SGLang scheduler's abort message when --max-queued-requests overflows (HTTP 503)."""
NOT_READY_MSG = "The server is not ready yet (still starting up)."
INJECTED_ERROR_MSG = "Internal server error: simulated failure (error_rate)"
INJECTED_UNAVAILABLE_MSG = "Service unavailable: simulated overload (unavailable_rate)"
PROOF_REQUEST_PREFIX = "preflight-proof"
"""Requests whose X-Request-Id starts with this are a client's preflight probes: counted in
stats()["proof_requests"], not in generation_requests or ids (the pipeline tags its probes so)."""
STREAM_UNSUPPORTED_MSG = "stream=true is not supported by the SGLang simulator; use stream=false."

RUNTIME_IMMUTABLE_FIELDS = frozenset({"host", "port"})
"""SimConfig fields /sim/config and update_config() refuse to change (the socket is bound)."""

_LINGER_RESET = struct.pack("ii", 1, 0)


@dataclasses.dataclass
class SimConfig:
    """Knobs of one simulated server; see the module docstring for the behaviour they drive."""

    host: str = "127.0.0.1"
    port: int = 0
    """0 picks a free port at start(); restarts after a crash reuse the port picked."""
    model_path: str = "Qwen/Qwen3-8B"
    served_model_name: str | None = None
    """None -> model_path (like SGLang)."""
    tokenizer_path: str | None = None
    """None -> model_path."""
    max_running_requests: int = 16
    """Slots. SGLang's server info reports it; the vLLM flavour hides it (vLLM's --max-num-seqs).
    A runtime change (POST /sim/config) applies to admissions: running requests above a lowered
    figure finish, new ones wait."""
    max_queued_requests: int | None = None
    """None = unbounded FIFO; when full, generation answers 503 QUEUE_FULL_MSG."""
    context_length: int = 32768
    max_total_num_tokens: int = 200000
    """Reported, and the vLLM flavour's `vllm:kv_cache_usage_perc` is the running requests' tokens
    over it; KV capacity does not limit admission."""
    token_time_s: float = 0.02
    """Wall seconds per decode step of one request (batch size does not slow it down)."""
    prefill_time_per_token_s: float = 0.0
    slow_factor: float = 1.0
    """Multiplies decode time; runtime changes apply to requests admitted afterwards."""
    length_scale: float = 1.0
    mean_tokens: int = 1800
    reasoning_parser: str | None = "qwen3"
    """None -> thinking returned inline in content as "<think>...</think>answer"."""
    api_key: str | None = None
    startup_delay_s: float = 0.0
    """/health and generation answer 503 for this long after (re)start."""
    seed: int = 0
    """Seeds the text/length model (and the fault RNG unless fault_seed is set)."""
    error_rate: float = 0.0
    """Share of generation requests answered 500 with SGLang's error JSON."""
    poison_text: str | None = None
    """Every generation request whose last message contains this text gets `poison_fault`: a prompt
    the server always fails on while it serves the others (a poison prompt)."""
    poison_fault: str = "error"
    """What a poison prompt gets: "error" (500, as error_rate), "hang" (as hang_rate), "unavailable"."""
    unavailable_rate: float = 0.0
    """Share answered 503."""
    hang_rate: float = 0.0
    """Share accepted and never answered (no slot held) until hang_s passes or the server goes
    down; then the connection is reset."""
    hang_s: float = 3600.0
    reset_rate: float = 0.0
    """Share whose TCP connection is closed with SO_LINGER 0 (the client sees a reset)."""
    abort_rate: float = 0.0
    """Share aborted mid-generation the way SGLang answers an `/abort_request` or a scheduler
    abort without a status code: HTTP 200, `finish_reason: "abort"`, the partial text so far."""
    crash_after_requests: int | None = None
    """Crash when the N-th generation request since (re)start arrives; that request, everything
    in flight or queued, and idle keep-alive connections are reset, and the port stops
    listening.  The count restarts after a restart, so the server crashes again N later."""
    restart_after_s: float | None = None
    """After a crash, listen again on the same port after this many seconds (None = stay down)."""
    fault_seed: int | None = None
    """Seed of the fault RNG; None -> seed.  SimFleet gives each server its index."""
    keep_alive_timeout_s: float | None = None
    """Close idle keep-alive connections after this long (uvicorn, under SGLang, uses 5 s);
    None keeps them open."""
    track_ids: bool = True
    """Count generation requests per prompt hash in stats()["ids"] (spot duplicates)."""
    radix_cache: bool = True
    """Model SGLang's radix cache (dev/sim/conversation.py): a prompt prefix seen before is not
    prefilled again and is reported in usage.prompt_tokens_details.cached_tokens."""
    track_history: bool = False
    """Audit history turns: count those that are / are not this server's own earlier answers
    (stats()["conversation"])."""
    thinks: bool = True
    """False: a model (or chat template) that ignores enable_thinking and never thinks, so its
    answers carry no reasoning at all and thinking cannot be split from them."""
    skip_thinking_greedy: bool = False
    """With thinking on, every answer at temperature 0 closes its thinking at once (an empty think block),
    as some checkpoints do greedily while they think when sampled (the tiny designed one did)."""
    skip_thinking_rate: float = 0.0
    """With thinking on, the share of sampled answers (temperature > 0 or none sent) that close their
    thinking at once, as real thinking models do on some prompts. Drawn from the prompt and the request's
    seed: another seed draws again. The answer is what the engine's parser makes of `</think>` right
    after the generation prompt's `<think>`: no reasoning (SGLang null, vLLM empty), inline (no parser)
    `<think>\n\n</think>\n\n` before the answer."""
    engine: str = "sglang"
    """Wire flavour: "sglang", or "vllm" (vLLM's OpenAI server, see vllm_wire.py)."""
    tokenizer_dir: str | None = None
    """A local tokenizer directory (tokenizer.json + a chat template): the server then renders and
    encodes each request like an engine serving that model (dev/sim/tokens.py): usage counts its
    tokens, and the vLLM flavour returns the ids with `return_token_ids`. None: the word model."""
    noncanonical_rate: float = 0.0
    """With tokenizer_dir: share of generated tokens emitted as two smaller tokens of the same text."""
    token_ids_supported: bool = True
    """With tokenizer_dir: answer `return_token_ids` (vLLM >= 0.10.2, SGLang >= 0.5.17). False plays
    an older engine that ignores the field silently: usage as always, no ids."""
    # Speculative decoding (spec_drafter.py has the drafter; spec_sglang.py / spec_vllm.py the wire).
    spec_algorithm: str | None = None
    """None: the server does not speculate. Else SGLang's --speculative-algorithm (e.g. "EAGLE3",
    "DFLASH") or vLLM's method ("ngram", "draft_model")."""
    loop_rate: float = 0.0
    """Share of requests whose thinking loops (one sentence repeated until max_tokens), as a model behind a wrong
    template or sampled greedily does (issue 40's planted fault)."""
    spec_num_draft_tokens: int = 3
    """Draft tokens per verify step (SGLang reports speculative_num_draft_tokens = this + 1)."""
    spec_accept_p: float = 0.7
    """The drafter's per-position acceptance probability where no keyword matches."""
    spec_accept_by_keyword: str | None = None
    """"math=0.9,chat=0.4": p for requests whose messages contain the keyword (first match)."""
    spec_sglang_version: str | None = None
    """The SGLang release whose fields to emit and report in /get_server_info (None: SIM_VERSION)."""
    spec_per_request_metrics: str = "summary"
    """vLLM's --per-request-spec-decode-metrics: none | summary | detailed."""
    enable_metrics: bool = False
    """SGLang's --enable-metrics: the SGLang flavour serves /metrics (`sglang:spec_verify_calls_total`,
    `sglang:generation_tokens_total`)."""
    disable_log_stats: bool = False
    """vLLM's --disable-log-stats: its /metrics answers without any `vllm:` series (no stat logger);
    the answers' per-request speculative statistics are unaffected."""

    def __post_init__(self) -> None:
        if self.served_model_name is None:
            self.served_model_name = self.model_path
        if self.tokenizer_path is None:
            self.tokenizer_path = self.model_path
        validate_config(self)


def validate_config(config: SimConfig) -> None:
    """Reject configs the simulator cannot honour, early and with a clear message."""
    if config.max_running_requests < 1:
        raise ValueError("max_running_requests must be >= 1")
    if config.max_queued_requests is not None and config.max_queued_requests < 0:
        raise ValueError("max_queued_requests must be >= 0 or None")
    if config.context_length < 1:
        raise ValueError("context_length must be >= 1")
    for name in ("token_time_s", "prefill_time_per_token_s", "slow_factor", "length_scale",
                 "startup_delay_s", "hang_s"):
        if getattr(config, name) < 0:
            raise ValueError(f"{name} must be >= 0")
    if not 0.0 <= config.skip_thinking_rate <= 1.0:
        raise ValueError("skip_thinking_rate must be within [0, 1]")
    rates = ("error_rate", "unavailable_rate", "hang_rate", "reset_rate", "abort_rate", "loop_rate")
    for name in rates:
        if not 0.0 <= getattr(config, name) <= 1.0:
            raise ValueError(f"{name} must be within [0, 1]")
    if sum(getattr(config, name) for name in rates) > 1.0 + 1e-9:
        raise ValueError("error_rate + unavailable_rate + hang_rate + reset_rate + abort_rate must be <= 1")
    if config.engine not in ("sglang", "vllm"):
        raise ValueError(f"engine must be 'sglang' or 'vllm', not {config.engine!r}")
    spec_drafter.validate(config)


def derive_config(base: SimConfig, **changes: Any) -> SimConfig:
    """``dataclasses.replace`` that keeps served_model_name/tokenizer_path following model_path
    when they were only defaulted from it."""
    if "model_path" in changes:
        for name in ("served_model_name", "tokenizer_path"):
            if name not in changes and getattr(base, name) == base.model_path:
                changes[name] = None
    return dataclasses.replace(base, **changes)


def config_field_types() -> dict[str, str]:
    """Field name -> annotation string (annotations are strings under postponed evaluation)."""
    return {f.name: str(f.type) for f in dataclasses.fields(SimConfig)}


def coerce_field_value(name: str, value: Any) -> Any:
    """Convert ``value`` (a CLI string or a JSON value) to the type of SimConfig field ``name``."""
    types = config_field_types()
    if name not in types:
        raise KeyError(f"unknown SimConfig field {name!r}")
    annotation = types[name].replace(" ", "")
    optional = annotation.endswith("|None")
    base = annotation[: -len("|None")] if optional else annotation
    if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "null")):
        if optional:
            return None
        raise ValueError(f"{name} cannot be None")
    if base == "bool":
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{name}: not a boolean: {value!r}")
    if base == "int":
        if isinstance(value, bool):
            raise ValueError(f"{name}: not an integer: {value!r}")
        if isinstance(value, float):
            if not value.is_integer():
                raise ValueError(f"{name}: not an integer: {value!r}")
            return int(value)
        return int(str(value).strip())
    if base == "float":
        if isinstance(value, bool):
            raise ValueError(f"{name}: not a number: {value!r}")
        return float(value)
    return str(value)


class _Job:
    """One unit of work in the batcher: a chat completion or a /health_generate probe."""

    __slots__ = ("kind", "tokens", "prompt_tokens", "arrive_t", "admit_t", "finish_t",
                 "service_s", "event", "aborted", "cached")

    def __init__(self, kind: str, tokens: int, prompt_tokens: int, arrive_t: float) -> None:
        self.kind = kind
        self.tokens = tokens
        self.prompt_tokens = prompt_tokens
        self.arrive_t = arrive_t
        self.admit_t = 0.0
        self.finish_t = 0.0
        self.service_s = 0.0
        self.event = threading.Event()
        self.aborted = False
        self.cached = 0


def _zero_stats() -> dict[str, Any]:
    return {
        "requests_total": 0,
        "generation_requests": 0,
        "proof_requests": 0,
        "health_generate_requests": 0,
        "completed": 0,
        "errors_by_code": {},
        "faults": {"error": 0, "unavailable": 0, "hang": 0, "reset": 0, "abort": 0},
        "rejected_queue_full": 0,
        "aborted": 0,
        "output_tokens": 0,
        "prompt_tokens": 0,
        "busy_slot_seconds": 0.0,
        "aborted_slot_seconds": 0.0,
        "max_running_seen": 0,
        "max_waiting_seen": 0,
        "first_admit_t": None,
        "last_finish_t": None,
        "ids": {},
    }


class _Scheduler:
    """Continuous batching: ``max_running_requests`` slots, a FIFO queue, a heap of finishes.

    Why a virtual timeline: when a request finishes, the head of the queue is admitted at that
    finish time, not when the scheduler thread happens to wake, so busy slot-seconds and
    throughput do not depend on thread jitter on a loaded box.
    """

    def __init__(self, owner: SimServer) -> None:
        self.owner = owner
        self.cv = threading.Condition()
        self.heap: list[tuple[float, int, _Job]] = []
        self.waiting: deque[_Job] = deque()
        self.seq = itertools.count()
        self.closed = False
        self.wakeups = 0
        """Loop iterations of the scheduler thread; stays O(events), proof it does not spin."""
        self.stats = _zero_stats()
        self.stats_epoch = time.monotonic()
        self.generation_tokens_total = 0
        """Tokens of every request that ran to its end (proofs included), never reset: the server's
        generated-token counter (vLLM `vllm:generation_tokens`, SGLang `sglang:generation_tokens_total`)."""
        self.thread = threading.Thread(target=self._run, name="sim-scheduler", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def close(self) -> None:
        with self.cv:
            self.closed = True
            self.cv.notify_all()
        if self.thread.is_alive() and threading.current_thread() is not self.thread:
            self.thread.join(timeout=5.0)

    def submit(self, job: _Job, dead: threading.Event | None = None) -> bool:
        """Admit ``job`` now, queue it, or return False when the queue is full (-> 503).

        ``dead`` is the submitting incarnation's flag: checked under the lock, so a job racing
        a crash is either aborted by abort_all() or aborted here, never stranded.
        """
        config = self.owner.config
        with self.cv:
            if self.closed or (dead is not None and dead.is_set()):
                job.aborted = True
                job.event.set()
                return True
            if len(self.heap) < config.max_running_requests and not self.waiting:
                self._admit(job, job.arrive_t)
            elif (config.max_queued_requests is not None
                  and len(self.waiting) >= config.max_queued_requests):
                self.stats["rejected_queue_full"] += 1
                return False
            else:
                self.waiting.append(job)
                if len(self.waiting) > self.stats["max_waiting_seen"]:
                    self.stats["max_waiting_seen"] = len(self.waiting)
            self.cv.notify()
        return True

    def kick(self) -> None:
        """Re-check admissions (after max_running_requests changed at runtime)."""
        with self.cv:
            self._admit_waiting(time.monotonic())
            self.cv.notify()

    def abort_all(self) -> int:
        """Abort every running and queued job (a crash); their handlers reset the connection."""
        now = time.monotonic()
        with self.cv:
            jobs = [entry[2] for entry in self.heap] + list(self.waiting)
            for _, _, job in self.heap:
                if job.kind == "chat":
                    self.stats["aborted_slot_seconds"] += max(
                        0.0, now - max(job.admit_t, self.stats_epoch))
            self.heap.clear()
            self.waiting.clear()
            for job in jobs:
                job.aborted = True
                job.event.set()
            self.stats["aborted"] += len(jobs)
            self.cv.notify()
        return len(jobs)

    def generated(self) -> int:
        with self.cv:
            return self.generation_tokens_total

    def load(self) -> tuple[int, int, int]:
        """(running, waiting, tokens in KV: prompt + generated so far of running requests)."""
        now = time.monotonic()
        with self.cv:
            tokens = 0
            for finish_t, _, job in self.heap:
                done = 1.0 if job.service_s <= 0 else min(
                    1.0, max(0.0, (now - job.admit_t) / job.service_s))
                tokens += job.prompt_tokens + int(job.tokens * done)
            return len(self.heap), len(self.waiting), tokens

    def reset_stats(self) -> None:
        with self.cv:
            self.stats = _zero_stats()
            self.stats_epoch = time.monotonic()

    # -- internals (hold self.cv) -------------------------------------------------------------

    def _admit(self, job: _Job, at: float) -> None:
        config = self.owner.config
        job.admit_t = at
        job.service_s = ((job.prompt_tokens - job.cached) * config.prefill_time_per_token_s
                         + job.tokens * config.token_time_s * config.slow_factor)
        job.finish_t = at + job.service_s
        heapq.heappush(self.heap, (job.finish_t, next(self.seq), job))
        if len(self.heap) > self.stats["max_running_seen"]:
            self.stats["max_running_seen"] = len(self.heap)
        if job.kind == "chat" and self.stats["first_admit_t"] is None:
            self.stats["first_admit_t"] = self.owner.wall(at)

    def _admit_waiting(self, at: float) -> None:
        limit = self.owner.config.max_running_requests
        while self.waiting and len(self.heap) < limit:
            job = self.waiting.popleft()
            self._admit(job, max(at, job.arrive_t))

    def _finish(self, job: _Job) -> None:
        stats = self.stats
        self.generation_tokens_total += job.tokens
        if job.kind == "chat":
            stats["completed"] += 1
            stats["output_tokens"] += job.tokens
            stats["prompt_tokens"] += job.prompt_tokens
            stats["busy_slot_seconds"] += max(0.0, job.finish_t - max(job.admit_t,
                                                                      self.stats_epoch))
            stats["last_finish_t"] = self.owner.wall(job.finish_t)
        job.event.set()

    def _run(self) -> None:
        with self.cv:
            while not self.closed:
                self.wakeups += 1
                now = time.monotonic()
                while self.heap and self.heap[0][0] <= now:
                    finish_t, _, job = heapq.heappop(self.heap)
                    self._finish(job)
                    self._admit_waiting(finish_t)
                if self.heap:
                    self.cv.wait(self.heap[0][0] - now)
                else:
                    self.cv.wait()


def _abort_socket(sock: socket.socket) -> None:
    """Arrange for close() to send a RST instead of a FIN."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
    except OSError:
        pass


class _HTTPServer(ThreadingHTTPServer):
    """One incarnation of the listening server; a crash kills it, a restart makes a new one."""

    daemon_threads = True
    allow_reuse_address = True
    block_on_close = False
    request_queue_size = 1024

    def __init__(self, address: tuple[str, int], sim: SimServer) -> None:
        self.sim = sim
        self.dead = threading.Event()
        self._conns: set[socket.socket] = set()
        self._resets: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        self._wake_r, self._wake_w = socket.socketpair()
        try:
            super().__init__(address, _Handler)
        except BaseException:
            self._wake_r.close()
            self._wake_w.close()
            raise

    def server_bind(self) -> None:
        # HTTPServer.server_bind calls socket.getfqdn(), a reverse DNS lookup that can stall.
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name = str(host)
        self.server_port = int(port)

    def serve(self) -> None:
        """Accept loop that blocks in select() until a connection or a wake-up: no polling."""
        with selectors.DefaultSelector() as selector:
            selector.register(self.socket, selectors.EVENT_READ)
            selector.register(self._wake_r, selectors.EVENT_READ)
            while not self.dead.is_set():
                for key, _ in selector.select():
                    if self.dead.is_set():
                        break
                    if key.fileobj is self.socket:
                        self._handle_request_noblock()

    def go_down(self, serve_thread: threading.Thread | None) -> None:
        """Stop accepting and close the listening socket (backlogged connections get RST)."""
        self.dead.set()
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if serve_thread is not None and serve_thread is not threading.current_thread():
            serve_thread.join(timeout=5.0)
        self.server_close()
        for sock in (self._wake_r, self._wake_w):
            sock.close()

    def track(self, sock: socket.socket) -> None:
        with self._conns_lock:
            self._conns.add(sock)

    def untrack(self, sock: socket.socket) -> None:
        with self._conns_lock:
            self._conns.discard(sock)

    def mark_reset(self, sock: socket.socket) -> None:
        _abort_socket(sock)
        with self._conns_lock:
            self._resets.add(sock)

    def kill_connections(self, exclude: socket.socket | None = None) -> int:
        """Reset every open connection: idle readers wake via SHUT_RD, close() sends RST."""
        with self._conns_lock:
            victims = [s for s in self._conns if s is not exclude]
        for sock in victims:
            self.mark_reset(sock)
            try:
                sock.shutdown(socket.SHUT_RD)
            except OSError:
                pass
        return len(victims)

    def shutdown_request(self, request: Any) -> None:
        with self._conns_lock:
            reset = request in self._resets
            self._resets.discard(request)
        if reset:
            self.close_request(request)  # no SHUT_WR first: that would send a FIN
        else:
            super().shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        logger.debug("connection error from %s", client_address, exc_info=True)


class _Handler(vllm_wire.VllmEndpoints, spec_sglang.SglangMetricsEndpoint, BaseHTTPRequestHandler):
    """HTTP/1.1 keep-alive handler speaking SGLang's endpoints."""

    protocol_version = "HTTP/1.1"
    server_version = "uvicorn"
    server: _HTTPServer

    def version_string(self) -> str:
        return self.server_version

    GET_ROUTES = {
        "/health": "_health",
        "/health_generate": "_health_generate",
        "/get_server_info": "_server_info",
        "/server_info": "_server_info",
        "/get_load": "_get_load",
        "/v1/loads": "_v1_loads",
        "/get_model_info": "_model_info",
        "/v1/models": "_models",
        "/sim/stats": "_sim_stats",
        "/sim/requests": "_sim_requests",
        "/metrics": "_sglang_metrics",
    }
    POST_ROUTES = {
        "/v1/chat/completions": "_chat",
        "/sim/config": "_sim_config",
        "/sim/crash": "_sim_crash",
        "/sim/reset_stats": "_sim_reset_stats",
    }

    def setup(self) -> None:
        self.timeout = self.server.sim.config.keep_alive_timeout_s
        super().setup()
        self.server.track(self.connection)

    def finish(self) -> None:
        try:
            super().finish()
        except OSError:
            pass
        finally:
            self.server.untrack(self.connection)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (stdlib signature)
        logger.debug("%s " + format, self.address_string(), *args)

    def do_GET(self) -> None:  # noqa: N802 (stdlib naming)
        self._dispatch("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._dispatch("POST")

    def do_PUT(self) -> None:  # noqa: N802
        self._dispatch("PUT")

    def do_DELETE(self) -> None:  # noqa: N802
        self._dispatch("DELETE")

    # -- plumbing -----------------------------------------------------------------------------

    @property
    def sim(self) -> SimServer:
        return self.server.sim

    def _dispatch(self, method: str) -> None:
        try:
            body = self._read_body()
        except (ValueError, OSError):
            self.close_connection = True
            return
        if self.server.dead.is_set():
            self._reset()
            return
        path = urlsplit(self.path).path
        if not path.startswith("/sim/"):
            self.sim._count("requests_total")
        if not self._authorized(path):
            self._send_json(401, {"error": "Unauthorized"})
            return
        wire = vllm_wire if self.sim.config.engine == "vllm" else self
        routes = wire.GET_ROUTES if method == "GET" else wire.POST_ROUTES
        name = routes.get(path)
        if name is None:
            if path in wire.GET_ROUTES or path in wire.POST_ROUTES:
                self._send_json(405, {"detail": "Method Not Allowed"})
            else:
                self._send_json(404, {"detail": "Not Found"})
            return
        slowprobe.hold(self.sim, path)  # a load probe answered late (dev/sim/slowprobe.py)
        try:
            getattr(self, name)(body)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            chunks: list[bytes] = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length > 0 else b""

    def _authorized(self, path: str) -> bool:
        key = self.sim.config.api_key
        if not key or path.startswith("/health") or path.startswith("/sim/"):
            return True
        return self.headers.get("Authorization") == "Bearer " + key

    def _send(self, code: int, body: bytes, content_type: str | None = "application/json",
              close: bool = False) -> None:
        if code >= 400:
            self.sim._count_error(code)
        try:
            self.send_response(code)
            if content_type is not None:
                self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            if close:
                self.send_header("Connection", "close")
                self.close_connection = True
            self.end_headers()
            if body:
                self.wfile.write(body)
        except OSError:
            self.close_connection = True

    def _send_json(self, code: int, obj: Any, close: bool = False) -> None:
        body = json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
        self._send(code, body, close=close)

    def _error(self, code: int, message: str, err_type: str) -> None:
        if self.sim.config.engine == "vllm":
            self._send_json(code, vllm_wire.error_body(code, message, err_type))
            return
        self._send_json(code, {"object": "error", "message": message, "type": err_type,
                               "param": None, "code": code})

    def _bad_request(self, message: str) -> None:
        self._error(400, message, "BadRequestError")

    def _reset(self) -> None:
        """Answer nothing and make the close a TCP reset."""
        self.server.mark_reset(self.connection)
        self.close_connection = True

    # -- endpoints ----------------------------------------------------------------------------

    def _health(self, _body: bytes) -> None:
        self._send(200 if self.sim.ready() else 503, b"", content_type=None)

    def _health_generate(self, _body: bytes) -> None:
        sim = self.sim
        sim._count("health_generate_requests")
        if not sim.ready():
            self._send(503, b"", content_type=None)
            return
        job = _Job("health", 1, 0, time.monotonic())
        if not sim._sched.submit(job, self.server.dead):
            self._send(503, b"", content_type=None)
            return
        if not job.event.wait(HEALTH_GENERATE_TIMEOUT_S):
            self._send(503, b"", content_type=None)
            return
        if job.aborted:
            self._reset()
            return
        self._send(200, b"", content_type=None)

    def _server_info(self, _body: bytes) -> None:
        self._send_json(200, self.sim.server_info())

    def _get_load(self, _body: bytes) -> None:
        """SGLang's deprecated `/get_load` (served up to 0.5.20)."""
        running, waiting, tokens = self.sim._sched.load()
        self._send_json(200, [{"dp_rank": 0, "num_reqs": running + waiting,
                               "num_waiting_reqs": waiting, "num_tokens": tokens}])

    def _v1_loads(self, _body: bytes) -> None:
        """SGLang's `/v1/loads` (core fields; `entrypoints/v1_loads.py`, `managers/load_snapshot.py`)."""
        running, waiting, tokens = self.sim._sched.load()
        config = self.sim.config
        self._send_json(200, {"timestamp": time.time(), "version": SIM_VERSION, "loads": [{
            "dp_rank": 0, "num_running_reqs": running, "num_waiting_reqs": waiting, "num_used_tokens": tokens,
            "max_total_num_tokens": config.max_total_num_tokens, "max_running_requests": config.max_running_requests,
            "token_usage": round(tokens / max(1, config.max_total_num_tokens), 4),
        }]})

    def _model_info(self, _body: bytes) -> None:
        config = self.sim.config
        self._send_json(200, {"model_path": config.model_path,
                              "tokenizer_path": config.tokenizer_path,
                              "is_generation": True, "preferred_sampling_params": None})

    def _models(self, _body: bytes) -> None:
        config = self.sim.config
        self._send_json(200, {"object": "list", "data": [{
            "id": config.served_model_name, "object": "model",
            "created": int(self.sim.created_t), "owned_by": "sglang",
            "root": config.model_path, "max_model_len": config.context_length}]})

    def _sim_stats(self, _body: bytes) -> None:
        self._send_json(200, self.sim.stats())

    def _sim_requests(self, _body: bytes) -> None:
        """The sampling fields of the chat requests received, in order (sampling_wire.RequestLog)."""
        self._send_json(200, {"requests": self.sim.requests.rows()})

    def _sim_config(self, body: bytes) -> None:
        try:
            changes = json.loads(body or b"{}")
            if not isinstance(changes, dict):
                raise ValueError("body must be a JSON object of SimConfig fields")
            self.sim.update_config(**changes)
        except (ValueError, KeyError, TypeError) as exc:
            self._bad_request(str(exc))
            return
        self._send_json(200, {"config": self.sim.public_config()})

    def _sim_crash(self, body: bytes) -> None:
        try:
            args = json.loads(body) if body.strip() else {}
            if not isinstance(args, dict):
                raise ValueError("body must be a JSON object")
            restart = args.get("restart_after_s")
            restart = None if restart is None else float(restart)
        except (ValueError, TypeError) as exc:
            self._bad_request(str(exc))
            return
        self._send_json(200, {"crashed": True, "restart_after_s": restart}, close=True)
        self.sim._crash(restart, exclude=self.connection)

    def _sim_reset_stats(self, _body: bytes) -> None:
        self.sim.reset_stats()
        self._send_json(200, {"ok": True})

    def _chat(self, body: bytes) -> None:
        """POST /v1/chat/completions, non-streaming (stream=true -> 400 by design)."""
        sim = self.sim
        config = sim.config
        proof = self.headers.get("X-Request-Id", "").startswith(PROOF_REQUEST_PREFIX)
        if proof:
            sim._count("proof_requests")  # a client's preflight probe: not counted as generation
        elif sim._note_generation_request():
            sim._crash(config.restart_after_s)
            self._reset()
            return
        if not sim.ready():
            self._error(503, NOT_READY_MSG, "ServiceUnavailableError")
            return
        request = self._parse_chat(body)
        if request is None:
            return
        messages, max_tokens, enable_thinking, separate_reasoning, model = request
        token_model = tokens.load_token_model(config.tokenizer_dir) if config.tokenizer_dir else None
        prompt_tokens = self._prompt_tokens
        vllm_error = (vllm_wire.context_error(prompt_tokens, max_tokens, config.context_length)
                      if config.engine == "vllm" else None)
        if vllm_error:
            self._bad_request(vllm_error)
            return
        if prompt_tokens >= config.context_length:
            self._bad_request(CONTEXT_TOO_LONG_MSG.format(
                input_tokens=prompt_tokens, context_length=config.context_length))
            return
        if max_tokens is not None and prompt_tokens + max_tokens > config.context_length:
            self._bad_request(TOTAL_TOO_LONG_MSG.format(
                context_length=config.context_length, total_tokens=prompt_tokens + max_tokens,
                input_tokens=prompt_tokens, max_tokens=max_tokens))
            return
        if config.track_ids and not proof:
            sim._note_prompt(lengths.prompt_hash(messages)[:16])
        # A proof request is the client's probe, not generation: it stays out of the history audit
        # (in all_turns mode it carries the input's original answers) and out of the radix model.
        cached = 0 if proof else sim.conversations.on_request(messages, prompt_tokens, config.track_history)
        if not config.radix_cache:
            cached = 0

        fault = None if proof else sim._draw_fault()
        poison = config.poison_text
        if not proof and poison and messages and poison in str(messages[-1].get("content") or ""):
            fault = config.poison_fault
        if fault == "error":
            self._error(500, INJECTED_ERROR_MSG, "InternalServerError")
            return
        if fault == "unavailable":
            self._error(503, INJECTED_UNAVAILABLE_MSG, "ServiceUnavailableError")
            return
        if fault == "hang":
            self.server.dead.wait(config.hang_s)
            self._reset()
            return
        if fault == "reset":
            self._reset()
            return

        req_seed = self._req_seed
        plan = lengths.plan_lengths(messages, seed=config.seed if req_seed is None else config.seed * 1_000_003 + req_seed,
                                    mean_tokens=config.mean_tokens,
                                    length_scale=config.length_scale,
                                    enable_thinking=enable_thinking)
        cap = max_tokens if max_tokens is not None else config.context_length - prompt_tokens
        parser_on = config.reasoning_parser is not None and (separate_reasoning or config.engine == "vllm")
        loop = config.loop_rate > 0 and random.Random(f"{plan.text_seed}:loop").random() < config.loop_rate
        skip = enable_thinking and self._skips_thinking(plan.text_seed)
        if skip:  # the model closes its thinking at once: no thinking words
            plan = dataclasses.replace(plan, thinking_tokens=0)
        completion = lengths.render_completion(plan, max_tokens=cap, separate_reasoning=parser_on, loop=loop,
                                               empty_think=skip)
        generated = None
        if token_model is not None:
            full = lengths.render_completion(plan, max_tokens=None, separate_reasoning=True)
            generated = token_model.generate(
                messages, {**self._template_kwargs, "enable_thinking": enable_thinking},
                "" if skip else full.reasoning_content, full.content, cap, config.noncanonical_rate,
                seed=plan.text_seed, strip_parsed=config.engine != "vllm")
            completion = _token_completion(generated, parser_on)
        if fault == "abort":
            # Cut halfway, answered 200 with finish_reason "abort" (SGLang's abort shape).
            partial = lengths.render_completion(plan, max_tokens=max(1, completion.completion_tokens // 2),
                                                separate_reasoning=parser_on)
            completion = dataclasses.replace(partial, finish_reason="abort", matched_stop=None)
            generated = None
        # A proof job takes a slot but stays out of the throughput stats (completed, busy, first admit).
        job = _Job("proof" if proof else "chat", completion.completion_tokens, prompt_tokens, time.monotonic())
        job.cached = cached
        if not sim._sched.submit(job, self.server.dead):
            self._error(503, QUEUE_FULL_MSG, "ServiceUnavailableError")
            return
        job.event.wait()
        if job.aborted:
            self._reset()
            return
        if completion.finish_reason in ("stop", "length") and not proof:
            sim.conversations.on_answer(messages, completion.content, config.track_history)
        drafted = sim.spec_draw(messages, completion.completion_tokens, req_seed)
        if config.engine == "vllm":
            ids = (generated.prompt_ids, generated.output_ids) if generated and self._return_token_ids else None
            self._send_json(200, vllm_wire.chat_response(model or config.served_model_name, int(time.time()),
                                                          completion, prompt_tokens, cached if config.radix_cache else 0,
                                                          token_ids=ids, metrics=spec_vllm.metrics_field(config, drafted)))
            return
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": completion.content,
                        "reasoning_content": completion.reasoning_content,
                        "tool_calls": None},
            "logprobs": None,
            "finish_reason": completion.finish_reason,
            "matched_stop": completion.matched_stop,
        }
        if generated is not None:
            choice.update(sglang_token_id_fields(config.spec_sglang_version or SIM_VERSION,
                                                 self._return_prompt_token_ids, self._return_token_ids,
                                                 generated.prompt_ids, generated.output_ids))
        answer = {
            "id": uuid.uuid4().hex,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model or config.served_model_name,
            "choices": [choice],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion.completion_tokens,
                "total_tokens": prompt_tokens + completion.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached} if config.radix_cache else None,
                "reasoning_tokens": completion.reasoning_tokens,
            },
        }
        spec_sglang.decorate(answer, self._spec_ask, config.spec_sglang_version or SIM_VERSION, drafted, {
            "id": answer["id"], "finish_reason": {"type": completion.finish_reason}, "prompt_tokens": prompt_tokens,
            "completion_tokens": completion.completion_tokens, "cached_tokens": cached})
        self._send_json(200, answer)

    def _skips_thinking(self, text_seed: int) -> bool:
        """Whether this thinking-on answer closes its thinking at once (SimConfig.skip_thinking_*)."""
        config = self.server.sim.config
        temperature = self._req_temperature
        if temperature is not None and temperature == 0:
            return config.skip_thinking_greedy
        return (config.skip_thinking_rate > 0
                and random.Random(f"{text_seed}:skip-thinking").random() < config.skip_thinking_rate)

    def _count_prompt(self, messages: list[Any], enable_thinking: bool) -> int:
        """`usage.prompt_tokens`: the rendered, encoded prompt with a tokenizer (tokens.py), else the word model's."""
        config = self.server.sim.config
        if not config.tokenizer_dir:
            return lengths.count_prompt_tokens(messages)
        model = tokens.load_token_model(config.tokenizer_dir)
        return len(model.encode(model.render(messages, {**self._template_kwargs, "enable_thinking": enable_thinking})))

    def _parse_chat(self, body: bytes) -> tuple[list[Any], int | None, bool, bool, Any] | None:
        """Validate the OpenAI body; on error answer 400 and return None."""
        try:
            obj = json.loads(body)
        except (ValueError, UnicodeDecodeError) as exc:
            self._bad_request(f"Invalid JSON in request body: {exc}")
            return None
        if not isinstance(obj, dict):
            self._bad_request("Request body must be a JSON object")
            return None
        messages = obj.get("messages")
        if not isinstance(messages, list) or not messages:
            self._bad_request("messages: Field required (a non-empty list of messages)")
            return None
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                self._bad_request(f"messages.{i}: each message needs a string 'role'")
                return None
        if obj.get("stream"):
            self._bad_request(STREAM_UNSUPPORTED_MSG)
            return None
        config = self.server.sim.config
        vllm = config.engine == "vllm"
        # Sampling fields as the engine's request model types them (sampling_wire.py); every request's
        # fields are recorded as received (GET /sim/requests), refused ones too.
        refused = sampling_wire.refusal(obj, config.engine)
        self.server.sim.requests.add(obj, self.headers.get("X-Request-Id", ""), refused)
        if refused:
            self._bad_request(refused)
            return None
        if vllm:
            missing = vllm_wire.model_error(obj.get("model"), str(config.served_model_name))
            if missing:
                self._error(404, missing, "NotFoundError")
                return None
        field = "max_completion_tokens" if obj.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = obj.get(field)
        if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
                                       or (max_tokens < 0 and not vllm)):
            self._bad_request("max_tokens must be a non-negative integer")
            return None
        kwargs = obj.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            self._bad_request("chat_template_kwargs must be an object")
            return None
        enable_thinking = bool(kwargs.get("enable_thinking", True)) and self.server.sim.config.thinks
        self._template_kwargs = {k: v for k, v in kwargs.items() if isinstance(k, str)}
        self._prompt_tokens = self._count_prompt(messages, enable_thinking)
        if vllm:
            # vLLM refuses max_tokens above max_model_len or below 1, and clamps one that does not fit
            # beside the prompt (see vllm_wire.check_max_tokens).
            max_tokens, refused = vllm_wire.check_max_tokens(field, max_tokens, self._prompt_tokens,
                                                             config.context_length)
            if refused:
                self._bad_request(refused)
                return None
        seed = obj.get("seed")
        self._req_seed = seed if isinstance(seed, int) and not isinstance(seed, bool) else None
        temperature = obj.get("temperature")
        self._req_temperature = (float(temperature) if isinstance(temperature, (int, float))
                                 and not isinstance(temperature, bool) else None)
        separate_reasoning = obj.get("separate_reasoning", True) is not False
        supported = self.server.sim.config.token_ids_supported
        self._return_token_ids = supported and obj.get("return_token_ids") is True
        self._return_prompt_token_ids = supported and obj.get("return_prompt_token_ids") is True
        self._spec_ask = {k: obj.get(k) for k in ("return_meta_info", "return_spec_tokens_details")}
        return messages, max_tokens, enable_thinking, separate_reasoning, obj.get("model")


def sglang_token_id_fields(version: str, want_prompt: bool, want_output: bool, prompt_ids: list[int],
                           output_ids: list[int]) -> dict[str, Any]:
    """The token-id fields SGLang `version` puts in a chat choice (docs/engines.md, read in the wheels):
    < 0.5.13 none (the request fields are unknown and dropped); 0.5.13-0.5.16 `prompt_token_ids` only
    (`return_token_ids` unknown); 0.5.17 `prompt_token_ids` and `token_ids`; >= 0.5.18
    `prompt_token_ids` and `response_token_ids` (the raw generated ids, stop token included)."""
    v = spec_sglang._version(version)
    out: dict[str, Any] = {}
    if v < (0, 5, 13) or not (want_prompt or (want_output and v >= (0, 5, 17))):
        return out
    out["prompt_token_ids"] = prompt_ids
    if want_output and v >= (0, 5, 17):
        out["token_ids" if v < (0, 5, 18) else "response_token_ids"] = output_ids
    return out


def _token_completion(g: tokens.Generated, parser_on: bool) -> lengths.Completion:
    """The word model's Completion shape for a token-level generation (without a parser, the decoded
    output as it is, `<think>`/`</think>` inline)."""
    if parser_on:
        return lengths.Completion(g.content, g.reasoning, len(g.output_ids), g.reasoning_tokens, g.finish_reason,
                                  g.matched_stop)
    return lengths.Completion(g.text, None, len(g.output_ids), 0, g.finish_reason, g.matched_stop)


class SimServer:
    """One simulated SGLang server; start() binds, crash()/restart keep the port."""

    def __init__(self, config: SimConfig | None = None, **overrides: Any) -> None:
        base = config if config is not None else SimConfig()
        self.config = derive_config(base, **overrides)
        self.port: int = self.config.port
        self.url: str = ""
        self._wall_offset = time.time() - time.monotonic()
        self._sched = _Scheduler(self)
        self._life = threading.RLock()
        self._httpd: _HTTPServer | None = None
        self._serve_thread: threading.Thread | None = None
        self._restart_timer: threading.Timer | None = None
        self._started = False
        self._stopped = False
        self._ready_at = 0.0
        self._gen_since_start = 0
        self._gen_after_restart = 0
        self._crashes = 0
        self._restarts = 0
        self.created_t = time.time()
        self.started_t: float | None = None
        fault_seed = self.config.fault_seed if self.config.fault_seed is not None \
            else self.config.seed
        self._fault_rng = random.Random(f"sim-faults:{fault_seed}")
        self.conversations = ConversationModel()
        self.spec_counters = spec_drafter.new_counters(self.config)
        # What every chat request carried (sampling fields, thinking flag): GET /sim/requests.
        self.requests = sampling_wire.RequestLog()

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> SimServer:
        """Bind (port 0 picks a free one), start serving, return self."""
        with self._life:
            if self._started:
                return self
            self._bring_up()
            self._sched.start()
            self._started = True
        logger.info("sim server %s listening (slots=%s)", self.url,
                    self.config.max_running_requests)
        return self

    def stop(self) -> None:
        """Shut down for good: in-flight connections are reset, threads end."""
        with self._life:
            if self._stopped:
                return
            self._stopped = True
            if self._restart_timer is not None:
                self._restart_timer.cancel()
            self._take_down(exclude=None)
        self._sched.close()

    def crash(self, restart_after_s: float | None = None) -> None:
        """Crash now: stop listening, reset every connection; maybe come back on the port."""
        self._crash(restart_after_s)

    def __enter__(self) -> SimServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def up(self) -> bool:
        """Listening (possibly still inside startup_delay_s)."""
        httpd = self._httpd
        return httpd is not None and not httpd.dead.is_set()

    def ready(self) -> bool:
        """Listening and past the startup delay: /health answers 200."""
        return self.up and time.monotonic() >= self._ready_at

    def wall(self, mono: float) -> float:
        """Monotonic time -> epoch seconds (stats are comparable across processes)."""
        return mono + self._wall_offset

    def _bring_up(self) -> None:
        httpd = _HTTPServer((self.config.host, self.port), self)
        self.port = int(httpd.server_address[1])
        self.config.port = self.port
        self.url = f"http://{self.config.host}:{self.port}"
        now = time.monotonic()
        self._ready_at = now + self.config.startup_delay_s
        self.started_t = self.wall(now)
        self._gen_since_start = 0
        self._httpd = httpd
        self._serve_thread = threading.Thread(target=httpd.serve, daemon=True,
                                              name=f"sim-accept-{self.port}")
        self._serve_thread.start()

    def _take_down(self, exclude: socket.socket | None) -> None:
        httpd = self._httpd
        if httpd is None or httpd.dead.is_set():
            return
        httpd.go_down(self._serve_thread)
        aborted = self._sched.abort_all()
        killed = httpd.kill_connections(exclude=exclude)
        logger.info("sim server %s down: %s jobs aborted, %s connections reset",
                    self.url, aborted, killed)

    def _crash(self, restart_after_s: float | None,
               exclude: socket.socket | None = None) -> None:
        with self._life:
            if self._stopped or not self.up:
                return
            self._crashes += 1
            self._take_down(exclude=exclude)
            logger.info("sim server %s crashed (restart_after_s=%s)", self.url,
                           restart_after_s)
            if restart_after_s is not None:
                self._schedule_restart(restart_after_s, attempt=0)

    def _schedule_restart(self, delay: float, attempt: int) -> None:
        timer = threading.Timer(max(0.0, delay), self._restart, args=(attempt,))
        timer.daemon = True
        self._restart_timer = timer
        timer.start()

    def _restart(self, attempt: int) -> None:
        with self._life:
            if self._stopped or self.up:
                return
            try:
                self._bring_up()
            except OSError as exc:
                if attempt >= 50:
                    logger.error("sim server port %s: restart failed for good: %s",
                                 self.port, exc)
                    return
                logger.debug("sim server port %s: rebind failed (%s), retrying", self.port, exc)
                self._schedule_restart(0.2, attempt + 1)
                return
            self._restarts += 1
        logger.info("sim server %s restarted", self.url)

    # -- runtime control ----------------------------------------------------------------------

    def update_config(self, **changes: Any) -> None:
        """Change knobs at runtime (slow_factor, fault rates, ...); host/port are fixed."""
        for name in changes:
            if name in RUNTIME_IMMUTABLE_FIELDS:
                raise ValueError(f"{name} cannot be changed at runtime")
        coerced = {name: coerce_field_value(name, value) for name, value in changes.items()}
        candidate = derive_config(self.config, **coerced)  # validates
        with self._sched.cv:
            for field in dataclasses.fields(SimConfig):
                value = getattr(candidate, field.name)
                if field.name not in RUNTIME_IMMUTABLE_FIELDS \
                        and getattr(self.config, field.name) != value:
                    setattr(self.config, field.name, value)
            if "fault_seed" in coerced:
                seed = candidate.fault_seed if candidate.fault_seed is not None else candidate.seed
                self._fault_rng = random.Random(f"sim-faults:{seed}")
        self._sched.kick()

    def public_config(self) -> dict[str, Any]:
        """The config without secrets (SGLang never echoes api_key)."""
        data = dataclasses.asdict(self.config)
        data.pop("api_key", None)
        return data

    def server_info(self) -> dict[str, Any]:
        """/get_server_info: flattened server args + internal_states, api_key redacted."""
        config = self.config
        running, _, _ = self._sched.load()
        step = config.token_time_s * config.slow_factor
        throughput = running / step if step > 0 else 0.0
        info = self.public_config()
        info.update({
            "port": self.port,
            "max_total_num_tokens": config.max_total_num_tokens,
            "max_total_tokens": None,
            "tp_size": 1,
            "dp_size": 1,
            "pp_size": 1,
            "random_seed": config.seed,
            "schedule_policy": "fcfs",
            "chunked_prefill_size": 8192,
            "skip_server_warmup": False,
            "enable_metrics": config.enable_metrics,
            "version": config.spec_sglang_version or SIM_VERSION,
            "internal_states": [{"max_total_num_tokens": config.max_total_num_tokens,
                                 "last_gen_throughput": throughput,
                                 **spec_sglang.internal_state(self.spec_counters)}],
            "simulated": True,
            **spec_sglang.server_args(config),
        })
        return info

    def spec_draw(self, messages: list[Any], completion_tokens: int,
                  request_seed: int | None) -> spec_drafter.Drafted | None:
        """One answered request's speculative decoding (None when not speculating), counted."""
        return spec_drafter.draw_and_count(self, messages, completion_tokens, request_seed)

    def stats(self) -> dict[str, Any]:
        """Counters for benchmarks: busy slot-seconds and output tokens give ideal throughput."""
        running, waiting, _ = self._sched.load()
        with self._sched.cv:
            snapshot = json.loads(json.dumps(self._sched.stats))
        snapshot.update({
            "running": running,
            "waiting": waiting,
            "started_t": self.started_t,
            "capacity_slots": self.config.max_running_requests,
            "token_time_s": self.config.token_time_s,
            "slow_factor": self.config.slow_factor,
            "up": self.up,
            "ready": self.ready(),
            "crashes": self._crashes,
            "restarts": self._restarts,
            # Generation requests received after a restart: > 0 means clients came back to it.
            "generation_requests_after_restart": self._gen_after_restart,
            "url": self.url,
            "scheduler_wakeups": self._sched.wakeups,
        })
        if not self.config.track_ids:
            snapshot.pop("ids", None)
        snapshot["conversation"] = self.conversations.stats()
        return snapshot

    def reset_stats(self) -> None:
        """Zero the counters (running/waiting stay live); busy time restarts from now."""
        self._sched.reset_stats()
        self.conversations.reset()
        self.requests.clear()

    # -- helpers for the handler (thread-safe) ------------------------------------------------

    def _count(self, key: str) -> None:
        with self._sched.cv:
            self._sched.stats[key] += 1

    def _count_error(self, code: int) -> None:
        with self._sched.cv:
            errors = self._sched.stats["errors_by_code"]
            errors[str(code)] = errors.get(str(code), 0) + 1

    def _note_prompt(self, digest: str) -> None:
        with self._sched.cv:
            ids = self._sched.stats["ids"]
            ids[digest] = ids.get(digest, 0) + 1

    def _note_generation_request(self) -> bool:
        """Count a generation request; True when it is the one that triggers the crash."""
        with self._sched.cv:
            self._sched.stats["generation_requests"] += 1
            self._gen_since_start += 1
            if self._restarts:
                self._gen_after_restart += 1
            limit = self.config.crash_after_requests
            return limit is not None and self._gen_since_start >= limit

    def _draw_fault(self) -> str | None:
        """One uniform draw per generation request, so the fault sequence is reproducible."""
        config = self.config
        with self._sched.cv:
            u = self._fault_rng.random()
            edge = 0.0
            for kind, rate in (("error", config.error_rate),
                               ("unavailable", config.unavailable_rate),
                               ("hang", config.hang_rate), ("reset", config.reset_rate),
                               ("abort", config.abort_rate)):
                edge += rate
                if u < edge:
                    self._sched.stats["faults"][kind] += 1
                    return kind
        return None


class SimFleet:
    """Several SimServers started and stopped together (tests, demo, benchmarks)."""

    def __init__(self, configs: Iterable[SimConfig]) -> None:
        self.servers: list[SimServer] = []
        for index, config in enumerate(configs):
            if config.fault_seed is None:
                config = dataclasses.replace(config, fault_seed=index)
            self.servers.append(SimServer(config))

    @classmethod
    def uniform(cls, count: int, **overrides: Any) -> SimFleet:
        """``count`` servers with the same knobs."""
        return cls(SimConfig(**overrides) for _ in range(count))

    def start(self) -> SimFleet:
        try:
            for server in self.servers:
                server.start()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for server in self.servers:
            server.stop()

    @property
    def urls(self) -> list[str]:
        return [server.url for server in self.servers]

    def stats(self) -> list[dict[str, Any]]:
        return [server.stats() for server in self.servers]

    def __enter__(self) -> SimFleet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __len__(self) -> int:
        return len(self.servers)

    def __iter__(self) -> Iterator[SimServer]:
        return iter(self.servers)

    def __getitem__(self, index: int) -> SimServer:
        return self.servers[index]


def start_fleet(configs: Sequence[SimConfig]) -> SimFleet:
    """Start ``configs`` as a fleet (shorthand for SimFleet(configs).start())."""
    return SimFleet(configs).start()
