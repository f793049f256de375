"""The package's layering, read from the AST of every module (lazy imports inside functions count too).

Bottom to top: ``config`` and ``dataset/``; ``serving/`` and ``monitor/`` (siblings: neither imports the
other); ``steps/``; ``tasks``. A module imports only its own layer or lower ones. ``dev/`` may import
anything and nothing outside it may import ``dev/``. Airflow is imported only by ``tasks`` and by
``monitor.ui_app`` (the plugin's FastAPI app, which runs inside the API server).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "include" / "dflash_pipeline"
ROOT = "dflash_pipeline"
AIRFLOW_IMPORTERS = {"dflash_pipeline.tasks", "dflash_pipeline.monitor.ui_app"}

# (rank, group): a module may import another of lower rank, or of equal rank and the same group.
_LAYERS = {
    "config": (0, "base"),
    "dataset": (0, "base"),
    "serving": (1, "serving"),
    "monitor": (1, "monitor"),
    "steps": (2, "steps"),
    "tasks": (3, "tasks"),
}


def module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    """Every module name the file imports, absolute, at any depth (relative imports resolved)."""
    mod = module_name(path)
    package = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            out.add(base)
            # `from dflash_pipeline.steps import handoff` imports the submodule dflash_pipeline.steps.handoff
            out.update(f"{base}.{alias.name}" for alias in node.names if base.startswith(ROOT))
    return out


def package_graph() -> dict[str, set[str]]:
    return {module_name(p): imports_of(p) for p in sorted(PKG.rglob("*.py"))}


def layer(mod: str) -> tuple[int, str] | None:
    """(rank, group) of a package module; None for dev/ and the package root."""
    parts = mod.split(".")
    if len(parts) == 1:
        return None  # dflash_pipeline/__init__: only a docstring and the version
    return _LAYERS.get(parts[1])


def violations(graph: dict[str, set[str]]) -> list[str]:
    """The layering rules broken by `graph` (module -> modules it imports)."""
    bad: list[str] = []
    for mod, imported in sorted(graph.items()):
        in_dev = mod.split(".")[1:2] == ["dev"]
        for dep in sorted(imported):
            top = dep.split(".")[0]
            if top == "airflow" and mod not in AIRFLOW_IMPORTERS:
                bad.append(f"{mod} imports Airflow ({dep}); only {sorted(AIRFLOW_IMPORTERS)} may")
            if top != ROOT or dep == ROOT or in_dev:
                continue
            if dep.split(".")[1] == "dev":
                bad.append(f"{mod} imports {dep}: nothing outside dev/ may import dev/")
                continue
            src, dst = layer(mod), layer(dep)
            if src is None or dst is None:
                bad.append(f"{mod} -> {dep}: module outside the layer table")
                continue
            if dst[0] > src[0] or (dst[0] == src[0] and dst[1] != src[1]):
                bad.append(f"{mod} (layer {src[1]}) imports {dep} (layer {dst[1]}), which is not below it")
    # dataset/ is the very bottom: it must not reach up into config either (config imports dataset).
    bad += [f"{m} imports {d}: dataset/ is the bottom layer" for m, deps in sorted(graph.items())
            if m.startswith(f"{ROOT}.dataset") for d in sorted(deps)
            if d == f"{ROOT}.config" or d.startswith(f"{ROOT}.config.")]
    return bad


def test_every_module_has_a_layer() -> None:
    graph = package_graph()
    unplaced = [m for m in graph if layer(m) is None and m != ROOT and not m.startswith(f"{ROOT}.dev")]
    assert unplaced == [], f"modules outside the layout: {unplaced}"


def test_package_follows_its_layering() -> None:
    assert violations(package_graph()) == []


@pytest.mark.parametrize(
    ("importer", "imported", "expected"),
    [
        ("dflash_pipeline.steps.plan", "dflash_pipeline.dev.sim", "nothing outside dev/"),
        ("dflash_pipeline.tasks", "dflash_pipeline.dev.stack", "nothing outside dev/"),
        ("dflash_pipeline.dataset.store", "dflash_pipeline.steps.plan", "not below it"),
        ("dflash_pipeline.serving.sglang", "dflash_pipeline.monitor.progress", "not below it"),
        ("dflash_pipeline.monitor.progress", "dflash_pipeline.steps.generate", "not below it"),
        ("dflash_pipeline.steps.plan", "dflash_pipeline.tasks", "not below it"),
        ("dflash_pipeline.dataset.records", "dflash_pipeline.config", "bottom layer"),
        ("dflash_pipeline.steps.plan", "airflow.sdk", "imports Airflow"),
    ],
)
def test_the_checker_catches_a_broken_rule(importer: str, imported: str, expected: str) -> None:
    """Each rule fails when broken: the real graph plus one forbidden edge."""
    graph = package_graph()
    graph[importer] = graph.get(importer, set()) | {imported}
    found = violations(graph)
    assert any(expected in v and importer in v for v in found), found


def test_dev_may_import_anything_and_lazy_imports_count() -> None:
    graph = package_graph()
    assert any(d.startswith(f"{ROOT}.steps") for d in graph[f"{ROOT}.dev.faultlab"])
    assert violations(graph) == []
    # A lazy import inside a function is seen too.
    f = PKG / "tasks.py"
    assert any(d.startswith(f"{ROOT}.steps.generate") for d in imports_of(f)), "tasks imports generate lazily"


def test_config_modules_do_not_import_each_other_in_a_circle() -> None:
    """Issue 41: mix.py and quality.py imported run.py (for ConfigError and the schema check) while run.py
    imports them; the shared pieces live in config/schema.py, which imports no other config module."""
    import ast

    config = Path(__file__).resolve().parents[2] / "include" / "dflash_pipeline" / "config"
    imports: dict[str, set[str]] = {}
    for path in config.glob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dflash_pipeline.config."):
                names.add(node.module.rsplit(".", 1)[1])
        imports[path.stem] = names
    assert imports["schema"] == set()

    def reaches(start: str, target: str, seen: set[str]) -> bool:
        for nxt in imports.get(start, set()):
            if nxt == target or (nxt not in seen and reaches(nxt, target, seen | {nxt})):
                return True
        return False

    circles = sorted(m for m in imports if m != "__init__" and reaches(m, m, {m}))
    assert not circles, f"config modules in an import circle: {circles}"
