"""Binarizing and training through fairseq's own entry points (fairseq-preprocess, fairseq-train), in this
process or with fairseq's data parallelism over several (backend/distributed.py), resumable; checkpoint
summaries and averaging."""
from __future__ import annotations

import contextlib
import gc
import logging
import os
import shlex
import shutil
import zipfile
from pathlib import Path
from typing import Dict, Optional, Sequence

import torch
from fairseq import options
from omegaconf import DictConfig

from hprune_fairseq.safe_load import CorruptCheckpointError, load_checkpoint

from ..console import training_progress
from ..errors import JobFailed, UserError
from ..files import replaced_atomically, write_atomic
from ..launch import is_rank_zero, launched, worker_threads
from ..rundir import AVERAGED, LAST
from .compat import forget_best_checkpoint, freed_blocks_returned, frozen_heap, legacy_checkpoints_readable, to_omegaconf
from .distributed import init_timeout, join_slurm_step, plan, process_group_timeout, rank_flags, start_workers

log = logging.getLogger(__name__)


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


def write_targets(data_bin: Path, dest: Path, split: str, loaded, targets: Sequence[Sequence[str]]) -> None:
    """A copy of `data_bin` (its files linked) whose `split` has `targets` (target symbols, one list a sentence in
    the split's order, without eos) in place of its own, encoded with loaded's target dictionary: fairseq's
    mmap indexed dataset, as fairseq-preprocess writes it. Built in a folder beside dest, renamed when whole."""
    from fairseq.data import indexed_dataset

    src, tgt = loaded.cfg.task.source_lang, loaded.cfg.task.target_lang
    dictionary = loaded.task.target_dictionary
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        replaced = {f"{split}.{src}-{tgt}.{tgt}.bin", f"{split}.{src}-{tgt}.{tgt}.idx"}
        for item in data_bin.iterdir():
            if item.name not in replaced:
                (tmp / item.name).symlink_to(item.resolve())
        stem = tmp / f"{split}.{src}-{tgt}.{tgt}"
        builder = indexed_dataset.make_builder(f"{stem}.bin", impl="mmap", vocab_size=len(dictionary))
        for symbols in targets:
            builder.add_item(torch.IntTensor([dictionary.index(s) for s in symbols] + [dictionary.eos()]))
        builder.finalize(f"{stem}.idx")
        (tmp / "done").write_text("")
        if not (dest / "done").exists():  # (else another job built it meanwhile, and may be reading it)
            shutil.rmtree(dest, ignore_errors=True)  # a folder half built by a killed job
            os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def train(argv: Sequence[str], script: Optional[Path] = None, label: str = "train",
          distributed: Optional[DictConfig] = None) -> dict:
    """Run fairseq-train: in this process, as one of the workers a launcher started, or with this node's workers
    started here (backend/distributed.py; `distributed`: world_size, batch, port). It resumes from
    `checkpoint_last.pt` in the save dir if there is one. `script`: also write the equivalent command line there
    (fairseq-train.sh in a run dir); `label`: its progress bar's. Returns the workers, the batch they make and
    the training speed (rank 0's view: the speed of all workers together)."""
    args = options.parse_args_and_arch(options.get_training_parser(), input_args=list(argv))
    workers = plan(distributed, args)
    timeout = init_timeout(distributed)
    set_here = {flag for flag in workers.flags if flag.startswith("--")}
    argv = [*_without(argv, *set_here), *workers.flags]  # each worker's update_freq (and share of max_tokens)
    if script is not None and is_rank_zero():
        launcher = {"": ["torchrun", "--standalone", f"--nproc-per-node={workers.world_size}"], "torchrun": ["torchrun"],
                    "slurm": ["srun"]}[launched().launcher] if workers.world_size > 1 else []
        write_atomic(script, shlex.join([*launcher, "fairseq-train", *argv]) + "\n")
    log.info("%s: fairseq-train, %s updates, %d worker(s) -> %s", label, args.max_update or "all", workers.world_size,
             args.save_dir)
    speed = (start_workers(argv, workers.world_size, label, timeout) if workers.starts_workers
             else run_worker(argv, label, timeout))
    gc.collect()  # fairseq's trainer (model, gradients, Adam's moments) is held in cycles: freed now, not at the
    # next full collection, before the caller loads what it wrote
    update_freq = workers.update_freq if len(workers.update_freq) > 1 else workers.update_freq[0]
    return {"workers": workers.world_size, "update_freq": update_freq,
            "max_tokens_per_update": workers.max_tokens_per_update, **speed}


def _without(argv: Sequence[str], *flags: str) -> list:
    """argv without `flags` and their values (flags that take one value)."""
    drop = {i + k for i, arg in enumerate(argv) if arg in flags for k in (0, 1)}
    return [arg for i, arg in enumerate(argv) if i not in drop]


