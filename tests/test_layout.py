"""The structure the docs promise (docs/development.md), checked on the source: no verb imports another verb,
and the backend is the only hprune package that imports fairseq (the plugin aside)."""
from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "hprune"


def imports(path: Path) -> list[tuple[str, int]]:
    """(module, level) of every import in a file, function bodies included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            found += [(node.module or "", node.level)] + [(alias.name, node.level) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(alias.name, 0) for alias in node.names]
    return found


def test_no_verb_imports_another_verb():
    verbs = {p.stem for p in (SRC / "runner").glob("*.py")} - {"__init__"}
    for path in (SRC / "runner").glob("*.py"):
        relative = {module for module, level in imports(path) if level == 1}
        assert not relative & verbs, f"{path.name} imports the verb module(s) {sorted(relative & verbs)}"


def test_only_the_backend_imports_fairseq():
    for path in SRC.rglob("*.py"):
        if "backend" in path.relative_to(SRC).parts:
            continue
        heavy = [module for module, _ in imports(path) if module.split(".")[0] in ("fairseq", "fairseq_cli", "hprune_fairseq")]
        assert not heavy, f"{path.relative_to(SRC)} imports {heavy}: go through hprune.backend or the session"
