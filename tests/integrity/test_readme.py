"""The README (and docs/*.md) stay true to the code: every param, dataset path, make target and repo file
they name exists.

Read at test time from the code itself, never from a copy: the params from the DAGs Airflow parses
(DagBag: whatever each DAG's params are after every merge), the dataset keys from `DatasetLayout` and the
tokenize profiles (`profile_keys`), the make targets from the Makefile. `check_text` is the whole rule;
`test_a_planted_wrong_name_fails` shows it catches each kind of mistake.
"""

from __future__ import annotations

import inspect
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
PACKAGE = REPO / "include" / "dflash_pipeline"

# Keys of the chunk protocol that come and go during a run; the README points to docs for them.
TRANSIENT = ("claims/", "partials/", "retry/")
# The DAG whose params a file's "| param |" tables describe (other files: any DAG's).
TABLE_DAG = {"README.md": "dflash_generate", "params.md": "dflash_generate", "tokenize.md": "dflash_tokenize",
             "evaluation.md": "dflash_eval", "train.md": "dflash_train"}
# Written by another part of issue 32/33 in parallel (helper mix: docs/mix.md); once merged the file exists
# and this allowance has no effect.
PENDING = {"docs/mix.md",
           # issue 38 item 2's trainer entry, written on branch trainer-cpu beside dflash_train (branch train)
           "include/dflash_pipeline/steps/train/specforge_entry.py"}
SLOT = "\u00a7"  # one path segment's variable part (a chunk index, a run id, a glob)


@dataclass
class Truth:
    """What the code has, read once per test session."""

    params: dict[str, set[str]]  # dag_id -> param names
    dataset_shapes: set[str]  # dataset keys relative to the root, variable parts as SLOT
    make_targets: set[str]

    @property
    def all_params(self) -> set[str]:
        return set().union(*self.params.values())


@dataclass
class Problems:
    items: list[str] = field(default_factory=list)

    def add(self, where: str, what: str) -> None:
        self.items.append(f"{where}: {what}")


def _shape(path: str) -> str:
    """A dataset path with its variable parts as SLOT: `part-NNNNNN`, `part-*`, `<run_id>`, digits."""
    path = re.sub(r"/\*$", "/", path)  # `completions/*`: the folder
    path = re.sub(r"<[^>/]+>", SLOT, path)
    path = re.sub(r"\{[^}/]+\}", SLOT, path)
    path = re.sub(r"(?<=-)(?:N+|\d+|\*)(?=\.)", SLOT, path)
    path = re.sub(r"P[a-z_]+", SLOT, path)  # the sentinels dataset_shapes passes for str args
    return path


def dataset_shapes() -> set[str]:
    """Every key DatasetLayout and the tokenize profiles produce, relative to the root, as shapes."""
    from dflash_pipeline.dataset.layout import DatasetLayout
    from dflash_pipeline.steps.tokenize import profiles

    def call(fn, owner=None):  # noqa: ANN001, ANN202 - any key function: ints 0, strs a sentinel
        args = {}
        for p in inspect.signature(fn).parameters.values():
            if p.name == "self":
                continue
            args[p.name] = 0 if p.annotation in (int, "int") else f"P{p.name}"
        return fn(owner, **args) if owner is not None else fn(**args)

    layout = DatasetLayout("bucket", "ROOT")
    keys: set[str] = set()
    for name, member in vars(DatasetLayout).items():
        if name.startswith("_") or name in ("from_uri", "uri", "key"):
            continue
        value = getattr(layout, name) if isinstance(member, property) else (
            call(member, layout) if inspect.isfunction(member) else None)
        if isinstance(value, str) and value.startswith("ROOT/"):
            keys.add(value[len("ROOT/"):])
    for profile in profiles.PROFILES:
        sig = inspect.signature(profiles.profile_keys)
        extra = {p: f"P{p}" for p in sig.parameters if p not in ("profile", "chunk")}
        keys.update(profiles.profile_keys(profile, 0, **extra).values())
    # A named tokenization (the `tokenization` param) writes the same files under tokenized/<name>/.
    keys |= {"tokenized/Pname/" + k[len("tokenized/"):] for k in list(keys) if k.startswith("tokenized/")}
    shapes = {re.sub(r"\d{6}", SLOT, _shape(k)) for k in keys}
    # run_key(run_id, name): a run's own files, any name (the eval and progress files live there).
    return {s[: -len(SLOT)] + "**" if s.startswith(f"runs/{SLOT}/") and s.endswith(f"/{SLOT}") else s
            for s in shapes}


def make_targets() -> set[str]:
    text = (REPO / "Makefile").read_text()
    return {m.group(1) for m in re.finditer(r"^([A-Za-z0-9_.-]+)\s*:(?!=)", text, re.M)}


