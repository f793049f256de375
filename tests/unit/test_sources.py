"""prompts_uri forms (key, prefix, glob, weighted list): parsing, the glob's rules, the weights'
arithmetic, the param schema Airflow validates, and the pins of one plain key staying as they were."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest

from dflash_pipeline.config import ConfigError, RunConfig
from dflash_pipeline.config.run import PARAM_SCHEMAS
from dflash_pipeline.dataset.sources import (
    InputFile,
    SourceError,
    SourceSpec,
    copies,
    glob_regex,
    is_single_plain,
    parse_sources,
)
from dflash_pipeline.steps.plan import input_pins, reject_budget

BASE = {"output_uri": "s3://out-bucket/ds", "servers": ["http://h:1"]}


def test_parse_strings_and_items() -> None:
    assert parse_sources("s3://bk1/p.jsonl") == [SourceSpec("s3://bk1/p.jsonl")]
    got = parse_sources(["s3://bk1/dir/", {"uri": "s3://bk1/x/*.jsonl.gz", "weight": 0.25, "source": "math"}])
    assert got == [SourceSpec("s3://bk1/dir/"), SourceSpec("s3://bk1/x/*.jsonl.gz", 0.25, "math")]


@pytest.mark.parametrize(("value", "fragment"), [
    ([], "empty"),
    ([{"uri": "s3://bk1/p.jsonl", "weight": 0}], "'weight' must be a number in (0, 64]"),
    ([{"uri": "s3://bk1/p.jsonl", "weight": 65}], "'weight'"),
    ([{"uri": "s3://bk1/p.jsonl", "wieght": 2}], "unknown key(s) ['wieght']"),
    ([{"weight": 2}], "'uri' must be a string"),
    ([{"uri": "s3://bk1/p.jsonl", "source": ""}], "'source'"),
    ([3], "must be an s3:// URI"),
    ("/local/p.jsonl", "s3://bucket"),
    ("s3://b*k/p.jsonl", "bucket"),
    ("s3://bk1/../p.jsonl", "not allowed"),
    ("s3://bk1/", "must name a key"),
])
def test_bad_sources_are_refused(value: Any, fragment: str) -> None:
    with pytest.raises(SourceError) as info:
        parse_sources(value)
    assert fragment in str(info.value)


@pytest.mark.parametrize(("pattern", "key", "hit"), [
    ("in/*.jsonl", "in/a.jsonl", True),
    ("in/*.jsonl", "in/a.jsonl.gz", False),
    ("in/*.jsonl", "in/sub/a.jsonl", False),
    ("in/**.jsonl", "in/sub/a.jsonl", True),
    ("in/**/*.parquet", "in/x/y/z.parquet", True),
    ("in/part-?.jsonl", "in/part-3.jsonl", True),
    ("in/part-?.jsonl", "in/part-33.jsonl", False),
    ("in/part-[0-4].jsonl", "in/part-4.jsonl", True),
    ("in/part-[!0-4].jsonl", "in/part-4.jsonl", False),
    ("in/a+b.jsonl", "in/a+b.jsonl", True),
])
def test_glob_rules(pattern: str, key: str, hit: bool) -> None:
    assert (glob_regex(pattern).match(key) is not None) is hit


def test_weights_are_deterministic_and_keep_their_share() -> None:
    ids = [f"id-{i}" for i in range(20_000)]
    assert [copies(i, 1.0) for i in ids[:100]] == [1] * 100
    assert {copies(i, 3.0) for i in ids[:100]} == {3}
    half = sum(copies(i, 0.5) for i in ids)
    assert abs(half - 10_000) < 300  # binomial sd ~71
    tenth = [i for i in ids if copies(i, 0.1)]
    assert abs(len(tenth) - 2_000) < 200
    assert set(tenth) <= {i for i in ids if copies(i, 0.5)}, "a smaller weight keeps a subset of a larger one"
    extra = [copies(i, 2.25) for i in ids]
    assert set(extra) == {2, 3} and abs(extra.count(3) - 5_000) < 250
    assert [copies(i, 0.5) for i in ids[:500]] == [copies(i, 0.5) for i in ids[:500]]


def test_param_schema_is_what_airflow_validates() -> None:
    schema = {k: v for k, v in PARAM_SCHEMAS["prompts_uri"].items() if k not in ("description", "section")}
    jsonschema.Draft7Validator.check_schema(schema)
    for good in ("s3://bk1/p.jsonl", ["s3://bk1/a/", {"uri": "s3://bk1/b/*.jsonl", "weight": 2, "source": "x"}]):
        jsonschema.validate(good, schema)
    for bad in (3, [], ["/tmp/x"], [{"uri": "s3://bk1/p", "weight": 0}], [{"uri": "s3://bk1/p", "extra": 1}], "x"):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    share = {k: v for k, v in PARAM_SCHEMAS["max_reject_share"].items() if k not in ("description", "section")}
    jsonschema.validate(0.01, share)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(1.5, share)


def test_run_config_takes_lists_and_refuses_inputs_holding_the_root() -> None:
    cfg = RunConfig.from_params({**BASE, "prompts_uri": [{"uri": "s3://in-bucket/a/", "weight": 0.5}]})
    assert cfg.prompts_uri == [{"uri": "s3://in-bucket/a/", "weight": 0.5}] and cfg.max_reject_share == 0.01
    for inside in ("s3://out-bucket/runs/ds/p.jsonl", "s3://out-bucket/runs/", "s3://out-bucket/runs",
                   "s3://out-bucket/runs/ds", [{"uri": "s3://out-bucket/runs/ds/"}], "s3://out-bucket/runs/**.jsonl"):
        with pytest.raises(ConfigError, match="inside output_uri"):
            RunConfig.from_params({**BASE, "output_uri": "s3://out-bucket/runs/ds", "prompts_uri": inside})
    RunConfig.from_params({**BASE, "output_uri": "s3://out-bucket/runs/ds", "prompts_uri": "s3://out-bucket/runs/*.jsonl"})
    with pytest.raises(ConfigError, match="weight"):
        RunConfig.from_params({**BASE, "prompts_uri": [{"uri": "s3://in-bucket/a/", "weight": -1}]})


def test_one_plain_key_keeps_the_old_pin_form() -> None:
    f = InputFile("in-bucket", "p.jsonl", '"e1"', 10)
    cfg = RunConfig.from_params({**BASE, "prompts_uri": "s3://in-bucket/p.jsonl"})
    assert is_single_plain(cfg.prompts_uri, [f])
    assert input_pins(cfg, None, None, [f]) == {"uri": "s3://in-bucket/p.jsonl", "etag": '"e1"', "size": 10, "limit": None}
    prefix = RunConfig.from_params({**BASE, "prompts_uri": "s3://in-bucket/dir/"})
    g = InputFile("in-bucket", "dir/a.jsonl", '"e2"', 5)
    assert input_pins(prefix, None, None, [g])["files"] == [
        {"uri": "s3://in-bucket/dir/a.jsonl", "etag": '"e2"', "size": 5, "weight": 1.0, "source": None}]


def test_reject_budget() -> None:
    assert reject_budget(0, 0.01, 902_087) == 9_020
    assert reject_budget(50, 0.01, 1_000) == 50
    assert reject_budget(0, 0.0, 10**6) == 0


def test_the_dataset_card_names_every_source() -> None:
    from dflash_pipeline.steps.tokenize.card import _sources

    assert _sources("s3://bk1/p.jsonl") == "`s3://bk1/p.jsonl`"
    assert _sources(["s3://bk1/a/", {"uri": "s3://bk1/m/*.parquet", "weight": 0.5, "source": "math"}]) == (
        "`s3://bk1/a/`, `s3://bk1/m/*.parquet` (weight 0.5, source math)")


def test_airflows_param_takes_a_string_or_a_weighted_list() -> None:
    """The trigger (UI form, REST, CLI) validates with Airflow's own Param before a run exists."""
    from airflow.sdk import Param
    from airflow.sdk.definitions.param import ParamValidationError

    param = Param(**PARAM_SCHEMAS["prompts_uri"])
    listed = ["s3://bk1/a/", {"uri": "s3://bk1/b/*.jsonl", "weight": 0.5, "source": "math"}]
    assert param.resolve(listed) == listed
    assert param.resolve("s3://bk1/a.jsonl") == "s3://bk1/a.jsonl"
    with pytest.raises(ParamValidationError):
        param.resolve([{"uri": "s3://bk1/b", "weight": 0}])
