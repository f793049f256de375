"""The trigger form's layout (config.run.form_layout): essentials first and open, the rest "Advanced: ...".

Airflow 3.3's form draws one accordion item per `section` in first-appearance order and opens only
"Run Parameters" at load; the DAGs build their Params through tasks.params_from with each DAG's
essentials, so these tests read the DAGs' own Params, not a copy of the rule."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

from dflash_pipeline.config import (
    ADVANCED_PREFIX,
    ESSENTIAL_PARAMS,
    ESSENTIALS_SECTION,
    EVAL_ESSENTIAL_PARAMS,
    EVAL_PARAM_SCHEMAS,
    PARAM_SCHEMAS,
    REQUIRED_PARAMS,
    TOKENIZE_ESSENTIAL_PARAMS,
    TOKENIZE_PARAM_SCHEMAS,
    TRAIN_ESSENTIAL_PARAMS,
    TRAIN_PARAM_SCHEMAS,
    form_layout,
)
from dflash_pipeline.config.evaluate import REQUIRED_EVAL_PARAMS

DAGS = Path(__file__).resolve().parents[2] / "dags"
CASES = [
    ("dflash_generate", PARAM_SCHEMAS, ESSENTIAL_PARAMS, REQUIRED_PARAMS),
    ("dflash_tokenize", TOKENIZE_PARAM_SCHEMAS, TOKENIZE_ESSENTIAL_PARAMS, ()),
    ("dflash_eval", EVAL_PARAM_SCHEMAS, EVAL_ESSENTIAL_PARAMS, REQUIRED_EVAL_PARAMS),
    ("dflash_train", TRAIN_PARAM_SCHEMAS, TRAIN_ESSENTIAL_PARAMS, ()),
]


def _dag_params(dag_id: str) -> dict[str, Any]:
    """The PARAMS dict a DAG file builds (loaded as a module; nothing runs at parse time)."""
    spec = importlib.util.spec_from_file_location(f"_form_{dag_id}", DAGS / f"{dag_id}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules.pop(spec.name, None)
    return module.PARAMS


def test_layout_puts_essentials_first_and_the_rest_under_advanced() -> None:
    schemas = {
        "knob": {"type": "integer", "default": 1, "section": "Run control"},
        "b": {"type": "string", "section": "Data"},
        "loose": {"type": "integer", "default": 2},
        "a": {"type": "string", "section": "Data"},
        "new_one": {"type": "number", "default": 0.5, "section": "Quality"},  # a section nobody listed
    }
    out = form_layout(schemas, ("a", "b", "missing"))
    assert list(out) == ["a", "b", "knob", "loose", "new_one"]
    assert [out[n]["section"] for n in out] == [
        ESSENTIALS_SECTION, ESSENTIALS_SECTION, "Advanced: Run control", "Advanced", "Advanced: Quality"]
    assert schemas["a"]["section"] == "Data"  # the schemas given are not changed
    assert form_layout(out, ("a", "b")) == out  # idempotent


@pytest.mark.parametrize(("dag_id", "schemas", "essentials", "required"), CASES, ids=[c[0] for c in CASES])
def test_each_dag_form_shows_its_essentials_first(dag_id: str, schemas: dict[str, Any],
                                                   essentials: tuple[str, ...], required: tuple[str, ...]) -> None:
    assert set(essentials) <= set(schemas), f"essentials the DAG lacks: {set(essentials) - set(schemas)}"
    assert set(required) <= set(essentials), "a required param must be in the open section"
    params = _dag_params(dag_id)
    assert list(params) == list(essentials) + [n for n in schemas if n not in essentials]
    sections = [params[n].schema["section"] for n in params]
    assert sections[: len(essentials)] == [ESSENTIALS_SECTION] * len(essentials)
    for name in list(params)[len(essentials):]:
        schema = params[name].schema
        assert schema["section"].startswith(ADVANCED_PREFIX) or schema["section"] == "Advanced", name
        # Every advanced param has a safe default: a user who never opens the section gets a run.
        assert "default" in schemas[name], f"{dag_id}: advanced param {name} has no default"
    where = "dataset_uri" if dag_id == "dflash_train" else "output_uri"  # the data the run works on
    assert params[where].schema["section"] == ESSENTIALS_SECTION


def test_generate_form_hides_the_protocol_internals() -> None:
    params = _dag_params("dflash_generate")
    for name in ("claim_lease_s", "server_handoff_after_s", "server_lost_after_s", "save_every", "max_attempts"):
        assert params[name].schema["section"].startswith(ADVANCED_PREFIX), name
