"""Safe loading of fairseq checkpoints under torch's `weights_only=True` unpickler.

fairseq checkpoints pickle an `argparse.Namespace` (the legacy `args`) next to plain containers and tensors,
and those written by fairseq 0.6-0.9 also their training meters. Exactly these are allow-listed (SAFE_GLOBALS,
each under the name it was pickled with); anything else (an object whose unpickling would run code) makes torch refuse
the file, and `load_checkpoint` turns the refusal into a clear error. There is no unsafe fallback.
"""
from __future__ import annotations

import argparse
import pickle
import re
import zipfile
from pathlib import Path

import torch


class LegacyMeter:
    """The state of a training meter that fairseq 0.6-0.9 pickled into `extra_state["train_meters"]`, kept as
    plain data (its attributes) and never used: it only lets those checkpoints open under weights_only."""


# Every global a fairseq checkpoint may pickle besides tensors and containers, with the module path it was
# pickled under: the legacy `args`, and fairseq 0.6-0.9's meters (module fairseq.meters, now fairseq.logging.meters)
SAFE_GLOBALS = [argparse.Namespace,
                (LegacyMeter, "fairseq.meters.AverageMeter"),
                (LegacyMeter, "fairseq.meters.TimeMeter"),
                (LegacyMeter, "fairseq.meters.StopwatchMeter")]


class UnsafeCheckpointError(RuntimeError):
    pass


class CorruptCheckpointError(RuntimeError):
    pass


def allow_fairseq_checkpoint_globals() -> None:
    torch.serialization.add_safe_globals(SAFE_GLOBALS)


def load_checkpoint(path: str | Path) -> dict:
    """Load a checkpoint onto the CPU with torch's weights-only unpickler. A zip-format file (torch ≥ 1.6's) is
    mapped, not read: a tensor's bytes are read when it is used, so what a caller does not use (the optimizer's
    state beside the weights: twice their size with Adam) costs no memory, and what it copies into a model is
    page cache the system can take back (the caller must not keep the tensors past the file's next rewrite)."""
    path = Path(path)
    allow_fairseq_checkpoint_globals()
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except pickle.UnpicklingError as err:
        # the zip format can be listed; for the legacy format, torch's message names the first refused global
        unsafe = _unsafe_globals(path) or re.findall(r"Unsupported global: GLOBAL ([\w.]+)", str(err))
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
    allowed = {g[1] if isinstance(g, tuple) else f"{g.__module__}.{g.__qualname__}" for g in SAFE_GLOBALS}
    return [g for g in found if g not in allowed]