@pytest.fixture(scope="module")
def truth() -> Truth:
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(REPO / "dags"))
    assert bag.import_errors == {}
    params = {dag_id: set(dag.params.keys()) for dag_id, dag in bag.dags.items()}
    return Truth(params=params, dataset_shapes=dataset_shapes(), make_targets=make_targets())


# -- the rule ------------------------------------------------------------------------------------------------

_TOP = {p.name for p in REPO.iterdir() if not p.name.startswith(".git")}
_PKG_TOP = {p.name for p in PACKAGE.iterdir()}


def _dataset_top(truth: Truth) -> set[str]:
    return {s.split("/", 1)[0] + ("/" if "/" in s else "") for s in truth.dataset_shapes}


def check_dataset_path(path: str, truth: Truth) -> bool:
    """A path under the dataset root is one the code writes (a folder: one some key lies in)."""
    shape = _shape(path.strip())
    shape = re.sub(r"^(?:<[^>]*>|" + SLOT + r")/", "", shape)  # `<root>/tokenized/...`
    if shape.endswith("/"):
        return any(s.startswith(shape) for s in truth.dataset_shapes)
    return shape in truth.dataset_shapes or any(
        s.endswith("**") and shape.startswith(s[:-2]) for s in truth.dataset_shapes)


def _looks_like_dataset_path(token: str, truth: Truth) -> bool:
    token = re.sub(r"^<[^>]*>/", "", token)
    first = token.split("/", 1)[0]
    if "/" not in token or "://" in token or token.startswith("/"):
        return False
    return first + "/" in _dataset_top(truth) | {"export/"}


def _is_repo_path(token: str) -> bool:
    first = token.split("/", 1)[0]
    return "/" in token and "://" not in token and not token.startswith("/") and first in _TOP


def check_text(name: str, text: str, truth: Truth, *, strict_repo_paths: bool) -> list[str]:
    """Everything wrong in one Markdown file: names no DAG, key, target or file has."""
    problems = Problems()
    table_dag = TABLE_DAG.get(name)
    known = truth.params.get(table_dag, truth.all_params) if table_dag else truth.all_params

    # 1. conf of `airflow dags trigger <dag> --conf '{...}'`: valid JSON whose keys are that DAG's params.
    for m in re.finditer(r"dags trigger (\w+)\s+--conf\s+'(\{.*?\})'", text, re.S):
        dag_id, raw = m.group(1), m.group(2)
        if dag_id not in truth.params:
            problems.add(name, f"`dags trigger {dag_id}`: no such DAG")
            continue
        try:
            conf = json.loads(raw)
        except json.JSONDecodeError as exc:
            if strict_repo_paths:
                problems.add(name, f"the conf of `dags trigger {dag_id}` is not JSON: {exc}")
            continue
        for key in sorted(set(conf) - truth.params[dag_id]):
            problems.add(name, f"conf key {key!r} is not a param of {dag_id}")

    # 2. tables whose first header cell is "param": every backticked name in the first column.
    for table in re.finditer(r"^\|\s*param\s*\|.*\n\|[-| :]+\|\n((?:\|.*\n?)+)", text, re.M):
        for row in table.group(1).splitlines():
            first = row.split("|")[1] if row.count("|") > 1 else ""
            for pname in re.findall(r"`([a-z_][a-z0-9_]*)`", first):
                if pname not in known:
                    problems.add(name, f"param table names `{pname}`, not a param of {table_dag or 'any DAG'}")

    # 3. prose: "param `x`", "`x` param".
    for pname in re.findall(r"\bparams? `([a-z_][a-z0-9_]*)`|`([a-z_][a-z0-9_]*)` param\b", text):
        for p in filter(None, pname):
            if p not in truth.all_params:
                problems.add(name, f"names param `{p}`, which no DAG has")

    # 4. `make <target>`.
    code = "\n".join(re.findall(r"```\w*\n(.*?)```", text, re.S))
    for target in re.findall(r"`make ([a-z][a-z0-9_-]*)", text) + re.findall(r"^\s*make ([a-z][a-z0-9_-]*)", code, re.M):
        if target not in truth.make_targets:
            problems.add(name, f"`make {target}`: the Makefile has no such target")

    # 5. dataset paths: the layout block (one per line) and backticked paths under a dataset folder.
    for block in re.finditer(r"<!-- layout:begin -->\s*```\w*\n(.*?)```\s*<!-- layout:end -->", text, re.S):
        for line in block.group(1).splitlines():
            if line.strip() and not check_dataset_path(line.split()[0], truth):
                problems.add(name, f"layout lists `{line.split()[0]}`, which the code does not write")
        listed = {_shape(line.split()[0]) for line in block.group(1).splitlines() if line.strip()}
        for shape in sorted(truth.dataset_shapes):
            covered = any(f.endswith("/") and shape.startswith(f) for f in listed)  # a folder line: all of it
            if shape not in listed and not covered and not shape.startswith(TRANSIENT) and not shape.endswith(("/", "**")):
                problems.add(name, f"the layout block lacks `{shape}` (the code writes it)")
    for token in re.findall(r"`([^`\s]+)`", text):
        if _looks_like_dataset_path(token, truth) and not check_dataset_path(token, truth):
            problems.add(name, f"`{token}` is not a key the code writes under the dataset root")

    # 6. repo files: links, and (README) backticked paths under a top-level folder of the repo.
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" in target:
            continue
        base = README.parent if name == "README.md" else REPO / "docs"
        if not (base / target).exists() and target not in PENDING:
            problems.add(name, f"link to {target}, which does not exist")
    if strict_repo_paths:
        for token in set(re.findall(r"`([^`\s]+)`", text)) | set(re.findall(r"(?<![\w/.])((?:tests|docs|scripts|include|dags|plugins|bench)/[\w./-]+\w)", text)):
            token = token.split("::")[0]
            if _is_repo_path(token) and not any(ch in token for ch in "<*{"):
                if not (REPO / token).exists() and token not in PENDING:
                    problems.add(name, f"`{token}` does not exist in the repository")
    return problems.items


