"""Every script and bench answers `--help` at once and touches nothing (issue 41: eval_sim_report.py ran a 90 s
simulation and wrote a PNG named `--help`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted([*ROOT.glob("scripts/*.py"), *ROOT.glob("bench/*.py")])


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_help_runs_nothing(script: Path, tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, str(script), "--help"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "usage:" in res.stdout
    assert not list(tmp_path.iterdir()), f"{script.name} --help wrote {list(tmp_path.iterdir())}"
