"""Recovery: what a cut cost, won back by training the pruned model on (docs/methods.md, "Recovery").

The pruned checkpoint (its heads and FFN neurons physically removed: they cannot come back) continues training with
fairseq-train, as every training in hprune runs (workers, update_freq, resumed from checkpoint_last.pt after a
kill), with one of three losses (`recovery.loss`):
  * ce: the references' label-smoothed cross-entropy (Michel et al.'s fine-tuning after pruning);
  * word: word-level knowledge distillation (Kim & Rush 2016, §3.1): (1 − α)·cross-entropy + α·KL(teacher ‖
    student) at every target position, the teacher the unpruned model (hprune_fairseq's `hprune_distill`);
  * sequence: sequence-level knowledge distillation (Kim & Rush 2016, §3.2): the references of the training split
    replaced by the teacher's beam translations of its sources (translated once, cached under
    <data_root>/distilled/), then cross-entropy on them.
The recovered model is evaluated beside the pruned one and the unpruned one (paired bootstrap against both) and is
a pruned checkpoint like any other: `hprune export ckpt=<recovery/checkpoints/checkpoint_last.pt>`.
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

from . import backend
from .errors import UserError
from .evaluation import Evaluator
from .files import write_json
from .reporting.significance import paired_bootstrap
from .rundir import LAST, PRUNED, RunDir, save_hypotheses

log = logging.getLogger(__name__)
LOSSES = {"ce": "the references' cross-entropy", "word": "word-level distillation from the unpruned teacher",
          "sequence": "sequence-level distillation: the teacher's translations as references"}
RESAMPLES = 1000  # the recovery's paired bootstrap when significance.resamples is 0 (off for curves)
FOLDER = "recovery"
START = "pruned.pt"


def check(r: DictConfig) -> None:
    """One line for recovery settings that cannot run."""
    if r.loss not in LOSSES:
        raise UserError(f"recovery.loss={r.loss} is not a recovery loss; choose one of {', '.join(LOSSES)}")
    if not isinstance(r.updates, int) or r.updates < 0:
        raise UserError(f"recovery.updates={r.updates} must be a whole number >= 0 (0: no recovery)")
    if not 0 <= r.teacher_weight <= 1:
        raise UserError(f"recovery.teacher_weight={r.teacher_weight} must be between 0 and 1 (the KL's share)")
    if not isinstance(r.beam, int) or r.beam < 1:
        raise UserError(f"recovery.beam={r.beam} must be a whole number >= 1")


def start_of(session, mask: Path, out: Path) -> tuple[Path, Path, bool]:
    """What `hprune recover` starts from: (the pruned checkpoint, the mask file, whether it was written here). A
    `hprune prune` run folder's checkpoint_pruned.pt, else the session's model under the mask, physically pruned
    into out/recovery/pruned.pt (once: a resumed recovery finds it)."""
    run = RunDir(mask) if mask.is_dir() else None
    mask_file = run.head_mask if run else mask
    if not mask_file.is_file():
        raise UserError(f"mask={mask} is neither a head_mask.json nor a `hprune prune` run folder holding one; pass "
                        "mask=<run folder or head_mask.json>")
    pruned_from = (run.metrics() or {}).get("checkpoint") if run is not None else None
    if pruned_from and Path(pruned_from).resolve() != session.checkpoint.resolve():
        log.warning("%s pruned %s, not %s: the teacher (and the unpruned model compared with) is another model than "
                    "the one pruned", mask, pruned_from, session.checkpoint)
    if run is not None and run.checkpoint(PRUNED).is_file():
        return run.checkpoint(PRUNED), mask_file, False
    if run is not None:
        log.warning("%s wrote no pruned checkpoint (prune.export=false): recovery starts from this model under its "
                    "mask, without what its method changed besides (tuned scales, trained weights)", mask)
    dest = out / FOLDER / START
    if not dest.is_file():
        session.write_pruned(session.read_mask(mask_file), dest, reopen=False)
    return dest, mask_file, True


def wanted(cfg: DictConfig) -> bool:
    return cfg.get("recovery") is not None and cfg.recovery.updates > 0


def recover(teacher: Evaluator, cfg: DictConfig, start: Path, out: Path) -> dict:
    """Train the pruned checkpoint `start` for recovery.updates updates into out/recovery/ with recovery.loss,
    `teacher` being the unpruned model (as its checkpoint file holds it: not a model a method changed in place);
    evaluate the pruned, recovered and unpruned models and return the recovery's metrics."""
    r = cfg.recovery
    check(r)
    session = teacher.session
    folder = out / FOLDER
    same_recovery(folder, start, session.checkpoint, r)
    results = {"unpruned": teacher.evaluate(None), "pruned": teacher.reopen(start).evaluate(None)}
    data_bin = (distilled(teacher, r.beam, Path(cfg.paths.data_root) / "distilled") if r.loss == "sequence"
                else session.data_bin)
    options = backend.criterion_flags(session.loaded, "hprune_distill" if r.loss == "word" else "hprune")
    if r.loss == "word":
        options += ["--teacher", str(session.checkpoint), "--teacher-weight", str(r.teacher_weight)]
    save = RunDir(folder).checkpoints
    argv = backend.continue_training_argv(backend.read_checkpoint(start), data_bin, save, session.device,
                                          session.precision, cfg.seed,
                                          [*options, *backend.flags(r.optim), "--max-update", str(r.updates),
                                           *backend.tensorboard_flags(cfg, save)])
    started = time.perf_counter()
    with session.parked(folder):  # fairseq-train's student and teacher beside it, not a third copy of the weights
        backend.train(argv, script=folder / "fairseq-train.sh", label="recovery", distributed=cfg.get("distributed"))
    seconds = round(time.perf_counter() - started, 3)
    session.place_beside(save)
    results["recovered"] = teacher.reopen(RunDir(folder).checkpoint(LAST)).evaluate(None)
    for name, result in results.items():
        save_hypotheses(folder, name, result)
    return metrics(cfg, results, seconds, RunDir(folder).checkpoint(LAST), trained_updates(folder))


