"""Server abilities (serving/abilities.py) from a manifest entry and a proof, and their table on the
progress page. The wire itself is checked in tests/integration/test_engine_abilities.py (simulated
SGLang releases and vLLM) and tests/engine/test_vllm_wire.py (the real vLLM engine)."""

from __future__ import annotations

from typing import Any

import pytest

from dflash_pipeline.monitor import ui
from dflash_pipeline.monitor.ui_app import server_abilities_rows
from dflash_pipeline.serving.abilities import server_abilities, token_exact_warning, token_ids_expected
from dflash_pipeline.serving.engines import token_id_sources
from dflash_pipeline.serving.sglang import parse_chat_response


@pytest.mark.parametrize(("engine", "version", "expected"), [
    ("sglang", "0.5.12", "none"), ("sglang", "v0.5.13.post1", "prompt only"), ("sglang", "0.5.16", "prompt only"),
    ("sglang", "0.5.17", "prompt+output"), ("sglang", "0.5.23", "prompt+output"),
    ("vllm", "0.10.1", "none"), ("vllm", "0.10.2", "prompt+output"), ("vllm", "0.32.0", "prompt+output"),
    ("openai", None, "none"), ("sglang", None, None), ("vllm", "dev", None),
])
def test_token_ids_expected_follows_docs_engines_table(engine: str, version: str | None, expected: str | None) -> None:
    assert token_ids_expected(engine, version) == expected


def test_token_id_sources_name_the_fields_each_engine_uses() -> None:
    ids = [1, 2]
    assert token_id_sources({"prompt_token_ids": ids}, {"token_ids": ids}) == ("prompt_token_ids", "choices[].token_ids")
    assert token_id_sources({}, {"prompt_token_ids": ids, "response_token_ids": ids}) == (
        "choices[].prompt_token_ids", "choices[].response_token_ids")
    assert token_id_sources({}, {"prompt_token_ids": ["x"]}) == (None, None), "not all ints: absent"
    body = {"choices": [{"message": {"content": "4"}, "finish_reason": "stop", "prompt_token_ids": ids}], "usage": {}}
    assert parse_chat_response(body).token_id_sources == ("choices[].prompt_token_ids", None)


def _proof(prompt: str | None, output: str | None, shape: str = "field") -> dict[str, Any]:
    return {"token_ids": {"prompt": prompt, "output": output}, "reasoning_shape": shape}


def test_abilities_come_from_the_proof_not_the_version() -> None:
    server = {"engine": "sglang", "version": "0.5.23", "max_running_requests": 48}
    exact = server_abilities(server, _proof("choices[].prompt_token_ids", "choices[].response_token_ids"), None, True)
    assert exact["token_exact"] and exact["slots"] == 48 and exact["note"] is None
    # The release should return ids but the answer had none: evidence wins, with a note.
    lost = server_abilities(server, _proof(None, None, "inline"), None, True)
    assert not lost["token_exact"] and lost["token_ids"] == "none" and lost["reasoning"] == "inline"
    assert "0.5.23 should return prompt+output" in lost["note"]
    # Thinking off: the proof cannot show the parser; a generic server: no slots, no ids, no note.
    generic = server_abilities({"engine": "openai", "version": None}, _proof(None, None, "none"), None, False)
    assert generic["reasoning"] == "not checked" and generic["slots"] is None and generic["note"] is None
    assert "latency" in generic["slots_source"]
    spec = {"algorithm": "EAGLE3", "num_draft_tokens": 3, "stats_source": None}
    assert server_abilities(server, _proof(None, None), spec, True)["speculative"] == "EAGLE3"


def test_warning_names_only_the_servers_that_lose_exactness() -> None:
    found = {"a": {"token_exact": True}, "b": {"token_exact": False, "engine": "sglang", "version": "0.5.14",
                                               "token_ids": "prompt only"}}
    warning = token_exact_warning(found)
    assert warning is not None and "1 server(s): b (sglang 0.5.14: token ids prompt only)" in warning
    assert "a (" not in warning and "require_token_exact" in warning
    assert token_exact_warning({"a": {"token_exact": True}}) is None


def test_progress_page_shows_the_abilities_table() -> None:
    manifest = {"servers": [
        {"name": "gpu0", "abilities": server_abilities(
            {"engine": "sglang", "version": "0.5.14", "max_running_requests": 32},
            _proof("choices[].prompt_token_ids", None), None, True)},
        {"name": "gpu1", "unreachable": "Connection refused"},
    ]}
    rows = server_abilities_rows(manifest)
    assert [r["server"] for r in rows] == ["gpu0", "gpu1"]
    assert rows[1]["note"] == "unreachable at preflight: Connection refused"
    html = ui.run_main({"run_state": "running", "progress": _progress(), "abilities": rows})
    table = html.split("Server abilities (preflight)", 1)[1].split("</table>", 1)[0]
    assert '<span class="mono">gpu0</span>' in table and "sglang 0.5.14" in table
    assert '<span class="err">prompt only</span>' in table and "choices[].prompt_token_ids" in table
    assert ">32<" in table and "unreachable at preflight" in table


def _progress() -> dict[str, Any]:
    from dflash_pipeline.monitor.fleet import aggregate

    return aggregate({"chunks": {"sizes": [10]}}, {}, [], now=2.0)
