"""Every blocking call of the generate step takes a bound (issue 31: "one stop deadline").

A stop must end within `stop_grace_s`: a join, a future's result, an Event wait, a lock, a queue or
a sleep with no timeout on a worker's main thread can hold it for as long as the thing waited for
takes (a slow S3 call, a load probe, a stuck thread). This scan reads the AST of
`steps/generate/` and `serving/pilot.py` and refuses:

- `x.join()`, `x.result()`, `x.wait()`, `x.acquire()`, `q.get()` without a timeout;
- `time.sleep(...)` (a sleep does not end on the stop: wait on the stop's Event instead);
- `with_retries(...)` without an explicit `deadline_s=`;
- in the modules that are main's own (worker.py, stopping.py, verdicts.py), any direct S3 call (`.store.<op>(`,
  `Store(`): main reaches S3 only through `main_store` (dataset/store.StopBoundStore: every call
  cut at the stop) or through owners whose calls take the stop's deadline;
- in worker.py, a `Scanner(...)` not given `self.main_store`: its calls run on main (the end-of-run
  scan and sweeps) and must be cut by the stop. (The breaker reads no S3: its judgement runs on a
  daemon thread main never waits for, breaker.py.)

A call that is bounded another way says so on its line: `# bounded: <why>` (a reason of at least
three words). The planted-violation test shows each rule catching what it should.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "include" / "dflash_pipeline"
SCANNED = [*sorted((PKG / "steps" / "generate").glob("*.py")), PKG / "serving" / "pilot.py"]
MAIN_MODULES = {"worker.py", "stopping.py", "verdicts.py"}
STORE_OPS = {"get", "head", "list", "put", "delete", "open", "check_bucket"}
NEED_TIMEOUT = {"join", "result", "wait", "acquire"}
_NOTE = re.compile(r"#\s*bounded:\s*(\S+\s+\S+\s+\S+.*)$")


def _has_timeout(call: ast.Call) -> bool:
    if call.args:
        return True
    return any(k.arg in ("timeout", "timeout_s") or k.arg is None for k in call.keywords)


def violations(source: str, filename: str) -> list[str]:
    """Each unbounded blocking call in `source`: 'file:line: what'."""
    tree = ast.parse(source)
    lines = source.splitlines()
    found: list[str] = []

    def noted(node: ast.AST) -> bool:
        line = lines[node.lineno - 1] if 0 < node.lineno <= len(lines) else ""
        return bool(_NOTE.search(line))

    def report(node: ast.AST, what: str) -> None:
        if not noted(node):
            found.append(f"{filename}:{node.lineno}: {what}")

    name = Path(filename).name
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        fn = node.func
        if isinstance(fn, ast.Attribute):
            attr = fn.attr
            if attr in NEED_TIMEOUT and not _has_timeout(node):
                if attr == "acquire" and any(k.arg == "blocking" for k in node.keywords):
                    continue
                report(node, f".{attr}() without a timeout")
            elif attr == "get" and not node.args and not node.keywords:
                report(node, ".get() without a timeout (a queue)")
            elif attr == "sleep" and isinstance(fn.value, ast.Name) and fn.value.id == "time":
                report(node, "time.sleep() (a stop does not end it; wait on the stop's Event)")
            elif name in MAIN_MODULES and attr in STORE_OPS and isinstance(fn.value, ast.Attribute) \
                    and fn.value.attr == "store":
                report(node, f"a direct S3 call on main (.store.{attr}); use main_store or an owner with a deadline")
        elif isinstance(fn, ast.Name):
            if fn.id == "with_retries" and not any(k.arg == "deadline_s" for k in node.keywords):
                report(node, "with_retries() without deadline_s=")
            elif fn.id == "sleep":
                report(node, "sleep() (a stop does not end it; wait on the stop's Event)")
            elif name in MAIN_MODULES and fn.id == "Store":
                report(node, "a Store made on main (its calls are not cut by the stop)")
            elif name == "worker.py" and fn.id == "Scanner":
                first = node.args[0] if node.args else None
                if not (isinstance(first, ast.Attribute) and first.attr == "main_store"):
                    report(node, f"{fn.id} not given self.main_store (its calls run on main)")
    return found


def test_no_unbounded_blocking_call_in_the_generate_step() -> None:
    found: list[str] = []
    for path in SCANNED:
        found += violations(path.read_text(), str(path.relative_to(PKG)))
    assert not found, "blocking calls without a bound:\n" + "\n".join(found)


PLANTED = '''
import time
from dflash_pipeline.dataset.store import Store, with_retries

class Worker:
    def __init__(self, store):
        self.main_store = store
        self.scanner = Scanner(store, 1)                     # 8: not main_store
        self.scanner = Scanner(self.main_store, 1)           # fine
        self.mine = Store(store.client, "b")                 # 10: a Store on main

    def run(self, t, fut, ev, lock, q):
        t.join()                                             # 13
        t.join(timeout=1.0)                                  # fine
        fut.result()                                         # 15
        fut.result(timeout=2)                                # fine
        ev.wait()                                            # 17
        ev.wait(0.1)                                         # fine
        lock.acquire()                                       # 19
        lock.acquire(timeout=1)                              # fine
        q.get()                                              # 21
        q.get(timeout=0.5)                                   # fine
        time.sleep(1)                                        # 23
        with_retries(lambda: 1, what="x")                    # 25
        with_retries(lambda: 1, what="x", deadline_s=3)      # fine
        self.store.list("p")                                 # 27
        t.join()  # bounded: the thread ends with the pipe it reads
        t.join()  # bounded: yes
        ", ".join(["a", "b"])                                # fine: str.join has its argument
'''


def test_the_scan_catches_planted_violations() -> None:
    # `# 25` marks where the call is; the planted lines are numbered from the string's first line
    found = violations(PLANTED, "steps/generate/worker.py")
    lines = sorted(int(f.split(":")[1]) for f in found)
    expected = {}
    for i, line in enumerate(PLANTED.splitlines(), start=1):
        if re.search(r"#\s*\d+", line) and "fine" not in line:
            expected[i] = line.strip()
    assert set(lines) >= set(expected), (found, expected)
    # the one-word note is no reason: that join is still reported; the noted one is not
    noted = [i for i, line in enumerate(PLANTED.splitlines(), start=1) if "bounded: the thread" in line][0]
    bare = [i for i, line in enumerate(PLANTED.splitlines(), start=1) if "bounded: yes" in line][0]
    assert noted not in lines and bare in lines
    fine = {i for i, line in enumerate(PLANTED.splitlines(), start=1) if "fine" in line}
    assert not fine & set(lines), [f for f in found if int(f.split(":")[1]) in fine]
    # outside main's modules direct S3 calls and Store() are the owners' business
    other = violations(PLANTED, "steps/generate/scan.py")
    assert not any("direct S3" in f or "Store made" in f or "main_store" in f for f in other)
