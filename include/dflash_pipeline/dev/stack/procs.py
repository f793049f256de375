"""Processes of the dev stack: spawning in their own process group, logs, stopping whole groups.

Every process is started with ``start_new_session=True`` and its output in a log file, and stopped by
signalling the whole group (SIGINT, then SIGTERM, then SIGKILL), so nothing outlives the stack.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
#: ``straggler(pid, members of its process group) -> signal to send it once, or None``.
Straggler = Callable[[int, Sequence[int]], "signal.Signals | None"]


class StackError(RuntimeError):
    """A process of the stack failed to start, died, or did not become ready in time."""


# --------------------------------------------------------------------------------------------------
# small helpers


def free_port(host: str = LOOPBACK) -> int:
    """Return a TCP port that is free on ``host`` right now (bind to port 0, read it, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def venv_bin(name: str) -> str:
    """Path of executable ``name`` next to the running interpreter (the venv's bin), else on PATH."""
    candidate = Path(sys.executable).parent / name
    if candidate.exists():
        return str(candidate)
    found = shutil.which(name)
    if found is None:
        raise StackError(f"executable {name!r} not found next to {sys.executable} nor on PATH")
    return found


def tail(path: Path | None, lines: int = 40) -> str:
    """Last ``lines`` lines of a log file, for error messages."""
    if path is None or not path.exists():
        return "(no log)"
    text = path.read_text(errors="replace").splitlines()
    return "\n".join(text[-lines:])


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) pids of process group ``pgid``; Linux /proc, falls back to killpg(0)."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return []
        return [pgid]
    members: list[int] = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid pgrp ...; comm may contain spaces, so split after the last ')'.
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) >= 3 and fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


def is_live(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2 :].split()[0] != "Z"


def describe(pid: int) -> str:
    return f"{pid} {cmdline(pid)[:80] or '?'}"


def signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def airflow_straggler(pid: int, members: Sequence[int]) -> signal.Signals | None:
    """What to send a process still up 3 s into Airflow's shutdown (known 3.3.2 hangs), if anything.

    * an idle LocalExecutor worker (``airflow worker -- LocalExecutor: <idle>``): the scheduler
      sometimes waits forever on one that missed its shutdown message. It runs nothing: SIGKILL.
    * a triggerer whose trigger-runner child has already exited: it still waits a fixed 10 s for
      it; a second signal makes it exit at once.
    """
    cmd = cmdline(pid)
    if "LocalExecutor" in cmd and cmd.endswith("<idle>"):
        return signal.SIGKILL
    if cmd.endswith("airflow triggerer") and list(members) == [pid]:
        return signal.SIGINT
    return None


def wait_groups_empty(
    pgids: Sequence[int],
    timeout: float,
    *,
    straggler: Straggler | None = None,
    straggler_after_s: float = 3.0,
) -> bool:
    started = time.monotonic()
    nudged: set[tuple[int, signal.Signals]] = set()
    while True:
        groups = {pgid: group_members(pgid) for pgid in pgids}
        if not any(groups.values()):
            return True
        elapsed = time.monotonic() - started
        if elapsed >= timeout:
            return False
        if straggler is not None and elapsed >= straggler_after_s:
            for members in groups.values():
                for pid in members:
                    sig = straggler(pid, members)
                    if sig is not None and (pid, sig) not in nudged:
                        nudged.add((pid, sig))
                        log.debug("straggler %s: sending %s", describe(pid), sig.name)
                        with contextlib.suppress(ProcessLookupError, PermissionError):
                            os.kill(pid, sig)
        time.sleep(0.2)


def stop_process_groups(
    procs: Sequence[subprocess.Popen[bytes]],
    *,
    name: str,
    first_signal: signal.Signals = signal.SIGINT,
    grace_s: float = 15.0,
    term_grace_s: float = 5.0,
    straggler: Straggler | None = None,
) -> None:
    """Stop processes started with ``start_new_session=True`` and everything in their groups.

    Sends ``first_signal`` to every group, waits up to ``grace_s`` for the groups to empty, then
    SIGTERM (``term_grace_s``), then SIGKILL. Reaps the direct children. During the first wait,
    from 3 s on, ``straggler(pid, members_of_its_group)`` may name a signal to send that process
    once (see :func:`airflow_straggler`).
    """
    pgids = [p.pid for p in procs]
    if not pgids:
        return
    started = time.monotonic()
    steps: list[tuple[signal.Signals, float]] = [(first_signal, grace_s)]
    if first_signal != signal.SIGTERM:
        steps.append((signal.SIGTERM, term_grace_s))
    steps.append((signal.SIGKILL, 5.0))
    for sig, wait_s in steps:
        if not any(group_members(pgid) for pgid in pgids):
            break
        log.debug("%s: sending %s to process groups %s", name, sig.name, pgids)
        for pgid in pgids:
            signal_group(pgid, sig)
        if wait_groups_empty(pgids, wait_s, straggler=straggler if sig == first_signal else None):
            break
        log.warning(
            "%s: still running %.0f s after %s: %s", name, wait_s, sig.name,
            "; ".join(describe(pid) for pgid in pgids for pid in group_members(pgid)),
        )  # fmt: skip
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
    log.info("%s stopped in %.1f s", name, time.monotonic() - started)


def spawn(
    argv: Sequence[str], *, env: Mapping[str, str] | None, log_path: Path | None, cwd: Path | None = None
) -> subprocess.Popen[bytes]:
    """Start ``argv`` in a new session (own process group) with stdout+stderr appended to log_path."""
    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        out: Any = open(log_path, "ab")  # noqa: SIM115 - handed to the child, closed below
    else:
        out = subprocess.DEVNULL
    try:
        return subprocess.Popen(
            list(argv),
            env=dict(env) if env is not None else None,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    finally:
        if log_path is not None:
            out.close()


def process_memory(pids: Sequence[int]) -> dict[str, int]:
    """Sum RSS and PSS (bytes) of ``pids`` from /proc/PID/smaps_rollup (PSS avoids double counting)."""
    total = {"rss_bytes": 0, "pss_bytes": 0, "processes": 0}
    for pid in pids:
        try:
            text = Path(f"/proc/{pid}/smaps_rollup").read_text()
        except OSError:
            continue
        total["processes"] += 1
        for line in text.splitlines():
            key, _, rest = line.partition(":")
            if key in ("Rss", "Pss"):
                total[f"{key.lower()}_bytes"] += int(rest.split()[0]) * 1024
    return total



def process_tree(pid: int) -> list[int]:
    """``pid`` and all its live descendants (through /proc, so across process groups and sessions)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) >= 2 and fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    out: list[int] = []
    todo = [pid]
    while todo:
        p = todo.pop()
        if p in out:
            continue
        out.append(p)
        todo.extend(children.get(p, ()))
    return out


