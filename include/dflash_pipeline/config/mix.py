"""The mix report's dimensions and the `target_mix` param (its JSON schema and its checks).

Why here: the dimensions and their bucket labels are part of the param's interface (a target names
them), and config is checked before any GPU is touched; the counting lives in
steps/validate/mix.py, which imports these.

A target is {dimension: {label: share}}: shares in 0..1, each dimension's shares summing to 1
(within TARGET_SUM_TOLERANCE). Free-text dimensions (source, domain, language) take any label;
`thinking` takes "true" / "false"; the bucketed ones take their bucket labels.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from dflash_pipeline.config.schema import ConfigError

MIX_DIMENSIONS = ("source", "domain", "thinking", "language", "prompt_length", "completion_length", "turns")
UNKNOWN = "unknown"
TARGET_SUM_TOLERANCE = 0.01

# Bucket lower edges (half-open [edge, next edge), the last one open). Prompt and completion lengths are
# the server's usage counts (prompt_tokens / completion_tokens of the row, summed over regenerated turns).
PROMPT_LENGTH_EDGES = (0, 128, 512, 2048, 8192)
COMPLETION_LENGTH_EDGES = (0, 256, 1024, 4096, 16384)
# Turns: user messages in the conversation (1 for a single-turn prompt).
TURNS_EDGES = (1, 2, 3, 4, 8)


def bucket_labels(edges: tuple[int, ...]) -> tuple[str, ...]:
    """Labels of the buckets of `edges`: "0-127", ..., "8192+" (a one-value bucket is just its value)."""
    out = []
    for lo, hi in zip(edges, edges[1:]):
        out.append(str(lo) if hi - lo == 1 else f"{lo}-{hi - 1}")
    out.append(f"{edges[-1]}+")
    return tuple(out)


BUCKET_EDGES: dict[str, tuple[int, ...]] = {
    "prompt_length": PROMPT_LENGTH_EDGES,
    "completion_length": COMPLETION_LENGTH_EDGES,
    "turns": TURNS_EDGES,
}
FIXED_LABELS: dict[str, tuple[str, ...]] = {
    "thinking": ("true", "false"),
    **{dim: bucket_labels(edges) for dim, edges in BUCKET_EDGES.items()},
}

TARGET_MIX_DESCRIPTION = (
    "The mix the drafter will serve, to compare the data with: {dimension: {label: share}}, e.g. "
    '{"domain": {"math": 0.3, "code": 0.3, "chat": 0.4}, "thinking": {"true": 0.5, "false": 0.5}}. '
    f"Dimensions: {', '.join(MIX_DIMENSIONS)}. Shares 0..1, summing to 1 (+-{TARGET_SUM_TOLERANCE}) per dimension. "
    "Labels: source/domain/language as the rows carry them; thinking 'true'/'false'; "
    + "; ".join(f"{d} {', '.join(FIXED_LABELS[d])}" for d in BUCKET_EDGES)
    + ". The report shows each dimension's actual shares next to the target, with the gap. Report only: "
    "nothing is dropped or resampled. Null = no target."
)


def target_mix_schema(section: str) -> dict[str, Any]:
    """The param's JSON schema (Airflow checks it in the trigger form; check_target_mix adds the sums)."""
    return {
        "type": ["null", "object"],
        "default": None,
        "propertyNames": {"enum": list(MIX_DIMENSIONS)},
        "additionalProperties": {
            "type": "object",
            "minProperties": 1,
            "propertyNames": {"minLength": 1, "maxLength": 200},
            "additionalProperties": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "description": TARGET_MIX_DESCRIPTION,
        "section": section,
    }


def check_target_mix(value: Any) -> dict[str, dict[str, float]] | None:
    """The target as {dimension: {label: share}}, or None for none; ConfigError naming what is wrong."""
    if value is None or value == {}:
        return None
    if not isinstance(value, Mapping):
        raise ConfigError(f"param target_mix: must be an object {{dimension: {{label: share}}}}, got {value!r}")
    out: dict[str, dict[str, float]] = {}
    for dim, shares in value.items():
        if dim not in MIX_DIMENSIONS:
            raise ConfigError(f"param target_mix: unknown dimension {dim!r}; known: {', '.join(MIX_DIMENSIONS)}")
        if not isinstance(shares, Mapping) or not shares:
            raise ConfigError(f"param target_mix.{dim}: must be a non-empty object {{label: share}}, got {shares!r}")
        allowed = FIXED_LABELS.get(dim)
        clean: dict[str, float] = {}
        for label, share in shares.items():
            if not isinstance(label, str) or not label:
                raise ConfigError(f"param target_mix.{dim}: labels must be non-empty strings, got {label!r}")
            if allowed is not None and label not in allowed:
                raise ConfigError(f"param target_mix.{dim}: unknown label {label!r}; known: {', '.join(allowed)}")
            if isinstance(share, bool) or not isinstance(share, (int, float)) or not math.isfinite(share):
                raise ConfigError(f"param target_mix.{dim}.{label}: share must be a number, got {share!r}")
            if not 0 <= share <= 1:
                raise ConfigError(f"param target_mix.{dim}.{label}: share {share} is not within 0..1")
            clean[label] = float(share)
        total = sum(clean.values())
        if abs(total - 1.0) > TARGET_SUM_TOLERANCE:
            raise ConfigError(f"param target_mix.{dim}: shares sum to {total:.4g}, not 1 "
                              f"(+-{TARGET_SUM_TOLERANCE}): {clean}")
        out[dim] = clean
    return out
