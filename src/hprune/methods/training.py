"""What a method trains a model with: Adam updates under a fixed mask (a curve's fine-tuning, a trained method's
retraining), and fairseq-train's command line continuing a checkpoint (Voita's gates, DSP: their own training
runs, in processes of their own)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from .. import backend
from ..pruning.heads import Mask


def finetune(session, mask: Optional[Mask], updates: int, lr: float, max_tokens: int, seed: int) -> None:
    """Adam updates of an opened model (hprune.session.Session) on the train split with `mask` held fixed (masked
    heads get no gradient); the model stays under that mask."""
    session.set_mask(mask)
    backend.finetune(session.loaded, session.criterion, updates, lr, max_tokens, seed)


def continue_training_argv(session, save_dir: Path, seed: int, criterion: str, options: list) -> list:
    """fairseq-train flags that continue training an opened model's checkpoint (its architecture and label
    smoothing as recorded) with `criterion` and the caller's options."""
    return backend.continue_training_argv(
        session.loaded, session.data_bin, save_dir, session.device, session.precision, seed,
        [*backend.criterion_flags(session.loaded, criterion), *options,
         *backend.tensorboard_flags({"tensorboard": session.tensorboard}, save_dir)])
