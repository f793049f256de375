"""dflash_tokenize's params and keys: bounds refused with the figure, keys a function of root and index."""

from __future__ import annotations

import pytest

from dflash_pipeline.config import TOKENIZE_PARAM_SCHEMAS, ConfigError, TokenizeConfig
from dflash_pipeline.dataset.layout import DatasetLayout, chunk_of_key
from dflash_pipeline.steps.tokenize import TokenizeSettings


def test_defaults_and_bounds() -> None:
    cfg = TokenizeConfig.from_params({})
    assert (cfg.max_length, cfg.train_turns, cfg.loss_on_reasoning, cfg.drop_truncated, cfg.workers) == (4096, "all", True, False, 4)
    for conf, msg in [({"max_length": 8}, "minimum of 16"), ({"workers": 0}, "minimum of 1"),
                      ({"train_turns": "first"}, "not one of"), ({"output_uri": "s3://bkt/../x"}, "not allowed"),
                      ({"tokenizer": "s3://B_/x"}, "not a valid S3 bucket"), ({"max_len": 5}, "unknown conf key"),
                      ({"loss_on_reasoning": "yes"}, "not of type boolean")]:
        with pytest.raises(ConfigError, match=msg):
            TokenizeConfig.from_params(conf)
    for name, schema in TOKENIZE_PARAM_SCHEMAS.items():
        assert schema["description"] and schema["type"] and "default" in schema, name
    with pytest.raises(ConfigError, match="train_turns"):
        TokenizeSettings(tokenizer="t", train_turns="some")


def test_output_keys() -> None:
    from dflash_pipeline.steps.tokenize.profiles import profile_keys

    lay = DatasetLayout("b", "ds/x")
    assert lay.tokenized_stats_key(7) == "ds/x/tokenized/stats/part-000007.json"  # the commit point
    assert chunk_of_key(lay.tokenized_stats_key(7), lay.tokenized_stats_prefix) == 7
    assert chunk_of_key(lay.tokenized_settings_key, lay.tokenized_stats_prefix) is None
    assert chunk_of_key(lay.tokenized_report_key, lay.tokenized_stats_prefix) is None
    assert lay.key(profile_keys("parquet", 7)["rows"]) == "ds/x/tokenized/parquet/part-000007.parquet"
    assert lay.key(profile_keys("specforge", 7)["conversations"]) == "ds/x/tokenized/specforge-conversations/part-000007.jsonl"
    assert lay.dataset_card_key == "ds/x/README.md"


def test_named_tokenization_keys_and_names() -> None:
    from dflash_pipeline.steps.tokenize.profiles import profile_keys

    lay = DatasetLayout("b", "ds/x")
    assert lay.tokenized_as("default") == lay and lay.tokenized_as(None).tokenized_prefix == "ds/x/tokenized/"
    named = lay.tokenized_as("long-ctx")
    assert named.tokenized_prefix == "ds/x/tokenized/long-ctx/" and named.tokenizations_prefix == "ds/x/tokenized/"
    assert named.tokenized_stats_key(7) == "ds/x/tokenized/long-ctx/stats/part-000007.json"
    assert named.tokenized_settings_key == "ds/x/tokenized/long-ctx/settings.json"
    assert named.key(profile_keys("speculators", 7)["tokens"]) == "ds/x/tokenized/long-ctx/speculators/part-000007.jsonl"
    assert named.key("manifest.json") == lay.manifest_key and named.dataset_card_key == lay.dataset_card_key
    assert TokenizeConfig.from_params({"tokenization": "long-ctx"}).tokenization == "long-ctx"
    for bad, msg in (("stats", "name of a folder"), ("speculators", "name of a folder"), ("Big Name", "lower-case"),
                     ("../x", "lower-case")):
        with pytest.raises(ConfigError, match=msg):
            TokenizeConfig.from_params({"tokenization": bad})
