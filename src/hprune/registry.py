"""The one registry helper: pruning methods, export formats, data kinds, the plugin's pruning mechanisms and
Hugging Face families are each a `Registry` (as fairseq's `setup_registry` makes one per kind of component).

A registry holds named entries of one kind. It
  * registers them (`add`, or the decorator `register`), refusing a name taken by another entry in one line;
  * finds its own: the modules of its package, each imported once, at the first lookup (a module declares what
    it is by registering something, or nothing), and a plugin's, code kept outside hprune named by a config key
    (`prune.module`, `data.module`, `format_module`: a module name on PYTHONPATH or a .py file: `load_plugin`);
  * looks a name up (`lookup`), or says in one line that it is not there and what is (sorted);
  * lists its names and one-line descriptions (`describe`: the docs and their tests read it).
It reads as a mapping too (`name in registry`, `registry[name]`, `.items()`), its own modules found first.

The training workers fairseq starts are processes of their own: a plugin that registers a mechanism is shared
with them through HPRUNE_PLUGINS (`share_with_workers`), which the fairseq plugin imports on its start.
Light: no torch, no fairseq, no omegaconf (the fairseq plugin and the CLI import it).
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import pkgutil
import sys
from pathlib import Path
from typing import Callable, Dict, Generic, Iterator, List, Optional, Tuple, TypeVar

from .errors import UserError

T = TypeVar("T")
UNKNOWN = "unknown {kind} '{name}'; choose from {choices}"  # the line for a name no one registered
PLUGINS_FOR_WORKERS = "HPRUNE_PLUGINS"  # os.pathsep-separated plugins (module names, .py paths) workers import


def first_line(text: Optional[str]) -> str:
    """A docstring's first line: an entry's one-line description."""
    return ((text or "").strip().splitlines() or [""])[0]


def module_summary(defined: object) -> str:
    """The first line of the docstring of the module that defines `defined` (a function or class): the
    description of an entry that is its module's one purpose (a data kind, a mechanism)."""
    return first_line(getattr(sys.modules.get(getattr(defined, "__module__", None) or ""), "__doc__", None))


class Registry(Generic[T]):
    """Named entries of one kind (`kind`: its name in messages). `package`: the package whose modules register
    entries, imported once at the first lookup. `unknown`: the line for a name not registered ({kind}, {name},
    {choices})."""

    def __init__(self, kind: str, package: Optional[str] = None, unknown: str = UNKNOWN):
        self.kind, self.package, self.unknown = kind, package, unknown
        self._entries: Dict[str, T] = {}
        self._summaries: Dict[str, str] = {}
        self._scanned = package is None

    # ------------------------------------------------------------------------------------------- registering
    def add(self, name: str, entry: T, summary: str = "") -> T:
        """Register `entry` as `name`; an equal entry registered again is no duplicate."""
        if name in self._entries and self._entries[name] != entry:
            raise UserError(f"{self.kind} '{name}' is registered twice; give the new one a name of its own")
        self._entries[name], self._summaries[name] = entry, summary
        return entry

    def register(self, name: str, make: Optional[Callable[[Callable], T]] = None) -> Callable:
        """A decorator registering the function (or class) it decorates as `name`, or the entry `make` builds from
        it; its docstring's first line describes it."""
        def decorate(fn: Callable) -> Callable:
            self.add(name, make(fn) if make else fn, first_line(fn.__doc__))
            return fn
        return decorate

    def attach(self, name: str, **parts) -> None:
        """Give the registered entry `name` (a frozen dataclass) parts that live in a higher layer than the
        registry (a Hugging Face family's importer, beside torch); each part is set once."""
        entry = self.lookup(name)
        taken = sorted(part for part in parts if getattr(entry, part) is not None)
        if taken:
            raise UserError(f"{self.kind} '{name}' has its {', '.join(taken)} already")
        self._entries[name] = dataclasses.replace(entry, **parts)

    # ------------------------------------------------------------------------------------------- finding
    def scan(self) -> None:
        """Import every module of the package once: each registers what it defines."""
        if self._scanned:
            return
        self._scanned = True  # (set first: the modules imported look entries up while they load)
        try:
            for found in pkgutil.iter_modules(importlib.import_module(self.package).__path__):
                module = f"{self.package}.{found.name}"
                try:
                    importlib.import_module(module)
                except ModuleNotFoundError as err:  # the module needs something missing
                    raise UserError(f"{module} cannot be imported: {err}") from None
        except BaseException:
            self._scanned = False  # (the next lookup says it again)
            raise

    def load_plugin(self, module: str, key: str) -> str:
        """Import a plugin (after the registry's own modules, so that those keep their order), named by the config
        key `key`; returns what a worker process imports it by."""
        self.scan()
        return import_plugin(module, key)

    def lookup(self, name: str, hint: str = "") -> T:
        """The entry registered as `name`, or one line saying what is registered (and `hint`)."""
        self.scan()
        if name not in self._entries:
            choices = ", ".join(sorted(self._entries))
            raise UserError(self.unknown.format(kind=self.kind, name=name, choices=choices) + hint)
        return self._entries[name]

    def names(self) -> List[str]:
        """The names registered, in the order they were (the package's modules in alphabetical order first)."""
        self.scan()
        return list(self._entries)

    def describe(self) -> List[Tuple[str, str]]:
        """(name, one-line description) of each entry, for `--help` and the docs."""
        return [(name, self._summaries[name]) for name in self.names()]

    # as a read-only mapping
    def __contains__(self, name: object) -> bool:
        self.scan()
        return name in self._entries

    def __getitem__(self, name: str) -> T:
        self.scan()
        return self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())

    def items(self) -> List[Tuple[str, T]]:
        self.scan()
        return list(self._entries.items())

    def values(self) -> List[T]:
        self.scan()
        return list(self._entries.values())


