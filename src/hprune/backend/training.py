"""Binarizing and training in this process through fairseq's own entry points (fairseq-preprocess,
fairseq-train), resumable; checkpoint summaries and averaging."""
from __future__ import annotations

import logging
import os
import shlex
import shutil
from pathlib import Path
from typing import Dict, Optional, Sequence

import torch
from fairseq import options

from hprune_fairseq.safe_load import CorruptCheckpointError, load_checkpoint

from ..console import training_progress
from ..errors import UserError
from ..files import write_atomic
from .compat import frozen_heap, to_omegaconf

log = logging.getLogger(__name__)
AVERAGED = "checkpoint_averaged.pt"


def binarize(text_dir: Path, dest_dir: Path, src: str, tgt: str, workers: int = 1, joined: bool = True,
             test_splits: Sequence[str] = ("test",), splits: Sequence[str] = ("train", "valid"),
             dictionaries: Optional[tuple[Path, Path]] = None) -> None:
    """fairseq-preprocess of `text_dir/{train,valid,test...}.{src,tgt}`; a joined dictionary (for shared
    embeddings) unless joined=False. Several test sets become splits test, test1, test2 (fairseq's naming).
    dictionaries: a model's own (source, target) dict.*.txt to encode with (`--srcdict/--tgtdict`) instead of
    building them; then any of the splits may be absent."""
    from fairseq_cli import preprocess

    argv = ["--source-lang", src, "--target-lang", tgt, "--destdir", str(dest_dir),
            "--workers", str(workers), "--thresholdsrc", "0", "--thresholdtgt", "0"]
    argv += [arg for split in splits for arg in (f"--{split}pref", str(text_dir / split))]
    if dictionaries is not None:
        argv += ["--srcdict", str(dictionaries[0]), "--tgtdict", str(dictionaries[1])]
    elif joined:
        argv.append("--joined-dictionary")
    if test_splits:
        argv += ["--testpref", ",".join(str(text_dir / split) for split in test_splits)]
    args = options.get_preprocessing_parser().parse_args(argv)
    handlers = list(preprocess.logger.handlers)
    try:
        preprocess.main(args)
    finally:  # preprocess adds a log-file handler per call
        for handler in preprocess.logger.handlers[len(handlers):]:
            preprocess.logger.removeHandler(handler)
            handler.close()


def train(argv: Sequence[str], script: Optional[Path] = None, label: str = "train") -> None:
    """Run fairseq-train in this process. It resumes from `checkpoint_last.pt` in the save dir if there is one.
    `script`: also write the equivalent command line there (fairseq-train.sh in a run dir); `label`: its
    progress bar's."""
    from fairseq import checkpoint_utils, distributed_utils
    from fairseq_cli import train as fairseq_train

    if script is not None:
        write_atomic(script, shlex.join(["fairseq-train", *argv]) + "\n")
    args = options.parse_args_and_arch(options.get_training_parser(), input_args=list(argv))
    resumed_updates = repair_resume_point(Path(args.save_dir))
    # fairseq keeps the best validation loss on the function object: a second training in this process (the
    # from-scratch control after gated training) would otherwise never write its checkpoint_best.pt
    vars(checkpoint_utils.save_checkpoint).pop("best", None)
    cfg = to_omegaconf(args)
    if cfg.optimization.max_update and resumed_updates is not None and resumed_updates >= cfg.optimization.max_update:
        # a run stopped after its last checkpoint: fairseq would resume with one update too many
        log.info("%s: %s already holds all %d updates", label, args.save_dir, cfg.optimization.max_update)
        from fairseq.logging import metrics
        metrics.reset()  # no speed to report for this call
        return
    log.info("%s: fairseq-train, %s updates -> %s", label, cfg.optimization.max_update or "all", args.save_dir)
    with frozen_heap(), training_progress(label, cfg.optimization.max_update or None):
        distributed_utils.call_main(cfg, fairseq_train.main)


