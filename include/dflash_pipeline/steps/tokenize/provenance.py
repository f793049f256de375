"""Provenance of the token files: which tokenizer and chat template made them, from which model and engines.

Why: a trainer must be able to tell whether our ids were made with its tokenizer and template before it
trains on them. SpecForge keys its preprocessing cache on ``sha256(chat_template)[:12]``
(specforge/training/assembly.py ``_tokenizer_chat_template_hash``), so the template's full sha256 is recorded
here and its first 12 hex digits are that key. Model, engines and sampling come from the dataset's
``manifest.json`` (plan pins the sampling; preflight records each server's engine and version).
Pure functions of bytes and dicts: the caller reads the files.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

SPECFORGE_TEMPLATE_HASH_CHARS = 12


def sha256_hex(data: bytes | str) -> str:
    return hashlib.sha256(data.encode("utf-8") if isinstance(data, str) else data).hexdigest()


def tokenizer_provenance(tokenizer_json: bytes, chat_template: str | None, source: str) -> dict[str, Any]:
    """Hashes of the tokenizer.json bytes and of the chat template text (UTF-8, as SpecForge hashes it)."""
    template_sha = sha256_hex(chat_template) if chat_template else None
    return {
        "source": source,
        "tokenizer_json_sha256": sha256_hex(tokenizer_json),
        "tokenizer_json_bytes": len(tokenizer_json),
        "chat_template_sha256": template_sha,
        "specforge_template_hash": template_sha[:SPECFORGE_TEMPLATE_HASH_CHARS] if template_sha else None,
    }


def manifest_provenance(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """Model, engines (engine + version per distinct pair), servers and sampling, from a manifest.json."""
    servers = [s for s in manifest.get("servers") or [] if isinstance(s, Mapping)]
    engines = sorted({(str(s.get("engine") or "unknown"), str(s.get("version") or "unknown"))
                      for s in servers if not s.get("unreachable")})
    served = sorted({str(s.get("served_model_name") or s.get("model_path")) for s in servers
                     if s.get("served_model_name") or s.get("model_path")})
    pinned = manifest.get("pinned") or {}
    inp = manifest.get("input") or {}
    return {
        "model": manifest.get("model_resolved"),
        "served_model_names": served,
        "engines": [{"engine": e, "version": v} for e, v in engines],
        "servers": len(servers),
        "sampling": dict(pinned.get("sampling") or {}),
        "regenerate": inp.get("regenerate", (pinned.get("input") or {}).get("regenerate")),
        "samples_per_prompt": inp.get("samples_per_prompt"),
        "prompts": inp.get("prompts"),
        "prompts_uri": inp.get("uri"),
        "prompts_sha256": inp.get("sha256"),
        "plan_id": manifest.get("plan_id"),
    }


def provenance(
    manifest: Mapping[str, Any], tokenizer_json: bytes, chat_template: str | None, tokenizer_source: str
) -> dict[str, Any]:
    """The ``provenance`` block of tokenized/settings.json, the report and the dataset card."""
    return {"tokenizer": tokenizer_provenance(tokenizer_json, chat_template, tokenizer_source),
            "generation": manifest_provenance(manifest)}


def specforge_template_name(generation_prompt: str, thinking: bool) -> str | None:
    """The SpecForge 0.2.0 chat template (specforge/data/template.py) whose assistant header is where our
    model's output starts, or None when the template is not ChatML.

    `generation_prompt` is what the chat template appends for ``add_generation_prompt`` with thinking on
    (e.g. ``<|im_start|>assistant\\n<think>\\n`` for Qwen3.5/3.6). ``qwen3.5``'s header includes
    ``<think>\\n`` and its default system prompt is empty; ``qwen3-thinking``'s header stops before
    ``<think>`` (Qwen3 generates it) and it adds "You are a helpful assistant." to rows without a system
    message. Never ``qwen``: it has no thinking parser and drops ``reasoning_content``. With thinking off,
    ``qwen3-instruct`` masks the empty think block the template writes (it also adds the default system
    prompt)."""
    if not generation_prompt.startswith("<|im_start|>assistant\n"):
        return None
    if not thinking:
        return "qwen3-instruct"
    return "qwen3.5" if generation_prompt.endswith("<think>\n") else "qwen3-thinking"