# -- the tests --------------------------------------------------------------------------------------------


def test_readme_names_only_what_the_code_has(truth: Truth) -> None:
    problems = check_text("README.md", README.read_text(), truth, strict_repo_paths=True)
    assert not problems, "README.md is out of date:\n" + "\n".join(problems)


@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
def test_docs_name_only_what_the_code_has(doc: Path, truth: Truth) -> None:
    problems = check_text(doc.name, doc.read_text(), truth, strict_repo_paths=False)
    assert not problems, f"docs/{doc.name} is out of date:\n" + "\n".join(problems)


def test_readme_is_for_users() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) < 200, f"README.md has {len(lines)} lines; internals go to docs/"
    assert re.search(r"<!-- newcomer:begin -->\s*```bash\n(.+?)```\s*<!-- newcomer:end -->",
                     README.read_text(), re.S), "the newcomer block (tests/e2e/test_newcomer.py runs it)"


def test_the_code_keys_are_read(truth: Truth) -> None:
    """The truth is not empty: a broken reader would let every name pass."""
    assert {"prompts_uri", "servers", "max_tokens"} <= truth.params["dflash_generate"]
    assert {"max_length", "formats"} <= truth.params["dflash_tokenize"]
    assert f"completions/part-{SLOT}.parquet" in truth.dataset_shapes
    assert f"tokenized/specforge/part-{SLOT}.jsonl" in truth.dataset_shapes
    assert f"runs/{SLOT}/progress/{SLOT}.json" in truth.dataset_shapes
    assert {"demo", "test", "venv"} <= truth.make_targets


@pytest.mark.parametrize(("planted", "expected"), [
    ("airflow dags trigger dflash_generate --conf '{\"prompts_uri\": \"s3://b/p\", \"max_tokenz\": 5}'",
     "conf key 'max_tokenz' is not a param of dflash_generate"),
    ("| param | default |\n|---|---|\n| `claim_lease_seconds` | 180 |\n", "param table names `claim_lease_seconds`"),
    ("Set the param `tokeniser` to ...", "names param `tokeniser`"),
    ("Then run `make demos`.", "`make demos`: the Makefile has no such target"),
    ("Shards land in `tokenized/part-NNNNNN.parquet`.", "`tokenized/part-NNNNNN.parquet` is not a key"),
    ("SpecForge reads `export/conversations/`.", "`export/conversations/` is not a key"),
    ("See `tests/unit/test_no_such_file.py`.", "`tests/unit/test_no_such_file.py` does not exist"),
    ("See [the guide](docs/no-such-guide.md).", "link to docs/no-such-guide.md"),
    ("<!-- layout:begin -->\n```text\nmanifest.json   x\ncompletions/part-NNNNNN.jsonl  y\n```\n<!-- layout:end -->",
     "layout lists `completions/part-NNNNNN.jsonl`"),
])
def test_a_planted_wrong_name_fails(truth: Truth, planted: str, expected: str) -> None:
    text = README.read_text() + "\n" + planted + "\n"
    problems = check_text("README.md", text, truth, strict_repo_paths=True)
    assert any(expected in p for p in problems), problems
    assert not check_text("README.md", README.read_text(), truth, strict_repo_paths=True)
