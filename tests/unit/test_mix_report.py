"""The mix report: shares and buckets per dimension, the target side by side, bad targets refused."""

from __future__ import annotations

import struct
from typing import Any

import pyarrow as pa
import pytest

from dflash_pipeline.config import ConfigError, RunConfig, TokenizeConfig
from dflash_pipeline.config.mix import FIXED_LABELS, check_target_mix
from dflash_pipeline.dataset.records import PART_SCHEMA
from dflash_pipeline.steps.validate import mix as mixreport

BASE = {"prompts_uri": "s3://bucket-a/p.jsonl", "output_uri": "s3://bucket-a/out", "servers": ["http://x:1"]}


def _row(i: int, **kw: Any) -> dict[str, Any]:
    row = {"id": f"r{i}", "messages": [{"role": "user", "content": "q"}], "prompt_tokens": 10, "completion_tokens": 300,
           "error_class": None, "source": "s1", "domain": "math", "thinking": True}
    row.update(kw)
    return row


def _part(rows: list[dict[str, Any]], columns: tuple[str, ...] | None = None) -> pa.Table:
    table = pa.Table.from_pylist([{c: r.get(c) for c in PART_SCHEMA.names} for r in rows], schema=PART_SCHEMA)
    return table.select(list(columns)) if columns else table


def _by(mix: dict[str, Any], dim: str, key: str = "share") -> dict[str, Any]:
    return {r["label"]: r[key] for r in mix["dimensions"][dim]["rows"]}


