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


# hprune's packages and modules from the bottom up: each imports only from layers below its own (a layer's
# members do not import each other), so the import graph has no circle and nothing imports back up
LAYERS = [
    {"errors"},
    {"attention_types", "files", "launch"},
    {"model_folder", "translations", "console", "pruning", "flops", "deploy"},
    {"hub"},
    {"analysis", "reporting", "backend"},
    {"data"},
    {"session"},
    {"methods"},
    {"runner", "worker"},
]


def _unit_imports(path: Path) -> set[str]:
    """The top-level hprune units (package or module) a file imports, relative imports resolved."""
    parts = path.relative_to(SRC).parts
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = list(parts[:-1])[:len(parts) - node.level] if node.level > 1 else list(parts[:-1])
            target = base + (node.module.split(".") if node.module else [])
            found |= {target[0]} if target else {alias.name for alias in node.names}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            found |= {n.split(".")[1] for n in names if n and n.startswith("hprune.")}
    return found


def test_every_import_goes_down_the_layers():
    layer_of = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}
    for path in SRC.rglob("*.py"):
        if path.name == "__init__.py" and path.parent == SRC:
            continue
        unit = path.relative_to(SRC).parts[0].removesuffix(".py")
        assert unit in layer_of, f"{unit} is in no layer of tests/test_layout.py: place it (docs/development.md)"
        for other in _unit_imports(path) - {unit}:
            assert other in layer_of and layer_of[other] < layer_of[unit], \
                f"{path.relative_to(SRC)} imports {other}, which is not below {unit}"