def repair_resume_point(save_dir: Path) -> Optional[int]:
    """Make sure a killed run resumes: drop half-written files and a truncated `checkpoint_last.pt`. Returns
    the updates the resume point holds (None: training starts afresh).

    fairseq writes each checkpoint to a temporary name and renames it, but then *copies* it to
    `checkpoint_last.pt`; a kill during that copy leaves a truncated file. We then fall back on the
    newest readable interval checkpoint, which is the same state.
    """
    for partial in save_dir.glob("*.tmp"):
        partial.unlink()
    last = save_dir / "checkpoint_last.pt"
    if not last.exists():
        return None
    try:
        return _updates(load_checkpoint(last))
    except CorruptCheckpointError:
        log.warning("%s is truncated; resuming from the newest interval checkpoint instead", last)
    candidates = sorted(save_dir.glob("checkpoint_*_*.pt"), key=lambda p: p.stat().st_mtime, reverse=True)
    for candidate in candidates:
        try:
            updates = _updates(load_checkpoint(candidate))
        except CorruptCheckpointError:
            continue
        shutil.copyfile(candidate, last.with_suffix(".pt.tmp"))
        os.replace(last.with_suffix(".pt.tmp"), last)
        return updates
    last.unlink()  # nothing readable: start over rather than crash
    return None


def _updates(state: dict) -> int:
    return state["optimizer_history"][-1]["num_updates"]


def train_speed() -> dict:
    """fairseq's whole-run meters (the root aggregator is never reset): target tokens/s and updates/s,
    validation and checkpointing pauses included; None when the last call trained nothing."""
    from fairseq.logging import metrics

    values = metrics.get_smoothed_values("default")
    return {"train_tokens_per_s": round(float(values["wps"]), 1) if "wps" in values else None,
            "train_updates_per_s": round(float(values["ups"]), 3) if "ups" in values else None}


def checkpoint_summary(ckpt: Path) -> dict:
    """Updates, epoch, best validation loss and parameter count recorded in a checkpoint."""
    state = load_checkpoint(ckpt)
    storages = {t.untyped_storage().data_ptr(): t.numel() for t in state["model"].values()}  # tied weights once
    extra = state.get("extra_state") or {}
    return {"num_updates": _updates(state),
            "epoch": (extra.get("train_iterator") or {}).get("epoch"),
            "best_valid_loss": extra.get("best"),
            "valid_loss": extra.get("val_loss"),
            "n_params": sum(storages.values())}


def save_checkpoint_atomic(state: dict, dest: Path) -> Path:
    """torch.save under a temporary name beside `dest`, then rename: no reader sees half a checkpoint."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    torch.save(state, tmp)
    os.replace(tmp, dest)
    return dest


def average_checkpoints(save_dir: Path, last: int) -> Path:
    """Average the parameters of the last `last` epoch checkpoints (checkpoint<epoch>.pt) into
    checkpoint_averaged.pt, as fairseq's scripts/average_checkpoints.py --num-epoch-checkpoints does.
    Fewer epochs than asked for are averaged as they are (and said so)."""
    epochs = sorted((int(p.stem[len("checkpoint"):]), p) for p in save_dir.glob("checkpoint[0-9]*.pt")
                    if p.stem[len("checkpoint"):].isdigit())
    chosen = [p for _, p in epochs[-last:]]
    if not chosen:
        raise UserError(f"no epoch checkpoints in {save_dir} to average; train for at least one epoch")
    if len(chosen) < last:
        log.warning("averaging %d epoch checkpoints, not %d: training ran %d epochs", len(chosen), last, len(chosen))
    total: Dict[str, torch.Tensor] = {}
    for path in chosen:
        for name, tensor in load_checkpoint(path)["model"].items():
            value = tensor.double() if tensor.is_floating_point() else tensor
            total[name] = total[name] + value if name in total and tensor.is_floating_point() else value
    state = load_checkpoint(chosen[-1])
    state["model"] = {name: (value / len(chosen)).to(state["model"][name].dtype) if value.is_floating_point()
                      else value for name, value in total.items()}
    state["last_optimizer_state"] = None
    state.setdefault("extra_state", {})["averaged_checkpoints"] = [p.name for p in chosen]
    return save_checkpoint_atomic(state, save_dir / AVERAGED)
