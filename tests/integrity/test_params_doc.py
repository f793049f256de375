"""docs/params.md, linked as "all params", names every dflash_generate param with its default (issue 41)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from dflash_pipeline.config import PARAM_SCHEMAS
from dflash_pipeline.config.run import REQUIRED_PARAMS

DOC = Path(__file__).resolve().parents[2] / "docs" / "params.md"


def _rows() -> dict[str, str]:
    """param -> its row's default cell, for each table row naming params in its first cell."""
    out: dict[str, str] = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("| `") else []
        if len(cells) >= 3:
            names = re.findall(r"`([a-z_0-9]+)`", cells[0])
            defaults = [d.strip() for d in cells[1].split("/")]
            for i, name in enumerate(names):
                out[name] = defaults[i] if len(defaults) == len(names) else cells[1]
    return out


def _shown(default: Any) -> str:
    if isinstance(default, bool) or default is None:
        return json.dumps(default)
    return str(default) if not isinstance(default, (list, dict)) else json.dumps(default)


def test_every_param_has_a_row() -> None:
    rows = _rows()
    missing = sorted(set(PARAM_SCHEMAS) - set(rows))
    assert not missing, f"docs/params.md lacks {missing}"
    unknown = sorted(set(rows) - set(PARAM_SCHEMAS))
    assert not unknown, f"docs/params.md names params the DAG does not have: {unknown}"


def test_each_rows_default_is_the_schemas() -> None:
    wrong = {}
    for name, cell in _rows().items():
        default = PARAM_SCHEMAS[name].get("default")
        if cell == "required":
            assert name in REQUIRED_PARAMS, f"{name} is not required"
            continue
        if cell == "see the form":
            continue
        if _shown(default) != cell and str(default) != cell:
            wrong[name] = (cell, default)
    assert not wrong, f"docs/params.md defaults differ from the schemas (doc, schema): {wrong}"
