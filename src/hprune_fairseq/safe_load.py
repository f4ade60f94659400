"""Safe loading of fairseq checkpoints under torch's `weights_only=True` unpickler.

fairseq checkpoints pickle an `argparse.Namespace` (the legacy `args`) next to plain containers and tensors.
That one class is allow-listed; anything else (an object whose unpickling would run code) makes torch refuse
the file, and `load_checkpoint` turns the refusal into a clear error. There is no unsafe fallback.
"""
from __future__ import annotations

import argparse
import pickle
import zipfile
from pathlib import Path

import torch

SAFE_GLOBALS = [argparse.Namespace]


class UnsafeCheckpointError(RuntimeError):
    pass


class CorruptCheckpointError(RuntimeError):
    pass


def allow_fairseq_checkpoint_globals() -> None:
    torch.serialization.add_safe_globals(SAFE_GLOBALS)


def load_checkpoint(path: str | Path) -> dict:
    """Load a checkpoint onto the CPU with torch's weights-only unpickler."""
    path = Path(path)
    allow_fairseq_checkpoint_globals()
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        unsafe = _unsafe_globals(path)
        if unsafe or "Unsupported global" in str(err):
            names = ", ".join(unsafe) or "unknown objects"
            raise UnsafeCheckpointError(
                f"{path} holds pickled objects that are not allow-listed ({names}); refusing to load it "
                "(nothing was executed). Use a checkpoint written by hprune or fairseq.") from None
        raise CorruptCheckpointError(f"{path} is truncated or not a torch checkpoint; retrain or copy it again") from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, ValueError) as err:
        reason = (str(err).splitlines() or [type(err).__name__])[0]
        raise CorruptCheckpointError(f"{path} is truncated or not a torch checkpoint ({reason}); "
                                     "retrain or copy it again") from None
    if not isinstance(state, dict) or "model" not in state:
        raise CorruptCheckpointError(f"{path} is not a fairseq checkpoint (no 'model' entry)")
    return state


def _unsafe_globals(path: Path) -> list[str]:
    try:
        found = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # the file may be too damaged to list; the caller reports it either way
        return []
    allowed = {f"{g.__module__}.{g.__qualname__}" for g in SAFE_GLOBALS}
    return [g for g in found if g not in allowed]
