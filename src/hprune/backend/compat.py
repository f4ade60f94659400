"""fairseq inside a Hydra app: the global state both keep, devices and precisions, and a GC-quiet hot loop.

The one module of hprune that touches fairseq's private names (its internals, which a fairseq release may
change): each is wrapped here, and a fairseq other than the one they were written for is said once
(FAIRSEQ_VERSION; tests/test_layout.py checks that no other module uses them)."""
from __future__ import annotations

import contextlib
import copy
import gc
import sys
import warnings
from pathlib import Path
from typing import Iterator

import fairseq
import torch
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig

import hprune_fairseq  # registers the model and the safe-loading allow-list

from ..errors import UserError

FAIRSEQ_VERSION = "0.12.3.1"  # fairseq-fixed: the release whose internals this module was written against
if fairseq.__version__ != FAIRSEQ_VERSION:
    warnings.warn(f"hprune was written for fairseq {FAIRSEQ_VERSION} (fairseq-fixed), whose internals "
                  f"hprune/backend/compat.py uses; this is fairseq {fairseq.__version__}: run `make test` before "
                  "trusting the results", stacklevel=1)

# fairseq's iterators always ask for pinned memory; on a CPU-only machine torch warns at every batch iterator
warnings.filterwarnings("ignore", message="'pin_memory' argument is set as true but no accelerator")
PLUGIN_DIR = str(Path(hprune_fairseq.__file__).parent)  # for `--user-dir`
HPRUNE_ARCHS = ("hprune_transformer", "hprune_transformer_big", "hprune_moa", "hprune_moa_big")
MOA_ARCHS = ("hprune_moa", "hprune_moa_big")

# fairseq registers its config groups (lr_scheduler/fixed, ...) in Hydra's ConfigStore once, when imported. A
# joblib worker runs several sweep jobs, and before each Hydra puts back the launching process's ConfigStore,
# which never saw fairseq: the entries are merged back from this snapshot before fairseq composes a config.
_FAIRSEQ_CONFIG_STORE = copy.deepcopy(ConfigStore.instance().repo)


def _merge_missing(repo: dict, saved: dict) -> None:
    for key, value in saved.items():
        if key not in repo:
            repo[key] = copy.deepcopy(value)
        elif isinstance(value, dict) and isinstance(repo[key], dict):
            _merge_missing(repo[key], value)


def to_omegaconf(args) -> DictConfig:
    """fairseq's convert_namespace_to_omegaconf, run inside a Hydra app.

    fairseq composes its own config with Hydra's 1.1-era API, which refuses to run once an app has set
    version_base >= 1.2, and clears the global Hydra state; both are put back afterwards.
    """
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.singleton import Singleton
    from hydra.version import VersionBase
    from packaging.version import Version

    _merge_missing(ConfigStore.instance().repo, _FAIRSEQ_CONFIG_STORE)
    versions = VersionBase.instance()
    base, saved = versions.getbase(), Singleton._instances.get(GlobalHydra)
    versions.setbase(Version("1.1"))
    try:
        with warnings.catch_warnings():  # fairseq's own use of deprecated Hydra APIs is not the user's concern
            warnings.simplefilter("ignore", UserWarning)
            return convert_namespace_to_omegaconf(args)
    finally:
        versions.version_base = base
        if saved is not None:
            Singleton._instances[GlobalHydra] = saved


@contextlib.contextmanager
def frozen_heap():
    """Hide every object allocated so far (fairseq's modules, the model) from the garbage collector while a
    hot loop runs. fairseq is imported late, inside the Hydra job, and its millions of young objects otherwise
    make full collections run, and rescan them, during beam search: 25-30% slower, measured. (No collection
    first: it costs 0.4 s a call, and garbage frozen here is collected after the unfreeze.)"""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def freed_blocks_returned(width: int) -> None:
    """For a model `width` wide or wider (WIDE): glibc's malloc maps a block above its mmap threshold and unmaps it
    when freed, but raises the threshold to the size of each mapped block it frees (up to 32 MB); blocks below it
    come from its heap, which keeps what is freed and which a training's batches of ever-changing shapes fragment.
    At NLLB-1.3B a model parked on disk (Session.parked) stayed resident, and a training of its gates grew by about
    1.5 GB an update until killed in its third at 21 GiB; with the threshold fixed at 64 KiB (mallopt, which also
    stops the raising) its updates run (docs/benchmarks.md, "Real sizes"). Every block of 64 KiB or more is then a
    system call and fresh pages: 88 s an update against 78 at NLLB-1.3B, but 60 % more time for a small model's
    many small blocks, which do not fragment the heap enough to matter; hence only for wide models (transformer_big,
    NLLB, M2M100, mBART). Linux with glibc only; elsewhere nothing is changed."""
    if width < WIDE or not sys.platform.startswith("linux"):
        return
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return
    if libc is not None and hasattr(libc, "mallopt"):
        libc.mallopt(M_MMAP_THRESHOLD, 64 * 1024)


M_MMAP_THRESHOLD = -3  # glibc's malloc.h
WIDE = 1024  # the model width from which freed blocks are given back (freed_blocks_returned)


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("device=cuda but no CUDA device is visible; use device=auto or device=cpu")
    if device not in ("cpu", "cuda"):
        raise UserError(f"device={device} is not one of auto, cpu, cuda")
    return device


def check_precision(device: str, precision: str, training: bool) -> None:
    if precision not in ("fp32", "fp16", "bf16"):
        raise UserError(f"precision={precision} is not one of fp32, fp16, bf16")
    if device != "cuda" and (precision == "fp16" or (training and precision == "bf16")):
        # fairseq trains in bf16 only on CUDA (elsewhere it assumes a TPU); fp16 kernels need CUDA
        what = "training" if training and precision == "bf16" else "it"
        raise UserError(f"precision={precision} needs a CUDA device for {what}; use precision=fp32 on the CPU")


def undo_generation_fast(model) -> None:
    """fairseq's make_generation_fast_ (run before every beam search) replaces the model's train() with one that
    refuses; training again in the same process (fine-tuning between pruning steps) needs the method back."""
    vars(model).pop("train", None)
    model._is_generation_fast = False


def forget_best_checkpoint() -> None:
    """fairseq keeps the best validation loss on its save_checkpoint function: a second training in one process
    (the from-scratch control after gated training) would otherwise never write its checkpoint_best.pt."""
    from fairseq import checkpoint_utils

    vars(checkpoint_utils.save_checkpoint).pop("best", None)


@contextlib.contextmanager
def legacy_checkpoints_readable() -> Iterator[None]:
    """fairseq's checkpoint loading as it upgrades a legacy `args` checkpoint (fairseq 0.6-0.9, and hprune's
    imports of Hugging Face models) with convert_namespace_to_omegaconf: through to_omegaconf, so that it works
    inside a Hydra app too (fairseq-train restoring such a checkpoint in this process, hprune reading one)."""
    from fairseq import checkpoint_utils

    original = checkpoint_utils.convert_namespace_to_omegaconf
    checkpoint_utils.convert_namespace_to_omegaconf = to_omegaconf
    try:
        yield
    finally:
        checkpoint_utils.convert_namespace_to_omegaconf = original


def upgrade_checkpoint(state: dict) -> DictConfig:
    """fairseq's checkpoint upgrades (checkpoint_utils._upgrade_state_dict), returning the checkpoint's config."""
    from fairseq import checkpoint_utils

    with legacy_checkpoints_readable():
        return checkpoint_utils._upgrade_state_dict(state)["cfg"]

