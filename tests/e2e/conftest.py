"""e2e-only hooks: a failed test that used ``celery_stack`` gets its components' log tails."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dflash_pipeline.dev.stack import AirflowStack


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    stack = getattr(item, "funcargs", {}).get("celery_stack")
    if report.when == "call" and report.failed and isinstance(stack, AirflowStack):
        for log_file in sorted(stack.logs_dir.glob("*.log")):
            tail = "\n".join(log_file.read_text(errors="replace").splitlines()[-60:])
            report.sections.append((f"celery stack {log_file.stem} (last 60 lines)", tail))
