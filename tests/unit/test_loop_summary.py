"""loop_experiment.summarize: the reference drafter's paired differences keep their sign whichever side of the
report's pair it is on (the report puts the better drafter first as `a`)."""

from __future__ import annotations

from dflash_pipeline.dev.engine.loop_experiment import LoopSettings, summarize


def _acc(value: float) -> dict[str, object]:
    return {"acceptance": {"acceptance_length": value, "ci_low": value - 0.1, "ci_high": value + 0.1,
                           "rows_with_stats": 10}}


def test_reference_minus_other_whichever_side_it_is() -> None:
    report = {
        "conditions": [{"name": "greedy_think-on_c4"}],
        "groups": {"regenerated": {"greedy_think-on_c4": _acc(1.5)}, "original": {"greedy_think-on_c4": _acc(1.8)},
                   "untrained": {"greedy_think-on_c4": _acc(1.0)}},
        "paired": {"greedy_think-on_c4": [
            {"a": "original", "b": "regenerated", "difference": 0.3, "ci_low": 0.1, "ci_high": 0.5, "prompts": 10},
            {"a": "regenerated", "b": "untrained", "difference": 0.5, "ci_low": -0.1, "ci_high": 0.9, "prompts": 10},
            {"a": "original", "b": "untrained", "difference": 0.8, "ci_low": 0.6, "ci_high": 1.0, "prompts": 10}]},
        "rankings": {"greedy_think-on_c4": [{"drafter": "original"}, {"drafter": "regenerated"},
                                            {"drafter": "untrained"}]},
        "lineage": {"regenerated": {"tokenization": "default", "steps": 100}},
    }
    out = summarize(report)["conditions"]["greedy_think-on_c4"]
    assert out["regenerated_minus"]["original"] == {"difference": -0.3, "ci": [-0.5, -0.1], "prompts": 10,
                                                    "excludes_0": True}
    assert out["regenerated_minus"]["untrained"]["ci"] == [-0.1, 0.9]
    assert out["regenerated_minus"]["untrained"]["excludes_0"] is False
    assert out["ranking"] == ["original", "regenerated", "untrained"]
    assert out["acceptance"]["original"]["acceptance_length"] == 1.8


def test_settings_refuse_an_unknown_defect() -> None:
    import pytest

    with pytest.raises(ValueError, match="unknown defect"):
        LoopSettings(sensitivity=("no_such_defect",))
