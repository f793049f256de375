"""config/evaluate.py: dflash_eval's params refused with clear messages, conditions expanded, the
RunConfig of each (group, condition) derived from generate's own config."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest

from dflash_pipeline.config import EVAL_PARAM_SCHEMAS, ConfigError, EvalConfig

GOOD: dict[str, Any] = {
    "prompts_uri": "s3://bk1/bench/prompts.jsonl",
    "output_uri": "s3://bk1/evals/e1",
    "drafters": [{"name": "dflash", "servers": ["http://gpu0:30000", "gpu1_conn"]},
                 {"name": "eagle3", "servers": ["http://gpu2:30000"]}],
    "baseline": {"name": "no-spec", "servers": ["http://gpu3:30000"]},
}


def conf(**changes: Any) -> dict[str, Any]:
    out = dict(GOOD)
    out.update(changes)
    return {k: v for k, v in out.items() if v is not ...}


def test_good_conf_builds_groups_in_order_with_the_baseline_last() -> None:
    cfg = EvalConfig.from_params(conf())
    assert [g.name for g in cfg.groups] == ["dflash", "eagle3", "no-spec"]
    assert [g.name for g in cfg.drafters] == ["dflash", "eagle3"]
    assert cfg.baseline is not None and cfg.baseline.baseline and cfg.baseline.servers == ("http://gpu3:30000",)
    assert cfg.concurrency == (1, "production") and cfg.greedy is True
    assert cfg.group_uri("dflash", "greedy_think-on_c1") == "s3://bk1/evals/e1/dflash/greedy_think-on_c1"


@pytest.mark.parametrize("changes, message", [
    ({"prompts_uri": ...}, "give exactly one of dataset_uri"),
    ({"dataset_uri": "s3://bk1/datasets/d1"}, "got both"),
    ({"drafters": []}, "required param(s) missing: ['drafters']"),
    ({"drafters": [{"name": "a b", "servers": ["http://x:1"]}]}, "drafters[0].name: 'a b' must be 1-64 letters"),
    ({"drafters": [{"name": "a", "servers": []}]}, "drafters[0] (a): servers must be a non-empty list"),
    ({"drafters": [{"name": "a", "servers": ["http://x:1"], "k": 4}]}, "unknown key(s) ['k']"),
    ({"drafters": ["http://x:1"]}, "drafters[0]: 'http://x:1' is not an object"),
    ({"drafters": [{"name": "a", "servers": ["http://x:1"]}, {"name": "a", "servers": ["http://y:1"]}]},
     "group name(s) ['a'] used twice"),
    ({"drafters": [{"name": "a", "servers": ["http://x:1"]}], "baseline": {"name": "b", "servers": ["http://x:1/"]}},
     "server 'http://x:1/' is in both 'a' and 'b'"),
    ({"drafters": [{"name": "a", "servers": ["http://x:1", "http://x:1"]}]}, "a server is listed twice"),
    ({"concurrency": [0]}, "concurrency"),
    ({"concurrency": ["max"]}, "bad: ['max']"),
    ({"concurrency": []}, "concurrency"),
    ({"thinking_modes": ["maybe"]}, "thinking_modes"),
    ({"max_tokens": 0}, "max_tokens: 0 is less than the minimum of 1"),
    ({"output_uri": "s3://bk1/bench"}, "must not be or contain the prompt source"),
    ({"prompts_uri": ..., "dataset_uri": "s3://bk1/evals/e1"}, "must not be or contain the prompt source"),
    ({"output_uri": "/tmp/x"}, "output_uri"),
    ({"confidence": 1.0}, "confidence"),
    ({"servers": ["http://x"]}, "unknown conf key(s) ['servers']"),
])
def test_bad_conf_is_refused_with_a_clear_message(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        EvalConfig.from_params(conf(**changes))
    assert message in str(err.value)


@pytest.mark.parametrize("name, value", [
    ("drafters", [{"name": "a"}]),
    ("drafters", [{"name": "a/b", "servers": ["http://x:1"]}]),
    ("concurrency", [1, "max"]),
    ("concurrency", [0]),
    ("thinking_modes", ["on", "on"]),
    ("baseline", {"servers": ["http://x:1"]}),
    ("max_prompts", 0),
])
def test_the_param_schemas_refuse_what_airflow_would(name: str, value: Any) -> None:
    """Airflow validates each Param's schema at trigger (before a run exists): the same bad values."""
    schema = {k: v for k, v in EVAL_PARAM_SCHEMAS[name].items() if k not in ("description", "section", "default")}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(value, schema)
    good = EVAL_PARAM_SCHEMAS[name].get("default")
    if good is not None:
        jsonschema.validate(good, schema)


