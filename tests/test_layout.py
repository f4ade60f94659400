"""The structure the docs promise (docs/development.md), checked on the source: no verb imports another verb,
the backend is the only hprune package that imports fairseq (the plugin aside), no module takes another's
private name, and only the backend and the session read into an opened checkpoint (a backend.Loaded)."""
from __future__ import annotations

import ast
import re
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
    {"attention_types", "bleu", "files", "launch", "registry"},
    {"model_folder", "rundir", "console", "pruning", "flops"},
    {"hub", "deploy"},
    {"analysis", "reporting", "backend"},
    {"data"},
    {"checkpoint_ref"},
    {"session", "evaluation", "head_analysis"},
    {"methods", "recovery"},
    {"api"},
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


def _defined_private_names(text: str) -> set[str]:
    """Private names (one leading underscore) a source defines: functions, methods, assigned attributes, module or
    class names."""
    pattern = r"def (_[A-Za-z]\w*)|\.(_[A-Za-z]\w*)\s*(?::[^=\n]*)?=(?!=)|^\s*(_[A-Za-z]\w*)\s*(?::[^=\n]*)?=(?!=)"
    return {name for groups in re.findall(pattern, text, flags=re.M) for name in groups if name}


def test_fairseq_private_names_live_in_one_backend_module():
    """fairseq's internals (names with a leading underscore that fairseq defines and hprune does not) are used
    by backend/compat.py alone, which checks the fairseq version they were written for. fairseq's `_name` is its
    configs' schema key, not an internal; names hprune defines itself (an attention module's cache accessors,
    which fairseq's layers call) are hprune's."""
    import fairseq
    fairseq_defined = set()
    for path in Path(fairseq.__file__).parent.rglob("*.py"):
        fairseq_defined |= _defined_private_names(path.read_text(errors="replace"))
    ours = SRC.parent
    sources = {path: path.read_text() for path in ours.rglob("*.py")}
    defined_here = set().union(*(_defined_private_names(text) for text in sources.values()))
    internals = fairseq_defined - defined_here - {"_name"}
    users = {}
    for path, text in sources.items():
        used = {node.attr for node in ast.walk(ast.parse(text)) if isinstance(node, ast.Attribute)}
        used |= {alias.name for node in ast.walk(ast.parse(text)) if isinstance(node, ast.ImportFrom)
                 and (node.module or "").startswith("fairseq") for alias in node.names}
        found = sorted(name for name in used & internals if not name.startswith("__"))
        if found:
            users[str(path.relative_to(ours))] = found
    assert list(users) == ["hprune/backend/compat.py"], users


def test_reporting_backend_and_deploy_name_no_method():
    """A method describes itself (methods/); the report, the backend and the exporters ask, never name one."""
    from hprune.methods import method_names
    names = [n for n in method_names() if n != "random"]  # ("random": a word as well as a method)
    for package in ("reporting", "backend", "deploy"):
        for path in (SRC / package).rglob("*.py"):
            code = "\n".join(line.split("#")[0] for line in path.read_text().splitlines())
            words = set(re.findall(r"[A-Za-z_]+", code.lower()))
            named = sorted(n for n in names if n in words or f"{n}_" in code.lower())
            assert not named, f"{path.relative_to(SRC)} names the method(s) {named}"


