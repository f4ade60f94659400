"""`hprune prune --method michel ckpt=PATH`: score heads, prune them cumulatively, measure BLEU at each step.

Flow: score the heads (head_importance.csv) -> optional ablations on the unpruned model -> the pruning curve
for the method's order and any baseline orders (curve.csv/.md) -> pick a mask (head_mask.json) -> optionally
remove its heads physically (checkpoints/checkpoint_pruned.pt) and check it against the masked model.
metrics.json is written last: a run without it did not finish.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional, Set

import pandas as pd
import torch
from omegaconf import DictConfig

from ..data.prepare import prepare
from ..errors import UserError
from ..files import git_sha, run_dir, write_atomic, write_json
from ..pruning import scores
from ..pruning.heads import (
    ATTENTION_TYPES,
    Head,
    Mask,
    check_types,
    extend_pruned,
    heads_to_prune,
    kept_columns,
    kept_ids,
    mask_without,
    max_prunable,
    michel_id,
    moa_types,
    present_heads,
    ranked,
)
from ..reporting import plots
from ..reporting.tables import markdown
from . import hydra_app
from .evaluate import resolve_checkpoint, translate_and_score

log = logging.getLogger(__name__)
ABLATIONS = ("single", "one_head")


def check_settings(p: DictConfig) -> List[float]:
    """Refuse bad settings before any work; returns the curve's percentages."""
    for method in [p.method, *p.baselines]:
        if method not in scores.METHODS:  # voita has its own runner
            raise UserError(f"unknown pruning order '{method}'; choose from {', '.join(scores.METHODS)}")
    check_types(p.types)
    unknown = [a for a in p.ablations if a not in ABLATIONS]
    if unknown:
        raise UserError(f"unknown ablation(s) {unknown}; choose from {', '.join(ABLATIONS)}")
    if not 0 < p.step_pct <= 100:
        raise UserError(f"prune.step_pct={p.step_pct} is outside (0, 100]; use e.g. prune.step_pct=10")
    if p.target_pct is not None and not 0 <= p.target_pct <= 100:
        raise UserError(f"prune.target_pct={p.target_pct}: cannot prune more heads than exist; use 0..100 "
                        "(a percentage of the heads of prune.types)")
    if p.importance.max_batches is not None and p.importance.max_batches < 1:
        raise UserError(f"prune.importance.max_batches={p.importance.max_batches} leaves no data to score heads "
                        "on; use null (the whole split) or a positive number")
    if p.min_heads_per_layer < 0 or p.finetune.updates < 0 or p.max_bleu_drop < 0:
        raise UserError("prune.min_heads_per_layer, prune.finetune.updates and prune.max_bleu_drop must be >= 0")
    steps = [i * p.step_pct for i in range(int(100 // p.step_pct) + 1) if i * p.step_pct < 100]
    return sorted(set(steps) | ({p.target_pct} if p.target_pct is not None else set()))


@dataclass
class Pruning:
    """One prune run's model, data and settings, and the measurements all steps share."""
    cfg: DictConfig
    loaded: object  # backend.Loaded
    criterion: object
    data_bin: Path
    pool: Set[Head]
    max_tokens: int  # per batch, for validation losses

    @property
    def p(self) -> DictConfig:
        return self.cfg.prune

    @property
    def model(self):
        return self.loaded.model

    def scores(self, method: str) -> pd.DataFrame:
        from .. import backend

        dictionary = self.loaded.task.target_dictionary
        imp = self.p.importance
        batches = backend.batches(self.loaded, imp.split, imp.max_tokens, imp.max_batches)
        if method == "michel":
            table, _ = scores.michel(self.model, self.criterion, batches, dictionary.pad())
            return scores.normalize_by_layer(table) if imp.normalize_by_layer else table
        if method == "confidence":
            return scores.confidence(self.model, batches, dictionary.pad(), dictionary.eos())
        if method == "magnitude":
            return scores.magnitude(self.model)
        return scores.random(self.model, self.cfg.seed)

    def evaluate(self, mask: Mask) -> dict:
        from .. import backend

        self.model.set_head_mask(mask)
        result, quality = translate_and_score(self.cfg, self.loaded, self.data_bin)
        loss = backend.split_loss(self.loaded, self.criterion, self.cfg.loss_split, self.max_tokens)
        return {"bleu": quality["bleu"], "chrf": quality["chrf"], "bleu_signature": quality["bleu_signature"],
                "valid_loss": round(loss["loss"], 4),
                "sentences_per_s": round(result.sentences / result.seconds, 2), "hypotheses": result.hypotheses}


def cpu_copy(model) -> dict:
    return {name: tensor.detach().cpu().clone() for name, tensor in model.state_dict().items()}


def ablations(run: Pruning, importance: pd.DataFrame, unpruned: dict, out: Path) -> None:
    """Michel et al.'s two ablations on the unpruned model: every head removed alone; every layer reduced to
    its most important head."""
    def row(mask: Mask, **where) -> dict:
        result = run.evaluate(mask)
        return {**where, "bleu": result["bleu"], "delta_bleu": round(result["bleu"] - unpruned["bleu"], 4),
                "valid_loss": result["valid_loss"]}

    if "single" in run.p.ablations:
        rows = [row(mask_without(run.model, {head}), type=head[0], layer=head[1], head=head[2], id=michel_id(head))
                for head in present_heads(run.model) if head in run.pool]
        write_atomic(out / "ablation_single.csv", pd.DataFrame(rows).to_csv(index=False))
    if "one_head" in run.p.ablations:
        rows = []
        heads_in_table = importance[["type", "layer", "head"]].itertuples(index=False, name=None)
        in_pool = pd.Series([head in run.pool for head in heads_in_table], index=importance.index)
        for kind in ATTENTION_TYPES:
            for layer, heads in importance[in_pool & (importance["type"] == kind)].groupby("layer"):
                top = int(heads.sort_values(["importance", "head"], ascending=[False, True])["head"].iloc[0])
                others = {(kind, int(layer), int(h)) for h in heads["head"] if h != top}
                rows.append(row(mask_without(run.model, others), type=kind, layer=int(layer), kept_head=top,
                                heads_removed=len(others)))
        write_atomic(out / "ablation_one_head.csv", pd.DataFrame(rows).to_csv(index=False))


def curve(run: Pruning, method: str, steps: List[float], unpruned: dict, initial_state: Optional[dict],
          on_row: Callable[[list], None], candidate: Callable[[dict], bool]) -> tuple[list, Optional[tuple]]:
    """Prune cumulatively in the method's order. Returns the rows and the last step that is a `candidate`
    for head_mask.json, as (row, its evaluation, mask, weights after fine-tuning or None)."""
    from .. import backend

    p = run.p
    if initial_state is not None:  # fine-tuning changed the weights: every order starts from the checkpoint
        run.model.load_state_dict(initial_state)
    run.model.set_head_mask(None)
    table = run.scores(method)
    pruned: Set[Head] = set()
    rows, chosen = [], None
    for step, pct in enumerate(steps):
        n = heads_to_prune(len(run.pool), pct)
        if p.reestimate and pruned:
            run.model.set_head_mask(mask_without(run.model, pruned))
            table = run.scores(method)
        pruned = extend_pruned(table, pruned, n, run.pool, p.min_heads_per_layer)
        mask = mask_without(run.model, pruned)
        if p.finetune.updates and n:
            run.model.set_head_mask(mask)
            backend.finetune(run.loaded, run.criterion, p.finetune.updates, p.finetune.lr, p.finetune.max_tokens,
                             run.cfg.seed + step)
        result = unpruned if n == 0 else run.evaluate(mask)
        row = {"order": method, "step": step, "pct_target": pct, "heads_pruned": n,
               "pct_pruned": round(100 * n / len(run.pool), 2), **kept_columns(mask), "bleu": result["bleu"],
               "delta_bleu": round(result["bleu"] - unpruned["bleu"], 4), "chrf": result["chrf"],
               "valid_loss": result["valid_loss"]}
        rows.append(row)
        on_row(rows)
        if candidate(row):
            chosen = (row, result, mask, cpu_copy(run.model) if p.finetune.updates else None)
    return rows, chosen


def export(run: Pruning, mask: Mask, masked: dict, weights: Optional[dict], out: Path,
           config_from: Optional[Path] = None) -> dict:
    """Physically remove the masked heads, reload the written checkpoint, and check it against the masked
    model (`masked`: Pruning.evaluate of that mask); config_from: see backend.export_pruned."""
    from .. import backend

    if weights is not None:
        run.model.load_state_dict(weights)  # the fine-tuned weights of the chosen step
    path = out / "checkpoints" / "checkpoint_pruned.pt"
    backend.export_pruned(run.loaded, kept_ids(mask), path, config_from)
    pruned = backend.load_model(path, run.data_bin, run.cfg.device, run.cfg.precision)
    sample = next(backend.batches(run.loaded, run.cfg.loss_split, run.max_tokens, 1))
    with torch.no_grad():
        run.model.set_head_mask(mask)
        reference = run.model(**sample["net_input"])[0].float()
        difference = (pruned.model(**sample["net_input"])[0].float() - reference).abs().max().item()
    pruned_run = Pruning(run.cfg, pruned, run.criterion, run.data_bin, run.pool, run.max_tokens)
    result = pruned_run.evaluate(None)
    if result["hypotheses"] != masked["hypotheses"]:
        log.warning("the physically pruned model's translations differ from the masked model's")
    n_params, n_params_pruned = backend.count_parameters(run.model), backend.count_parameters(pruned.model)
    return {"export_checkpoint": str(path.absolute()), "export_max_abs_diff": difference,
            "export_bleu": result["bleu"], "export_same_translations": result["hypotheses"] == masked["hypotheses"],
            "n_params_pruned": n_params_pruned, "params_removed_pct": round(100 * (1 - n_params_pruned / n_params), 2),
            "sentences_per_s_masked": masked["sentences_per_s"], "sentences_per_s_pruned": result["sentences_per_s"]}


def run(cfg: DictConfig) -> dict:
    from .. import backend  # imports fairseq, which fills Hydra's config store: only once composed

    p = cfg.prune
    if p.method == "voita":  # gates trained with an L0 penalty: a different procedure, same verb and outputs
        from .voita import run as run_voita
        return run_voita(cfg)
    steps = check_settings(p)
    ckpt = resolve_checkpoint(cfg.ckpt)
    data_bin = prepare(cfg.data, cfg.paths.data_root)
    loaded = backend.load_model(ckpt, data_bin, cfg.device, cfg.precision)
    pool = {head for head in present_heads(loaded.model) if head[0] in p.types}
    experts = sorted(moa_types(loaded.model) & set(p.types))
    if experts and "confidence" in (p.method, *p.baselines):
        raise UserError(f"confidence needs per-head attention maps, which the MoA experts of {', '.join(experts)} "
                        "do not have; rank experts with michel, magnitude or random (prune.baselines=...)")
    if max(steps) > 0 and heads_to_prune(len(pool), max(steps)) > max_prunable(pool, p.min_heads_per_layer):
        raise UserError(f"{max(steps)} % of the {len(pool)} heads of {', '.join(p.types)} is more than can be pruned "
                        f"with prune.min_heads_per_layer={p.min_heads_per_layer}; lower prune.step_pct's range, "
                        "prune.target_pct or that minimum")
    run_ = Pruning(cfg, loaded, backend.build_criterion(loaded), data_bin, pool, p.importance.max_tokens)
    out = run_dir()

    importance = ranked(run_.scores(p.method))
    importance.insert(3, "id", [michel_id(h) for h in importance[["type", "layer", "head"]].itertuples(index=False, name=None)])
    write_atomic(out / "head_importance.csv", importance.sort_values(["type", "layer", "head"]).to_csv(index=False))
    plots.head_heatmaps(importance, "importance", out / "head_importance.png", f"{p.method} head scores")

    unpruned = run_.evaluate(mask_without(loaded.model, set()))
    initial_state = cpu_copy(loaded.model) if p.finetune.updates else None
    if p.ablations:
        ablations(run_, importance, unpruned, out)

    all_rows: list = []

    def write_curve(rows: list) -> None:
        table = pd.DataFrame(all_rows + rows)
        write_atomic(out / "curve.csv", table.to_csv(index=False))
        write_atomic(out / "curve.md", markdown(table.drop(columns=["step", "pct_target"])))

    def candidate(row: dict) -> bool:
        """head_mask.json is the last candidate step of the method's own order."""
        if row["order"] != p.method:
            return False
        if p.target_pct is not None:
            return row["pct_target"] == p.target_pct
        return row["delta_bleu"] >= -p.max_bleu_drop

    for method in dict.fromkeys([p.method, *p.baselines]):  # the method first, each order once
        rows, last_candidate = curve(run_, method, steps, unpruned, initial_state, write_curve, candidate)
        all_rows += rows
        if method == p.method:
            chosen, chosen_result, chosen_mask, chosen_weights = last_candidate  # step 0 always is one
    table = pd.DataFrame(all_rows)
    plots.bleu_curve(table, unpruned["bleu"], out / "curve.png", f"{cfg.data.name}: BLEU vs heads pruned")
    write_json(out / "head_mask.json", chosen_mask)

    metrics = {
        "verb": "prune", "method": p.method, "data": cfg.data.name, "split": cfg.split,
        "bleu": chosen["bleu"], "delta_bleu": chosen["delta_bleu"], "bleu_unpruned": unpruned["bleu"],
        "chrf": chosen["chrf"], "valid_loss": chosen["valid_loss"], "valid_loss_unpruned": unpruned["valid_loss"],
        "pct_pruned": chosen["pct_pruned"], "heads_pruned": chosen["heads_pruned"], "heads_pool": len(pool),
        **kept_columns(chosen_mask), "bleu_signature": unpruned["bleu_signature"],
        "types": list(p.types), "step_pct": p.step_pct, "target_pct": p.target_pct, "max_bleu_drop": p.max_bleu_drop,
        "reestimate": p.reestimate, "min_heads_per_layer": p.min_heads_per_layer,
        "finetune_updates": p.finetune.updates, "importance_split": p.importance.split,
        "importance_max_batches": p.importance.max_batches, "normalize_by_layer": p.importance.normalize_by_layer,
        "baselines": list(p.baselines), "ablations": list(p.ablations),
        "n_params": backend.count_parameters(loaded.model), "device": loaded.device, "precision": cfg.precision,
        "seed": cfg.seed, "git_sha": git_sha(), "checkpoint": str(ckpt.absolute()), "data_bin": str(data_bin),
    }
    if p.export:
        metrics.update(export(run_, chosen_mask, chosen_result, chosen_weights, out))
    write_json(out / "metrics.json", metrics)
    print(markdown(table.drop(columns=["step", "pct_target"])), end="")
    print(f"head_mask.json: {chosen['pct_pruned']} % of {len(pool)} heads pruned, BLEU {chosen['bleu']:.2f} "
          f"({chosen['delta_bleu']:+.2f} vs unpruned)")
    if p.export:
        print(f"pruned checkpoint: {metrics['export_checkpoint']} ({metrics['params_removed_pct']} % fewer "
              f"parameters, BLEU {metrics['export_bleu']:.2f}, max |diff| {metrics['export_max_abs_diff']:.1e})")
    return metrics


main = hydra_app("prune")(run)