# ----------------------------------------------------------------------------------------------- plugins
def import_plugin(module: str, key: str) -> str:
    """Import code kept outside hprune that registers itself (`key=module` in the user's words): a module name on
    PYTHONPATH, or a path to a .py file. Returns the entry a worker process imports it by (the .py file's
    absolute path, or the module name)."""
    path = Path(str(module)).expanduser()
    try:
        if path.suffix == ".py":
            if not path.is_file():
                raise UserError(f"{key}={module}: no such file; give a .py file or a module on PYTHONPATH")
            _import_file(path)
            return str(path.resolve())
        importlib.import_module(str(module))
        return str(module)
    except ModuleNotFoundError as err:
        itself = path.suffix != ".py" and f"{module}.".startswith(f"{err.name}.")
        if not itself:  # the module is there but needs something missing
            raise UserError(f"{key}={module} cannot be imported: {err}") from None
        raise UserError(f"{key}={module}: {err}; put its folder on PYTHONPATH or give the .py file's path") from None


def _import_file(path: Path) -> None:
    name = f"hprune_plugin_{path.stem}"  # the same name in every process, fairseq's workers included
    if name in sys.modules:
        return
    spec = importlib.util.spec_from_file_location(name, path)
    sys.modules[name] = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(sys.modules[name])
    except BaseException:
        del sys.modules[name]  # a module that failed half-way is not imported
        raise


def shared_with_workers() -> List[str]:
    """The plugins this process shares with the workers it starts."""
    return [entry for entry in os.environ.get(PLUGINS_FOR_WORKERS, "").split(os.pathsep) if entry]


def share_with_workers(entry: str) -> None:
    """Have the training workers fairseq starts import a plugin too (what it registers is theirs as well)."""
    plugins = shared_with_workers()
    if entry not in plugins:
        os.environ[PLUGINS_FOR_WORKERS] = os.pathsep.join([*plugins, entry])


def import_shared_plugins(key: str = PLUGINS_FOR_WORKERS) -> None:
    """In a worker: import the plugins its starter shared."""
    for entry in shared_with_workers():
        import_plugin(entry, key)
