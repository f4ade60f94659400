"""What the methods that train share (Voita's gates, DSP): continuing a checkpoint's training with fairseq-train
(so the same command resumes an interrupted run), reading the trained gates out as a head mask, the metrics
every such run reports, and the options after it: fine-tuning with the mask fixed, and the physical export.
`outcome`, the mask's and its evaluation's metrics, serves every procedure (fisher's too). A model here is an
evaluation.Evaluator: the opened session and how it is measured."""
from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Iterator

import pandas as pd
from omegaconf import DictConfig

from .. import backend
from ..deploy.fairseq_checkpoint import write_checked
from ..evaluation import Evaluation, Evaluator
from ..files import write_json
from ..pruning.heads import kept_columns, layer_floor, mask_without, per_stack_kept, pool_of, scores_by_head
from ..registry import shared_with_workers
from ..rundir import LAST, PRUNED, RunDir, model_provenance, save_hypotheses
from .training import continue_training_argv, finetune


@contextlib.contextmanager
def train(start: Evaluator, cfg: DictConfig, options: list, out: Path, label: str) -> Iterator[tuple[Evaluator, float]]:
    """fairseq-train from start's checkpoint with the hprune criterion, `options` and prune.optim: the trained
    model, reopened on start's data (its gates still in), and the seconds the training took (this process's
    share, if it resumed). The start's weights stay parked on disk until the block ends (the trained model is read
    out beside it: at NLLB-1.3B the two with what training left in the heap do not fit 24 GiB); what the start's
    metrics take from its weights (its units' MACs, its parameter count) is counted before."""
    save = RunDir(out).checkpoints
    plugins = shared_with_workers()
    if plugins:  # a mechanism registered outside hprune: the checkpoint records where it comes from
        options = options + ["--plugin-modules", ",".join(plugins)]
    argv = continue_training_argv(start.session, save, cfg.seed, "hprune", options + backend.flags(cfg.prune.optim))
    started = time.perf_counter()
    with start.parked(out):  # the trainer's model beside it, not a second copy of the weights
        backend.train(argv, script=out / "fairseq-train.sh", label=label, distributed=cfg.get("distributed"))
        seconds = round(time.perf_counter() - started, 3)
        yield start.reopen(RunDir(out).checkpoint(LAST)), seconds


def unpruned(start: Evaluator, cfg: DictConfig, out: Path) -> tuple[set, Evaluation]:
    """The pool of prune.types' heads and the start's evaluation (its translations saved), before any training."""
    result = start.evaluate(None)
    save_hypotheses(out, "unpruned", result)
    return pool_of(start.session.model, cfg.prune.types), result


def read_out(trained: Evaluator, table: pd.DataFrame, score: str, p: DictConfig, out: Path):
    """The read-out `table` (type, layer, head, kept, and the column `score`) under prune.layout; then fold the
    kept heads' gates into the weights (Session.fold_mechanisms: the ungated model computes what the gated one did in
    eval mode), mask the closed heads and evaluate: (the table, closed heads, mask, evaluation); head_mask.json
    and the translations written.

    per_stack: of the per_stack head sets (pruning/heads.per_stack_kept) that keep no more heads than the gates
    do, the one keeping the most, then the highest total `score`; `kept_free` records the read-out before it. A
    head the layout keeps whose gate is 0 is reopened at its full output (Session.fold_mechanisms)."""
    if p.layout == "per_stack":
        by_head = scores_by_head(table, score)
        kept = per_stack_kept(set(by_head), by_head, layer_floor(p.layout, 0), int(table["kept"].sum()))
        table = table.assign(kept_free=table["kept"], kept=[int(head in kept) for head in by_head])
    closed = {(r.type, int(r.layer), int(r.head)) for r in table.itertuples() if not r.kept}
    mask = trained.session.fold_mechanisms(mask_without(trained.session.model, closed))
    result = trained.evaluate(mask)
    save_hypotheses(out, "pruned", result)
    write_json(RunDir(out).head_mask, mask)
    return table, closed, mask, result


def outcome(evaluator: Evaluator, types, pool: set, closed: set, mask: dict, result: Evaluation,
            unpruned: Evaluation) -> dict:
    """The metrics of a procedure's mask and of its evaluation against the unpruned model's."""
    return {
        "bleu": result.bleu, "bleu_unpruned": unpruned.bleu, "delta_bleu": result.delta_bleu(unpruned),
        "chrf": result.chrf, "valid_loss": result.valid_loss, "valid_loss_unpruned": unpruned.valid_loss,
        "bleu_signature": result.bleu_signature, "heads_pool": len(pool), "heads_pruned": len(closed),
        "kept_heads": len(pool) - len(closed), "pct_pruned": round(100 * len(closed) / len(pool), 2),
        **kept_columns(mask), "attention_macs_pct": evaluator.attention_macs_pct(mask, list(types)),
    }


def metrics(start: Evaluator, cfg: DictConfig, pool: set, closed: set, mask: dict, result: Evaluation,
            unpruned: Evaluation, seconds: float) -> dict:
    """The metrics every trained run reports; `seconds`: the training's (what finding the mask cost)."""
    p = cfg.prune
    return {
        "method": p.method, "layout": p.layout, "split": cfg.split, "types": list(p.types), "updates": int(p.optim.max_update),
        "seconds": seconds, **outcome(start, p.types, pool, closed, mask, result, unpruned), **model_provenance(start.session),
    }


def finetune_and_export(start: Evaluator, trained: Evaluator, cfg: DictConfig, mask: dict, result: Evaluation,
                        unpruned: Evaluation, out: Path) -> dict:
    """prune.finetune.updates > 0: Adam updates with the mask fixed, then BLEU again; prune.export: the physically
    pruned checkpoint of the final weights. Their metrics."""
    p, found = cfg.prune, {}
    if p.finetune.updates:
        finetune(trained.session, mask, p.finetune.updates, p.finetune.lr, p.finetune.max_tokens, cfg.seed)
        result = trained.evaluate(mask)
        save_hypotheses(out, "finetuned", result)
        found.update(finetune_updates=p.finetune.updates, bleu_finetuned=result.bleu,
                     delta_bleu_finetuned=result.delta_bleu(unpruned), valid_loss_finetuned=result.valid_loss)
    if p.export:
        found.update(write_checked(trained, mask, RunDir(out).checkpoint(PRUNED), result,
                                   config_from=start.session.checkpoint))
    return found


def export_lines(m: dict) -> list:
    """The summary lines of finetune_and_export's metrics."""
    lines = []
    if "bleu_finetuned" in m:
        lines.append(f"fine-tuned {m['finetune_updates']} updates with the mask fixed: BLEU {m['bleu_finetuned']:.2f}")
    if "export_checkpoint" in m:
        lines.append(f"pruned checkpoint: {m['export_checkpoint']} ({m['params_removed_pct']} % fewer parameters, "
                     f"{m['macs_removed_pct']} % fewer MACs per token, BLEU {m['export_bleu']:.2f}, max |diff| "
                     f"{m['export_max_abs_diff']:.1e})")
    return lines
