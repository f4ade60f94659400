"""The one registry helper (hprune.registry): a duplicate refused and an unknown name answered in one line each,
a package's modules imported once (none skipped), plugins imported after them, and the five registries built on
it."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable, Optional

import pytest

from hprune.errors import UserError
from hprune.registry import Registry, import_plugin, share_with_workers, shared_with_workers


def test_a_duplicate_is_refused_in_one_line():
    registry = Registry("widget")

    @registry.register("round")
    def round_widget():
        """A round widget."""

    registry.register("round")(round_widget)  # the same entry again (its module imported again): no duplicate
    with pytest.raises(UserError, match=r"^widget 'round' is registered twice; give the new one a name of its own$"):
        registry.add("round", object())
    assert registry.describe() == [("round", "A round widget.")]


def test_an_unknown_name_lists_the_choices():
    registry = Registry("widget", unknown="kind={name} is not one of {choices}")
    registry.add("b", 1)
    registry.add("a", 2)
    with pytest.raises(UserError, match=r"^kind=c is not one of a, b \(try d\)$"):
        registry.lookup("c", " (try d)")
    assert registry.lookup("a") == 2 and registry.names() == ["b", "a"]  # registration order; the line sorts them


def _package(tmp_path, name: str, modules: dict) -> None:
    (tmp_path / name).mkdir()
    (tmp_path / name / "__init__.py").write_text("")
    for module, text in modules.items():
        (tmp_path / name / f"{module}.py").write_text(text)


def test_a_package_is_scanned_once_and_whole(tmp_path, monkeypatch):
    home = "from hprune.registry import Registry\nREGISTRY = Registry('thing', package='scanned_pkg')\nIMPORTS = []\n"
    registering = "from scanned_pkg.home import IMPORTS, REGISTRY\nIMPORTS.append('{0}')\nREGISTRY.add('{0}', '{0}')\n"
    _package(tmp_path, "scanned_pkg", {"home": home, "b": registering.format("b"), "a": registering.format("a"),
                                       "curve": "from scanned_pkg.home import IMPORTS\nIMPORTS.append('curve')\n"})
    monkeypatch.syspath_prepend(str(tmp_path))
    from scanned_pkg.home import IMPORTS, REGISTRY

    assert IMPORTS == []  # nothing before the first lookup
    assert REGISTRY.names() == ["a", "b"] and "a" in REGISTRY and REGISTRY["b"] == "b"
    REGISTRY.lookup("a")
    assert IMPORTS == ["a", "b", "curve"]  # every module (one registering nothing too), once
    for name in [name for name in sys.modules if name.startswith("scanned_pkg")]:
        del sys.modules[name]


def test_a_plugin_comes_after_the_registrys_own(tmp_path, monkeypatch):
    _package(tmp_path, "own_pkg", {"first": "from own_pkg.home import REGISTRY\nREGISTRY.add('first', 1)\n"})
    (tmp_path / "own_pkg" / "home.py").write_text(
        "from hprune.registry import Registry\nREGISTRY = Registry('thing', package='own_pkg')\n")
    (tmp_path / "mine.py").write_text("from own_pkg.home import REGISTRY\nREGISTRY.add('mine', 2)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from own_pkg.home import REGISTRY

    assert REGISTRY.load_plugin(str(tmp_path / "mine.py"), "thing_module") == str((tmp_path / "mine.py").resolve())
    assert REGISTRY.names() == ["first", "mine"]
    with pytest.raises(UserError, match=r"^thing_module=no_such_plugin_module: No module named"):
        REGISTRY.load_plugin("no_such_plugin_module", "thing_module")
    with pytest.raises(UserError, match=r"no such file"):
        import_plugin(str(tmp_path / "gone.py"), "thing_module")
    for name in list(sys.modules):
        if name.startswith(("own_pkg", "hprune_plugin_mine")):
            del sys.modules[name]


def test_plugins_are_shared_with_workers_once(monkeypatch):
    monkeypatch.setenv("HPRUNE_PLUGINS", "")  # (restored afterwards)
    share_with_workers("a_module")
    share_with_workers("/x/b.py")
    share_with_workers("a_module")
    assert shared_with_workers() == ["a_module", "/x/b.py"]


@dataclass(frozen=True)
class Part:
    name: str
    extra: Optional[Callable] = None


def test_a_part_from_a_higher_layer_is_attached_once():
    registry = Registry("part")
    registry.add("p", Part("p"))
    registry.attach("p", extra=len)
    assert registry["p"].extra is len
    with pytest.raises(UserError, match="part 'p' has its extra already"):
        registry.attach("p", extra=len)
    with pytest.raises(UserError, match="unknown part 'q'; choose from p"):
        registry.attach("q", extra=len)


def test_the_five_registries_are_the_helper():
    pytest.importorskip("fairseq")
    import hprune.backend.hf  # noqa: F401  (attaches the families' importers)
    from hprune.data.kinds import KINDS
    from hprune.deploy import EXPORTERS
    from hprune.methods import METHODS
    from hprune.model_folder import HF_FAMILIES
    from hprune_fairseq.mechanisms import MECHANISMS
    for registry in (METHODS, EXPORTERS, KINDS, MECHANISMS, HF_FAMILIES):
        assert isinstance(registry, Registry) and registry.names(), registry.kind
        assert all(summary for _, summary in registry.describe()), registry.describe()
    assert "curve" not in METHODS and "orders" not in METHODS  # modules that register nothing, or other names