def run_worker(argv: Sequence[str], label: str, timeout: float) -> dict:
    """fairseq-train in this process, as the only worker or as the one the launcher's variables say; its speed.
    A worker of several that fails writes its traceback to `worker-<rank>.traceback` beside the save dir, which
    its one line names; `timeout`: how long a collective waits for a peer (seconds)."""
    from fairseq import distributed_utils

    workers = launched()
    if workers.launcher and not os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(worker_threads())  # the CPUs of this task, shared with the node's other workers
    args = options.parse_args_and_arch(options.get_training_parser(),
                                       input_args=[*argv, *rank_flags(cpu="--cpu" in argv)])
    freed_blocks_returned(max(getattr(args, "encoder_embed_dim", 0) or 0, getattr(args, "decoder_embed_dim", 0) or 0))
    forget_best_checkpoint()  # of an earlier training in this process
    cfg = to_omegaconf(args)
    if workers.launcher == "slurm":
        join_slurm_step(cfg.distributed_training, cpu=bool(args.cpu))
    several = cfg.distributed_training.distributed_world_size > 1
    bar = training_progress(label, cfg.optimization.max_update or None) if is_rank_zero() else contextlib.nullcontext()
    with frozen_heap(), bar, process_group_timeout(timeout):
        try:
            distributed_utils.call_main(cfg, _train_once_joined, label=label)
        except UserError:
            raise
        except Exception as err:  # of several workers: a peer may have died (gloo says so, NCCL times out)
            if not several:
                raise
            logging.getLogger("worker").warning("this worker stopped", exc_info=True)  # the log file's
            written = _write_traceback(Path(args.save_dir), workers.rank)
            reason = (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
            raise JobFailed(f"worker {workers.rank} of {workers.world_size} stopped ({reason}; its traceback: "
                            f"{written}); if another worker died, its traceback is beside it; the checkpoints are kept: "
                            "run the same command again to resume from the last one") from None
    return train_speed()


def _write_traceback(save_dir: Path, rank: int) -> Path:
    """The current exception's traceback, for a worker whose terminal output nobody may see (SLURM tasks,
    torchrun workers, hprune's own launch): `worker-<rank>.traceback` beside the save dir (in the run dir)."""
    import traceback

    path = save_dir.parent / f"worker-{rank}.traceback"
    try:
        write_atomic(path, traceback.format_exc())
    except OSError:
        return Path("(not written: the run dir is not writable)")
    return path


def _train_once_joined(cfg, label: str) -> None:
    """fairseq-train's main once the workers have met: rank 0 repairs the resume point and tells the others how
    many updates it holds. A run stopped after its last checkpoint trains nothing: fairseq would resume with one
    update too many."""
    from fairseq import distributed_utils
    from fairseq.logging import metrics
    from fairseq_cli import train as fairseq_train

    save_dir = Path(cfg.checkpoint.save_dir)
    resumed = [repair_resume_point(save_dir) if distributed_utils.is_master(cfg.distributed_training) else None]
    if torch.distributed.is_initialized():
        torch.distributed.broadcast_object_list(resumed, src=0)
        agree_on_resume_point(save_dir, resumed[0])
    max_update = cfg.optimization.max_update
    if max_update and resumed[0] is not None and resumed[0] >= max_update:
        log.info("%s: %s already holds all %d updates", label, save_dir, max_update)
        metrics.reset()  # no speed to report for this call
        return
    with legacy_checkpoints_readable(), starting_model_mapped(save_dir):  # training may start from a legacy
        fairseq_train.main(cfg)  # checkpoint (an imported Hugging Face model)


@contextlib.contextmanager
def starting_model_mapped(save_dir: Path):
    """fairseq-train reads the model it continues from (--restore-file, outside the save dir) mapped, not into
    memory: its state dict is page cache the system can take back while the trainer's model, gradients and Adam's
    moments are built beside it (NLLB-1.3B's 5.5 GB).
    A resume point in the save dir is read as before: fairseq copies over it in place while Adam's moments, loaded
    from it, would still be mapped."""
    original = torch.load

    def load(f, *args, **kwargs):
        name = getattr(f, "name", f)
        if isinstance(name, (str, Path)) and not Path(name).resolve().is_relative_to(save_dir.resolve()) \
                and "mmap" not in kwargs and zipfile.is_zipfile(name):
            return original(name, *args, mmap=True, **kwargs)
        return original(f, *args, **kwargs)

    torch.load = load
    try:
        yield
    finally:
        torch.load = original


def agree_on_resume_point(save_dir: Path, rank_zero: Optional[int]) -> None:
    """Every worker resumes from the checkpoint it reads itself: they must all see rank 0's (the updates it
    holds, or none). A worker that sees another (a node-local disk, a copy out of date) ends every worker with
    one line, before anything is trained."""
    last = save_dir / LAST
    mine = None
    if last.exists():
        try:
            mine = _updates(load_checkpoint(last))
        except CorruptCheckpointError:
            mine = "unreadable"
    views = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(views, mine)
    differ = {rank: view for rank, view in enumerate(views) if view != rank_zero}
    if differ:
        def say(view) -> str:
            return "no checkpoint_last.pt" if view is None else (
                "an unreadable checkpoint_last.pt" if view == "unreadable" else f"checkpoint_last.pt at {view} updates")
        seen = ", ".join(f"rank {rank} {say(view)}" for rank, view in sorted(differ.items())[:4])
        raise UserError(f"the workers see different resume points in {save_dir}: rank 0 {say(rank_zero)}, {seen}; "
                        "the run dir must be on a file system every node shares (or copy it to each node as it is)")


def repair_resume_point(save_dir: Path) -> Optional[int]:
    """Make sure a killed run resumes: drop half-written files and a truncated `checkpoint_last.pt`. Returns
    the updates the resume point holds (None: training starts afresh).

    fairseq writes each checkpoint to a temporary name and renames it, but then *copies* it to
    `checkpoint_last.pt`; a kill during that copy leaves a truncated file. We then fall back on the
    newest readable interval checkpoint, which is the same state.
    """
    for partial in save_dir.glob("*.tmp"):
        partial.unlink()
    last = save_dir / LAST
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
    with replaced_atomically(dest) as tmp:
        torch.save(state, tmp)
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