def same_recovery(folder: Path, start: Path, teacher: Path, r: DictConfig) -> None:
    """A recovery resumes only itself: its folder records what it trains (start, teacher, loss and its settings);
    another recovery in the same folder is refused in one line (its checkpoint_last.pt would be resumed)."""
    what = {"start": str(start.resolve()), "teacher": str(teacher.resolve()), "loss": r.loss,
            **({"teacher_weight": float(r.teacher_weight)} if r.loss == "word" else {}),
            **({"beam": int(r.beam)} if r.loss == "sequence" else {})}
    record = folder / "recovery.json"
    if record.exists():
        before = json.loads(record.read_text())
        if before != what:
            changed = ", ".join(f"{key} {before.get(key)} -> {value}" for key, value in what.items()
                                if before.get(key) != value)
            raise UserError(f"{folder} holds another recovery ({changed}); give this one a run dir of its own "
                            "(hydra.run.dir=...) or delete that folder")
    write_json(record, what)


def metrics(cfg: DictConfig, results: dict, seconds: float, checkpoint: Path, updates: int) -> dict:
    r, sig = cfg.recovery, cfg.get("significance") or {}
    pruned, recovered, unpruned = results["pruned"], results["recovered"], results["unpruned"]
    found = {"recovery_loss": r.loss, "recovery_updates": updates, "recovery_seconds": seconds,
             "recovery_lr": float(r.optim.lr), "recovery_checkpoint": str(checkpoint.absolute()),
             "bleu_before_recovery": pruned.bleu, "bleu_recovered": recovered.bleu, "chrf_recovered": recovered.chrf,
             "valid_loss_before_recovery": pruned.valid_loss, "valid_loss_recovered": recovered.valid_loss,
             "recovery_gain": round(recovered.bleu - pruned.bleu, 4),
             "delta_bleu_recovered": recovered.delta_bleu(unpruned)}
    if r.loss == "word":
        found["recovery_teacher_weight"] = float(r.teacher_weight)
    if r.loss == "sequence":
        found["recovery_beam"] = int(r.beam)
    for name, other in (("pruned", pruned), ("unpruned", unpruned)):
        test = paired_bootstrap(other.hypotheses, recovered.hypotheses, recovered.references,
                                sig.get("resamples") or RESAMPLES, sig.get("seed", 12345), recovered.bleu_tokenize)
        found[f"p_recovered_vs_{name}"] = round(test["p_value"], 4)
        found[f"significant_recovered_vs_{name}"] = test["significant"]
    return found


def versus(m: dict, name: str) -> str:
    """The paired test of the recovered model against the `name`d one (pruned, unpruned), as a summary says it;
    a difference of zero BLEU is said as such (its p: 1 for the same translations, about 0.5 for others)."""
    delta = m["recovery_gain"] if name == "pruned" else m["delta_bleu_recovered"]
    return "the same BLEU" if delta == 0 else f"p = {m[f'p_recovered_vs_{name}']:.4f}"


def trained_updates(folder: Path) -> int:
    """The updates the recovered checkpoint holds (fairseq's count, resumed runs included)."""
    state = backend.read_checkpoint(RunDir(folder).checkpoint(LAST)).state
    return int(state["optimizer_history"][-1]["num_updates"])


def summary(m: dict) -> str:
    return (f"recovered ({m['recovery_loss']}, {m['recovery_updates']} updates, {m['recovery_seconds']:.0f} s): BLEU "
            f"{m['bleu_before_recovery']:.2f} -> {m['bleu_recovered']:.2f} ({versus(m, 'pruned')}; "
            f"{m['delta_bleu_recovered']:+.2f} vs unpruned, {versus(m, 'unpruned')}); "
            f"{m['recovery_checkpoint']}")


# ------------------------------------------------------------------------------------ sequence-level data
def distilled(teacher: Evaluator, beam: int, root: Path) -> Path:
    """The teacher's data with the training split's targets replaced by its beam translations of the sources
    (sequence-level distillation), cached in `root` by teacher, data and generation settings: built once, written
    whole (a folder half built is not taken for one built)."""
    session = teacher.session
    generation = OmegaConf.create(OmegaConf.to_container(teacher.measure.generation, resolve=True))
    with open_dict(generation):
        generation.beam = beam
    ckpt = session.checkpoint
    key = hashlib.sha256(json.dumps([str(ckpt.resolve()), ckpt.stat().st_size, ckpt.stat().st_mtime_ns,
                                     str(session.data_bin.resolve()), OmegaConf.to_container(generation)],
                                    sort_keys=True).encode()).hexdigest()[:12]
    dest = root / f"{session.data_bin.parent.name}-{key}"
    if (dest / "done").exists():
        return dest
    log.info("sequence-level distillation: the teacher translates the training split (beam %d) -> %s", beam, dest)
    with session.masked(None):
        result = backend.translate(session.loaded, generation, "train", teacher.measure.seed)
    backend.write_targets(session.data_bin, dest, "train", session.loaded, result.symbols)
    return dest
