"""A newcomer reads only README.md and runs what it says: a finished generate run and a tokenized dataset.

The commands come from the README's newcomer block (between `<!-- newcomer:begin -->` and
`<!-- newcomer:end -->`) and run as a shell would run them, from the repository root. Two things are
added through the environment, not the command: `DEMO_ARGS` (the Makefile's own knob, documented in the
README) keeps the stack up after the run so this test can look into its S3, and points the demo at a
fresh home of its own (a clean state, and no clash with a demo someone runs by hand). Then every key the
README's "What lands where" block promises (except the lines marked "(only ...)") must be in the demo's
bucket under its output root: the README's layout is checked against a real run, not only the code.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
from dflash_pipeline.dev.stack.procs import describe, is_live

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
SLOT = "[^/]+"
NEWCOMER_PROMPTS = 120

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def readme_commands() -> list[str]:
    text = README.read_text()
    block = re.search(r"<!-- newcomer:begin -->\s*```bash\n(.*?)```\s*<!-- newcomer:end -->", text, re.S)
    assert block, "README.md has no newcomer block"
    return [line.split("#", 1)[0].strip() for line in block.group(1).splitlines()
            if line.split("#", 1)[0].strip()]


def readme_layout() -> list[str]:
    """The dataset keys the README promises for every run (lines marked "(only ...)" are conditional)."""
    text = README.read_text()
    block = re.search(r"<!-- layout:begin -->\s*```\w*\n(.*?)```\s*<!-- layout:end -->", text, re.S)
    assert block, "README.md has no layout block"
    return [line.split()[0] for line in block.group(1).splitlines() if line.strip() and "(only" not in line]


def key_pattern(path: str) -> re.Pattern[str]:
    pattern = re.escape(path)
    pattern = re.sub(r"\\<[^>]*\\>|<[^>]*>", SLOT, pattern)
    pattern = pattern.replace("NNNNNN", r"\d{6}")
    return re.compile(pattern + ("" if path.endswith("/") else "$"))


def processes_naming(home: Path) -> list[int]:
    """Live processes whose command line or environment names `home`: what the demo started there (its
    moto, Airflow and simulated servers inherit DEMO_ARGS, which names it)."""
    needle = str(home).encode()
    found = []
    for proc_dir in Path("/proc").iterdir():
        if not proc_dir.name.isdigit() or not is_live(int(proc_dir.name)):
            continue
        try:
            named = needle in (proc_dir / "cmdline").read_bytes() or needle in (proc_dir / "environ").read_bytes()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if named:
            found.append(int(proc_dir.name))
    return found


def test_key_pattern_matches_real_keys() -> None:
    assert key_pattern("runs/<run_id>/progress/<worker>.json").match("runs/manual__2026_x/progress/generate-0.json")
    assert key_pattern("completions/part-NNNNNN.parquet").match("completions/part-000012.parquet")
    assert not key_pattern("tokenized/part-NNNNNN.parquet").match("tokenized/parquet/part-000012.parquet")


def test_a_newcomer_reaches_a_finished_run_and_a_tokenized_dataset(tmp_path: Path) -> None:
    commands = readme_commands()
    assert commands and commands[-1].startswith("make demo"), commands
    # A smaller prompt set than the demo's own keeps this tier's cost down (CI must stay under ~45 min);
    # the command run is still the README's, and the path through Airflow, S3 and the fleet the same.
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join((REPO / "data" / "sample_prompts.jsonl").read_text().splitlines(True)[:NEWCOMER_PROMPTS]))
    home = tmp_path / "demo"
    env = {**os.environ, "DEMO_ARGS": f"--keep --home {home} --prompts {prompts}"}
    for command in commands[:-1]:
        subprocess.run(["bash", "-c", command], cwd=REPO, env=env, check=True, timeout=900)

    t0 = time.monotonic()
    proc = subprocess.Popen(["bash", "-c", commands[-1]], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    kept = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if "The stack keeps running" in line:
                kept.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        while not kept.is_set() and proc.poll() is None and time.monotonic() - t0 < 1500:
            time.sleep(1)
        elapsed = time.monotonic() - t0
        out = "\n".join(lines)
        assert kept.is_set(), f"the demo did not finish and keep its stack up ({elapsed:.0f} s):\n{out[-6000:]}"
        print(f"README's `{commands[-1]}` reached its end in {elapsed:.0f} s")
        assert re.search(r"Run finished: SUCCESS", out), out[-6000:]
        tokenized = re.search(r"Tokenized \(.*\): complete, (\d+) parts, ([\d,]+) training rows", out)
        assert tokenized and int(tokenized.group(2).replace(",", "")) > 0, out[-6000:]

        endpoint = re.search(r"S3:\s+endpoint (http://\S+)", out).group(1)
        output = re.search(r"output\s+s3://([^/\s]+)/(\S+?)/?\s", out)
        bucket, root = output.group(1), output.group(2).rstrip("/")
        import boto3

        s3 = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing",
                          aws_secret_access_key="testing", region_name="us-east-1")
        keys = [obj["Key"][len(root) + 1:] for page in s3.get_paginator("list_objects_v2").paginate(
            Bucket=bucket, Prefix=root + "/") for obj in page.get("Contents", [])]
        missing = [path for path in readme_layout() if not any(key_pattern(path).match(k) for k in keys)]
        assert not missing, f"the README promises {missing}; the demo's dataset has {sorted(keys)[:80]}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # the demo stops its stack on SIGTERM, as on Ctrl-C
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
        reader.join(timeout=10)
        # SIGTERM to `make demo`'s group reaches the demo twice (make forwards it): the second one once
        # abandoned the stack's shutdown and left Airflow, moto and the simulated servers running.
        pids = processes_naming(home)
        leftovers = [describe(pid) for pid in pids]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert not leftovers, f"the demo exited and left its stack running: {leftovers}"
