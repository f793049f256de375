"""A simulated SGLang server fleet for tests, the demo and throughput benchmarks.

Why: client code (dispatch, retries, resume, validation) must be tested against SGLang's real
wire behaviour -- continuous batching, queue-full 503s, context-length 400s, reasoning split,
crashes that reset connections -- without GPUs.  Stdlib only, so it starts in milliseconds.

    from dflash_pipeline.dev.sim import SimConfig, SimServer, SimFleet
    with SimServer(SimConfig(token_time_s=0.001, length_scale=0.01)) as server:
        requests.post(server.url + "/v1/chat/completions", json={...})
"""

from __future__ import annotations

from dflash_pipeline.dev.sim.lengths import (
    PROMPT_TOKENS_PER_MESSAGE,
    PROMPT_TOKENS_PRIMING,
    Completion,
    LengthPlan,
    count_prompt_tokens,
    count_tokens,
    plan_lengths,
    prompt_hash,
    render_completion,
)
from dflash_pipeline.dev.sim.server import (
    CONTEXT_TOO_LONG_MSG,
    QUEUE_FULL_MSG,
    SIM_VERSION,
    TOTAL_TOO_LONG_MSG,
    SimConfig,
    SimFleet,
    SimServer,
    coerce_field_value,
    start_fleet,
)

__all__ = [
    "CONTEXT_TOO_LONG_MSG",
    "PROMPT_TOKENS_PER_MESSAGE",
    "PROMPT_TOKENS_PRIMING",
    "QUEUE_FULL_MSG",
    "SIM_VERSION",
    "TOTAL_TOO_LONG_MSG",
    "Completion",
    "LengthPlan",
    "SimConfig",
    "SimFleet",
    "SimServer",
    "coerce_field_value",
    "count_prompt_tokens",
    "count_tokens",
    "plan_lengths",
    "prompt_hash",
    "render_completion",
    "start_fleet",
]