def test_an_eval_root_may_live_under_its_dataset() -> None:
    cfg = EvalConfig.from_params(conf(prompts_uri=..., dataset_uri="s3://bk1/ds/d1", output_uri="s3://bk1/ds/d1/evals/e1"))
    assert cfg.dataset_uri == "s3://bk1/ds/d1" and cfg.prompts_uri is None


def test_conditions_expand_sampling_thinking_concurrency() -> None:
    cfg = EvalConfig.from_params(conf(thinking_modes=["on", "off"], concurrency=[1, 8, "production"]))
    names = [c.name for c in cfg.conditions()]
    assert names == [f"{s}_think-{t}_{c}" for s in ("sampled", "greedy") for t in ("on", "off")
                     for c in ("c1", "c8", "cprod")]
    greedy = [c for c in cfg.conditions() if c.sampling == "greedy"]
    assert {(c.temperature, c.top_p) for c in greedy} == {(0.0, 1.0)}
    assert {(c.temperature, c.top_p) for c in cfg.conditions() if c.sampling == "sampled"} == {(0.6, 0.95)}


def test_thinking_defaults_to_the_datasets_mode() -> None:
    cfg = EvalConfig.from_params(conf(greedy=False, concurrency=[1]))
    assert [c.name for c in cfg.conditions(dataset_thinking=False)] == ["sampled_think-off_c1"]
    assert [c.name for c in cfg.conditions(dataset_thinking=None)] == ["sampled_think-on_c1"]


def test_temperature_zero_is_one_greedy_condition_not_two() -> None:
    cfg = EvalConfig.from_params(conf(temperature=0, concurrency=["production"]))
    assert [c.name for c in cfg.conditions()] == ["greedy_think-on_cprod"]


def test_run_config_is_generates_own_config_per_condition() -> None:
    cfg = EvalConfig.from_params(conf(max_prompts=40, max_tokens=512, concurrency=[1, "production"]))
    group = cfg.group("dflash")
    c1, prod = [c for c in cfg.conditions() if c.sampling == "greedy"]
    rc = cfg.run_config(group, c1, "s3://bk1/heldout/prompts.jsonl.gz")
    assert rc.output_uri == "s3://bk1/evals/e1/dflash/greedy_think-on_c1"
    assert rc.servers == ("http://gpu0:30000", "gpu1_conn")
    assert rc.concurrency_per_server == 1 and rc.limit == 40
    assert (rc.sampling.temperature, rc.sampling.top_p, rc.sampling.max_tokens) == (0.0, 1.0, 512)
    assert rc.prompts_uri == "s3://bk1/heldout/prompts.jsonl.gz"
    assert cfg.run_config(group, prod, rc.prompts_uri).concurrency_per_server is None  # discovered, as generate


def test_a_drafter_may_name_its_card_the_baseline_may_not() -> None:
    card = "s3://bk1/drafters/d1/card.json"
    cfg = EvalConfig.from_params(conf(drafters=[{"name": "d1", "servers": ["http://gpu0:30000"], "card_uri": card}]))
    assert cfg.group("d1").card_uri == card and cfg.group("d1").to_dict()["card_uri"] == card
    assert "card_uri" not in cfg.group("no-spec").to_dict()
    with pytest.raises(ConfigError, match="the baseline serves no drafter, so it has no card_uri"):
        EvalConfig.from_params(conf(baseline={"name": "b", "servers": ["http://gpu3:30000"], "card_uri": card}))
    with pytest.raises(ConfigError, match="card_uri"):
        EvalConfig.from_params(conf(drafters=[{"name": "d1", "servers": ["http://gpu0:30000"], "card_uri": "/x"}]))