def test_shares_and_buckets_per_dimension() -> None:
    rows = [
        _row(0, domain="math", thinking=True, prompt_tokens=5, completion_tokens=100),
        _row(1, domain="math", thinking=False, prompt_tokens=127, completion_tokens=255),
        _row(2, domain="code", thinking=False, prompt_tokens=128, completion_tokens=256, source=None),
        _row(3, domain="chat", thinking=None, prompt_tokens=9000, completion_tokens=20000,
             messages=[{"role": "system", "content": "s"}, {"role": "user", "content": "a"},
                       {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]),
        _row(4, domain="", error_class="ContextLengthExceeded", prompt_tokens=None, completion_tokens=None),
    ]
    tally = mixreport.MixTally()
    tally.add(_part(rows), default_thinking=True)
    mix = mixreport.mix_report(tally.to_counts())
    assert mix["completions"] == 4  # the error row trains nothing: left out
    assert _by(mix, "domain", "count") == {"math": 2, "chat": 1, "code": 1}
    assert _by(mix, "domain") == {"math": 0.5, "chat": 0.25, "code": 0.25}
    assert _by(mix, "source", "count") == {"s1": 3, "unknown": 1}
    assert _by(mix, "thinking", "count") == {"true": 2, "false": 2}  # null: the run's pinned mode
    assert _by(mix, "prompt_length", "count") == {"0-127": 2, "128-511": 1, "8192+": 1}
    assert _by(mix, "completion_length", "count") == {"0-255": 2, "256-1023": 1, "16384+": 1}
    assert _by(mix, "turns", "count") == {"1": 3, "2": 1}
    assert _by(mix, "language", "count") == {"unknown": 4}  # no quality signals on these rows
    assert "max_abs_gap" not in mix["dimensions"]["domain"]


def test_a_part_without_the_label_columns_counts_unknown() -> None:
    tally = mixreport.MixTally()
    tally.add(_part([_row(0), _row(1)], columns=("id", "error_class", "completion_tokens")), default_thinking=None)
    mix = mixreport.mix_report(tally.to_counts())
    for dim in ("source", "domain", "thinking", "language", "prompt_length", "turns"):
        assert _by(mix, dim, "count") == {"unknown": 2}, dim
    assert _by(mix, "completion_length", "count") == {"256-1023": 2}


def test_language_column_is_counted_when_the_rows_carry_it() -> None:
    table = _part([_row(0), _row(1), _row(2)]).append_column("language", pa.array(["en", "de", None]))
    tally = mixreport.MixTally()
    tally.add(table)
    assert _by(mixreport.mix_report(tally.to_counts()), "language", "count") == {"de": 1, "en": 1, "unknown": 1}
    given = mixreport.MixTally()  # computed by the quality signals, handed over per row of the part
    given.add(_part([_row(0), _row(1, error_class="X"), _row(2)]), language=["fr", "xx", None])
    assert _by(mixreport.mix_report(given.to_counts()), "language", "count") == {"fr": 1, "unknown": 1}


def test_counts_of_parts_add_up() -> None:
    a, b, both = mixreport.MixTally(), mixreport.MixTally(), mixreport.MixTally()
    pa_rows = [_row(i, domain="math") for i in range(3)]
    pb_rows = [_row(i, domain="code", thinking=False) for i in range(2)]
    a.add(_part(pa_rows))
    b.add(_part(pb_rows))
    both.add(_part(pa_rows))
    both.add(_part(pb_rows))
    merged = mixreport.MixTally()
    merged.add_counts(a.to_counts())
    merged.add_counts(b.to_counts())
    assert merged.to_counts() == both.to_counts()


def test_target_side_by_side_with_the_gap() -> None:
    tally = mixreport.MixTally()
    tally.add(_part([_row(i, domain="math" if i < 6 else "code", thinking=i < 8) for i in range(10)]))
    target = check_target_mix({"domain": {"math": 0.3, "code": 0.3, "chat": 0.4}, "thinking": {"true": 0.5, "false": 0.5}})
    mix = mixreport.mix_report(tally.to_counts(), target)
    dom = {r["label"]: r for r in mix["dimensions"]["domain"]["rows"]}
    assert dom["math"] == {"label": "math", "count": 6, "share": 0.6, "target": 0.3, "gap": 0.3}
    assert dom["code"]["gap"] == pytest.approx(0.1)
    assert dom["chat"] == {"label": "chat", "count": 0, "share": 0.0, "target": 0.4, "gap": -0.4}  # asked, absent
    assert mix["dimensions"]["domain"]["max_abs_gap"] == 0.4
    assert _by(mix, "thinking", "gap") == {"true": pytest.approx(0.3), "false": pytest.approx(-0.3)}
    md = mixreport.markdown(mix, "mix (before filters)")
    assert "### domain (largest gap 40.0 pp)" in md
    assert "| label | completions | share | target | gap |" in md
    assert "| math | 6 | 60.0% | 30.0% | +30.0 pp |" in md
    assert "| chat | 0 | 0.0% | 40.0% | -40.0 pp |" in md
    assert "### source\n" in md and "| s1 | 10 | 100.0% |" in md  # no target there: no target column


def test_after_filters_next_to_before() -> None:
    before, after = mixreport.MixTally(), mixreport.MixTally()
    rows = [_row(i, thinking=i % 2 == 0) for i in range(8)]
    before.add(_part(rows))
    after.add(_part([r for r in rows if r["thinking"] or r["id"] == "r1"]))
    mix = mixreport.mix_report(after.to_counts(), {"thinking": {"true": 0.5, "false": 0.5}}, before=before.to_counts(),
                               basis="completions kept by tokenize")
    think = {r["label"]: r for r in mix["dimensions"]["thinking"]["rows"]}
    assert think["false"] == {"label": "false", "count": 1, "share": 0.2, "before_count": 4, "before_share": 0.5,
                              "target": 0.5, "gap": -0.3}
    md = mixreport.markdown(mix, "mix after filters")
    assert "| label | before | completions | share before | share | target | gap |" in md
    assert "| false | 4 | 1 | 50.0% | 20.0% | 50.0% | -30.0 pp |" in md


def test_long_free_text_tails_are_summed_but_target_labels_kept() -> None:
    tally = mixreport.MixTally()
    tally.add(_part([_row(i, source=f"src{i:03d}") for i in range(mixreport.MAX_LABELS + 10)]))
    mix = mixreport.mix_report(tally.to_counts(), {"source": {"src059": 0.5, "elsewhere": 0.5}})
    labels = _by(mix, "source", "count")
    assert labels[mixreport.OTHER] == 9 and labels["src059"] == 1 and labels["elsewhere"] == 0
    assert sum(labels.values()) == mixreport.MAX_LABELS + 10


def test_plot_is_a_png() -> None:
    tally = mixreport.MixTally()
    tally.add(_part([_row(i, domain=["math", "code", "chat"][i % 3]) for i in range(9)]))
    png = mixreport.plot(mixreport.mix_report(tally.to_counts(), {"domain": {"math": 0.5, "code": 0.5}}), "mix")
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", png[16:24])
    assert 300 < width < 2000 and 200 < height < 1000


@pytest.mark.parametrize("bad, words", [
    ({"domian": {"math": 1.0}}, "unknown dimension 'domian'"),
    ({"domain": {"math": 0.5, "code": 0.3}}, "target_mix.domain: shares sum to 0.8, not 1"),
    ({"domain": {"math": 1.5, "code": -0.5}}, "share 1.5 is not within 0..1"),
    ({"thinking": {"yes": 1.0}}, "target_mix.thinking: unknown label 'yes'; known: true, false"),
    ({"turns": {"1": 0.5, "2-3": 0.5}}, "unknown label '2-3'"),
    ({"domain": {}}, "must be a non-empty object"),
    ({"domain": {"math": "0.5", "code": 0.5}}, "share must be a number"),
    ({"domain": {"math": True}}, "share must be a number"),
    ([["domain", "math"]], "is not of type null or object"),
])
def test_bad_targets_are_refused_with_the_reason(bad: Any, words: str) -> None:
    with pytest.raises(ConfigError, match="target_mix") as err:
        RunConfig.from_params({**BASE, "target_mix": bad})
    assert words in str(err.value)
    with pytest.raises(ConfigError) as err2:
        TokenizeConfig.from_params({"target_mix": bad})
    assert words in str(err2.value)


def test_good_targets_pass_within_the_tolerance() -> None:
    cfg = RunConfig.from_params({**BASE, "target_mix": {"thinking": {"true": 0.333, "false": 0.666},
                                                        "prompt_length": {"0-127": 1}}})
    assert cfg.target_mix == {"thinking": {"true": 0.333, "false": 0.666}, "prompt_length": {"0-127": 1.0}}
    assert RunConfig.from_params(BASE).target_mix is None
    assert TokenizeConfig.from_params({"target_mix": None}).target_mix is None
    assert set(FIXED_LABELS["completion_length"]) == {"0-255", "256-1023", "1024-4095", "4096-16383", "16384+"}


def test_param_schema_holds_the_bounds() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    from dflash_pipeline.config import PARAM_SCHEMAS, TOKENIZE_PARAM_SCHEMAS

    for schemas in (PARAM_SCHEMAS, TOKENIZE_PARAM_SCHEMAS):
        schema = {k: v for k, v in schemas["target_mix"].items() if k not in ("section", "description")}
        jsonschema.validate({"domain": {"math": 0.5, "code": 0.5}}, schema)
        jsonschema.validate(None, schema)
        for bad in ({"nope": {"a": 1}}, {"domain": {"a": 2}}, {"domain": {}}, {"domain": {"a": "x"}}):
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate(bad, schema)


def test_kept_counts_count_the_completions_with_a_training_row_and_their_language() -> None:
    part = _part([_row(0, domain="math"), _row(1, domain="code"), _row(2, domain="chat", error_class="X")])
    training = pa.table({"id": ["r0", "r0", "r1"], "sample": [0, 0, 1], "language": ["en", "en", "de"]})
    counts = mixreport.kept_counts(part, training, default_thinking=True)
    mix = mixreport.mix_report(counts)
    assert mix["completions"] == 1  # r1's training row is of sample 1, not this part's sample-0 row
    assert _by(mix, "domain", "count") == {"math": 1} and _by(mix, "language", "count") == {"en": 1}
    none = mixreport.kept_counts(part, training.slice(0, 0), default_thinking=True)
    assert none["completions"] == 0


def test_languages_from_the_quality_tally_fill_an_unlabelled_language_dimension() -> None:
    tally = mixreport.MixTally()
    tally.add(_part([_row(i) for i in range(5)]))
    tally.use_languages({"en": 3, "undetermined": 1})  # one completion the quality tally did not count
    assert _by(mixreport.mix_report(tally.to_counts()), "language", "count") == {"en": 3, "undetermined": 1,
                                                                                 "unknown": 1}
    labelled = mixreport.MixTally()  # a part's own language column wins
    labelled.add(_part([_row(0), _row(1)]).append_column("language", pa.array(["de", "de"])))
    labelled.use_languages({"en": 2})
    assert _by(mixreport.mix_report(labelled.to_counts()), "language", "count") == {"de": 2}