def _code_words(path: Path) -> set[str]:
    """The identifiers and string literals (docstrings aside) of a source, lower-cased."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    words = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            words.add(node.id.lower())
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            words.add(node.value.lower())
    return words


HF_FAMILY_HOMES = ["backend/hf.py", "model_folder.py"]  # the hprune modules a Hugging Face family is


def test_a_hugging_face_family_lives_in_two_modules():
    """A family is its entry in model_folder.HF_FAMILIES (model class, tokenizer files) and its importer, which
    backend/hf.py attaches to that entry; nothing else in hprune names it (docs/development.md, 'Extensions')."""
    import hprune.backend.hf  # noqa: F401  (attaches the importers)
    from hprune.model_folder import HF_FAMILIES
    assert [name for name, family in HF_FAMILIES.items() if family.importer is None] == []
    for family in HF_FAMILIES:
        homes = sorted(str(path.relative_to(SRC)) for path in SRC.rglob("*.py")
                       if any(family in re.split(r"[^a-z0-9]+", word) or ("_" in family and family in word)
                              for word in _code_words(path)))
        assert homes == HF_FAMILY_HOMES, (family, homes)


# hprune's own packages, by the names they are imported under (the CLI, cli/, is installed as hprune_cli)
OWN_PACKAGES = {"hprune": SRC, "hprune_fairseq": SRC.parent / "hprune_fairseq", "hprune_cli": SRC.parents[1] / "cli"}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _root_name(node: ast.expr) -> str | None:
    """The name an attribute chain starts from (`writer` of `writer.spec._x`); None where it starts from a call or
    a subscript."""
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _private_names_taken(path: Path) -> list[str]:
    """The private names (one leading underscore) a file takes from another of hprune's modules: imported by name
    (`from .ctranslate2 import _ctranslate2`) or by path (`import hprune.x._y`), or read off a name it imported
    from hprune (`writer._ctranslate2`, `Evaluator._unit_costs`)."""
    tree = ast.parse(path.read_text())
    taken, imported = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] in OWN_PACKAGES):
            source = "." * node.level + (node.module or "")
            taken += [f"{source}:{alias.name}" for alias in node.names if _private(alias.name)]
            imported |= {alias.asname or alias.name for alias in node.names}
        elif isinstance(node, ast.Import):
            ours = [alias for alias in node.names if alias.name.split(".")[0] in OWN_PACKAGES]
            taken += [alias.name for alias in ours if any(map(_private, alias.name.split(".")))]
            imported |= {alias.asname or alias.name.split(".")[0] for alias in ours}
    taken += [ast.unparse(node) for node in ast.walk(tree)
              if isinstance(node, ast.Attribute) and _private(node.attr) and _root_name(node.value) in imported]
    return taken


def test_no_module_takes_another_modules_private_name():
    """A name with one leading underscore is its module's own: no module of hprune, its fairseq plugin or its CLI
    imports one from another of them, nor reads one off a module or class it imported from them. What two modules
    share is public in the module that owns it. (The tests may reach in: they are not checked.)"""
    found = {str(path.relative_to(SRC.parents[1])): names for root in OWN_PACKAGES.values()
             for path in sorted(root.rglob("*.py")) if (names := _private_names_taken(path))}
    assert not found, f"private names taken from another module: {found}"


def _reads_into_loaded(path: Path) -> list[str]:
    """Each attribute read off a Loaded, as attribute chains show it: `<x>.loaded.<name>` or `loaded.<name>`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute):
            owner = node.value
            if (isinstance(owner, ast.Attribute) and owner.attr == "loaded") or \
                    (isinstance(owner, ast.Name) and owner.id == "loaded"):
                found.append(f"line {node.lineno}: .loaded.{node.attr}")
    return found


def test_only_the_backend_and_the_session_read_into_a_loaded_model():
    """A backend.Loaded (an opened checkpoint: fairseq's model, task and config, the target language token) is read
    into only by backend/, which defines it, and session.py, which wraps it. Anywhere else in hprune no attribute
    of `<x>.loaded` or of a variable `loaded` is read (`evaluator.session.loaded.cfg.model`,
    `session.loaded.target_prefix`): what a layer needs of an opened model is a public member of the session or a
    public function of the module that owns it. A Loaded handed on unread to a backend function
    (`backend.translate(session.loaded, ...)`) is how evaluation.py measures a session, and allowed; deploy/, below
    the backend in the layers, names no `.loaded` at all. Checked on attribute chains (ast): a Loaded put in a
    variable of another name first escapes the check."""
    readers, deploy_handles = {}, {}
    for path in SRC.rglob("*.py"):
        relative = path.relative_to(SRC)
        if relative.parts[0] == "backend" or relative == Path("session.py"):
            continue
        if reads := _reads_into_loaded(path):
            readers[str(relative)] = reads
        if relative.parts[0] == "deploy":
            named = [node.lineno for node in ast.walk(ast.parse(path.read_text()))
                     if isinstance(node, ast.Attribute) and node.attr == "loaded"]
            if named:
                deploy_handles[str(relative)] = named
    assert not readers, f"modules reading into a backend Loaded: {readers}"
    assert not deploy_handles, f"deploy/ modules naming .loaded (lines): {deploy_handles}"
