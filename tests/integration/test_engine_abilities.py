"""Preflight finds each server's abilities on a fleet of the simulator's SGLang releases and its vLLM
flavour: token ids (and in which fields), separate reasoning, speculative statistics, slots.

Real sockets: moto for S3, in-process simulators speaking each release's wire (the token-id fields
per SGLang version: dev/sim/server.py `sglang_token_id_fields`; the speculative fields:
dev/sim/spec_sglang.py), the library's plan and preflight as the DAG calls them. The same check
against the real vLLM engine is tests/engine/test_vllm_wire.py::test_preflight_abilities.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dflash_pipeline.config import ConfigError, RunConfig
from dflash_pipeline.dataset.layout import DatasetLayout
from dflash_pipeline.dev.sim import SimConfig, SimFleet
from dflash_pipeline.serving.sglang import ServerSpec
from dflash_pipeline.serving.specwire import SOURCE_SGLANG_META, SOURCE_SGLANG_SGLEXT, SOURCE_VLLM
from dflash_pipeline.steps.plan import run_plan
from dflash_pipeline.steps.preflight import run_preflight

FAST = {"token_time_s": 0.0005, "length_scale": 0.02, "max_running_requests": 6}
SPEC = {"spec_algorithm": "EAGLE3", "spec_num_draft_tokens": 3}

# (name, SimConfig overrides, expected abilities subset)
FLEET: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    ("sglang-0.5.12", {"spec_sglang_version": "0.5.12", **SPEC},
     {"engine": "sglang", "version": "0.5.12", "token_ids": "none", "token_exact": False, "token_ids_via": None,
      "reasoning": "separate", "speculative": "EAGLE3", "spec_stats": None, "slots": 6, "note": None}),
    ("sglang-0.5.13", {"spec_sglang_version": "0.5.13", **SPEC},
     {"version": "0.5.13", "token_ids": "prompt only", "token_exact": False,
      "token_ids_via": "choices[].prompt_token_ids", "spec_stats": SOURCE_SGLANG_META}),
    ("sglang-0.5.17", {"spec_sglang_version": "0.5.17"},
     {"version": "0.5.17", "token_ids": "prompt+output", "token_exact": True,
      "token_ids_via": "choices[].prompt_token_ids + choices[].token_ids", "speculative": None, "spec_stats": None}),
    ("sglang-0.5.19", {"spec_sglang_version": "0.5.19", **SPEC},
     {"version": "0.5.19", "token_ids": "prompt+output", "token_exact": True,
      "token_ids_via": "choices[].prompt_token_ids + choices[].response_token_ids", "spec_stats": SOURCE_SGLANG_SGLEXT}),
    ("sglang-0.5.23-no-parser", {"reasoning_parser": None},
     {"version": "0.5.23-sim", "token_exact": True, "reasoning": "inline"}),
    ("vllm", {"engine": "vllm", "spec_algorithm": "ngram", "spec_num_draft_tokens": 3},
     {"engine": "vllm", "version": "0.32.0+sim", "token_ids": "prompt+output", "token_exact": True,
      "token_ids_via": "prompt_token_ids + choices[].token_ids", "reasoning": "separate",
      "speculative": "3 draft tokens", "spec_stats": SOURCE_VLLM, "slots": None}),
    ("vllm-old", {"engine": "vllm", "token_ids_supported": False},
     {"engine": "vllm", "token_ids": "none", "token_exact": False,
      "note": "vllm 0.32.0+sim should return prompt+output token ids, the proof answer had none "
              "(a proxy that drops fields, or a patched build?)"}),
]
NOT_EXACT = ["sglang-0.5.12", "sglang-0.5.13", "vllm-old"]


def _setup(s3: Any, bucket: str, fleet: SimFleet, tag: str, **params: Any) -> tuple[RunConfig, list[ServerSpec]]:
    s3.put_object(Bucket=bucket, Key=f"{tag}/p.jsonl",
                  Body="\n".join(json.dumps({"id": f"q{i}", "prompt": f"what is {i} + 1?"}) for i in range(6)).encode())
    cfg = RunConfig.from_params({"prompts_uri": f"s3://{bucket}/{tag}/p.jsonl", "output_uri": f"s3://{bucket}/{tag}/ds",
                                 "servers": fleet.urls, **params})
    run_plan(s3, cfg, f"{tag}-run1")
    return cfg, [ServerSpec(name, url) for (name, _, _), url in zip(FLEET, fleet.urls)]


def _manifest(s3: Any, cfg: RunConfig) -> dict[str, Any]:
    layout = DatasetLayout.from_uri(cfg.output_uri)
    return json.loads(s3.get_object(Bucket=layout.bucket, Key=layout.manifest_key)["Body"].read())


@pytest.fixture
def fleet(qwen_tokenizer: Path) -> Any:
    configs = [SimConfig(tokenizer_dir=str(qwen_tokenizer), **FAST, **over) for _, over, _ in FLEET]
    with SimFleet(configs).start() as f:
        yield f


def test_preflight_records_each_servers_abilities_and_warns_of_lost_exactness(s3_client, bucket, fleet, caplog) -> None:
    cfg, specs = _setup(s3_client, bucket, fleet, "abilities")
    with caplog.at_level("WARNING"):
        run_preflight(s3_client, cfg, specs, "abilities-run1")
    manifest = _manifest(s3_client, cfg)
    found = {s["name"]: s["abilities"] for s in manifest["servers"]}
    for name, _, expected in FLEET:
        assert {k: found[name].get(k) for k in expected} == expected, name
    warning = manifest["runs"]["abilities-run1"]["token_exact_warning"]
    lost = warning.split("token-exactness is lost on ", 1)[1]
    assert lost.startswith(f"{len(NOT_EXACT)} server(s): ")
    for name in (n for n, _, _ in FLEET):
        assert (f"{name} (" in lost) == (name in NOT_EXACT), name
    assert warning in caplog.text, "the warning is logged before the run starts"
    assert "vllm-old" in caplog.text and "should return prompt+output" in caplog.text


def test_require_token_exact_refuses_before_any_generation(s3_client, bucket, fleet) -> None:
    cfg, specs = _setup(s3_client, bucket, fleet, "exact", require_token_exact=True)
    with pytest.raises(ConfigError, match="require_token_exact: token-exactness is lost on 3 server") as err:
        run_preflight(s3_client, cfg, specs, "exact-run1")
    for name in NOT_EXACT:
        assert f"{name} (" in str(err.value)
    stats = fleet.stats()
    assert sum(s["generation_requests"] for s in stats) == 0
    assert [s["proof_requests"] for s in stats] == [1] * len(FLEET)
    # An exact fleet passes with the same param.
    exact = [i for i, (n, _, _) in enumerate(FLEET) if n not in NOT_EXACT]
    cfg2 = RunConfig.from_params({**{k: v for k, v in cfg.to_dict().items() if k in ("prompts_uri",)},
                                  "output_uri": f"s3://{bucket}/exact2/ds", "servers": [fleet.urls[i] for i in exact],
                                  "require_token_exact": True})
    run_plan(s3_client, cfg2, "exact2-run1")
    out = run_preflight(s3_client, cfg2, [specs[i] for i in exact], "exact2-run1")
    assert [o["healthy"] for o in out] == [True] * len(exact)
    assert "token_exact_warning" not in _manifest(s3_client, cfg2)["runs"]["exact2-run1"]
