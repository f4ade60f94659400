"""Code kept outside hprune that registers itself in one of hprune's registries (a pruning method, a data kind,
an export format), named by a config key (`prune.module`, `data.module`, `format_module`): a module name on
PYTHONPATH, or a path to a .py file."""
from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

from .errors import UserError


def import_plugin(module: str, key: str) -> str:
    """Import `module` (`key=module` in the user's words); returns the entry a worker process imports it by (the
    .py file's absolute path, or the module name)."""
    path = Path(str(module)).expanduser()
    try:
        if path.suffix == ".py":
            if not path.is_file():
                raise UserError(f"{key}={module}: no such file; give a .py file or a module on PYTHONPATH")
            name = f"hprune_plugin_{path.stem}"  # (the name the fairseq plugin imports it by, in fairseq's workers)
            if name not in sys.modules:
                spec = importlib.util.spec_from_file_location(name, path)
                sys.modules[name] = importlib.util.module_from_spec(spec)
                try:
                    spec.loader.exec_module(sys.modules[name])
                except BaseException:
                    del sys.modules[name]  # a module that failed half-way is not imported
                    raise
            return str(path.resolve())
        importlib.import_module(str(module))
        return str(module)
    except ModuleNotFoundError as err:
        itself = path.suffix != ".py" and f"{module}.".startswith(f"{err.name}.")
        if not itself:  # the module is there but needs something missing
            raise UserError(f"{key}={module} cannot be imported: {err}") from None
        raise UserError(f"{key}={module}: {err}; put its folder on PYTHONPATH or give the .py file's path") from None
