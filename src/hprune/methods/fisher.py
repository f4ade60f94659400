"""`hprune prune --method fisher prune.macs_budget=0.5`: retraining-free pruning under a compute budget (Kwon et
al. 2022, "A Fast Post-Training Pruning Framework for Transformers"; code WoosukKwon/retraining-free-pruning).

No training; four stages, each evaluated so that the ablation is recorded (stages.csv):
1. Fisher: calibration sentences drawn at random (prune.calibration, seeded), batched with their lengths mixed;
   the gradient of each sentence's negative log-likelihood with respect to a mask on each head (at 1), g_sh; a
   head's importance is Σ_s g_sh², the diagonal of the empirical Fisher information (the paper's definition).
   prune.fisher=per_batch takes one gradient per batch of its mean NLL instead, as the reference code does
   (prune/fisher.py: `outputs.loss` of each batch of 32).
2. Search: the heads of prune.types in descending importance; the longest prefix whose attention MACs
   (counted per target token, flops.unit_costs) fit in macs_budget × those of the unpruned heads.
3. Rearrangement (prune.rearrange): in each layer, the same number of heads, but the set whose removal the
   block-diagonal Fisher says costs least, Σ_s (Σ_{pruned h} g_sh)², found by the reference's greedy swaps.
4. Mask tuning (prune.tune): from the bottom layer up, the kept heads of each sublayer get the scales that
   best reproduce, in least squares over the calibration tokens, the sublayer's output (residual included)
   of a teacher: the model under the milder mask the search finds at budget^½ (the reference's schedule).
   The scales are folded into the heads' out_proj columns (an expert's W_o), so the result is an ordinary
   model pruned to the mask; the physically pruned export's MACs are counted: the MACs actually reached.

Each stage is tested against the one before it (stages.csv: p_vs_previous, sacreBLEU's paired bootstrap on the
test sentences, significance.resamples or 1000).

Where hprune departs from the reference: the loss is the NLL of whole sentences, as the reference's is the
cross-entropy of its examples (not the checkpoint's label-smoothed training loss); heads only (the reference
prunes FFN neurons too, in one budget); the budget is on the attention MACs of prune.types, not on the whole
model; the least squares fit the scales alone (the reference fits a constant too and drops it, which can leave the
error above the untuned one); the first self-attention of the encoder and of the decoder is not tuned, as the
reference leaves its first layer (teacher and student see the same input there).
"""
from __future__ import annotations

import copy
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pandas as pd
import torch
from omegaconf import DictConfig

from ..attention_types import check_attention_types
from ..deploy.fairseq_checkpoint import write_checked
from ..errors import UserError
from ..evaluation import Evaluation, Evaluator
from ..files import write_atomic, write_json
from ..flops import mask_macs
from ..pruning.heads import Head, describe_kept, layer_floor, mask_without, per_stack_masks, pool_of
from ..pruning.scores import mask_gradients
from ..reporting.significance import paired_bootstrap
from ..rundir import PRUNED, RunDir, save_hypotheses
from . import MethodSettings, Report, register_method, trained

log = logging.getLogger(__name__)
STAGE_RESAMPLES = 1000  # the stages' paired bootstrap when significance.resamples is 0 (off for curves)


@dataclass
class CalibrationSettings:
    split: str = "train"
    sentences: int = 2048
    batch_size: int = 32
    seed: Optional[int] = None


@dataclass
class FisherSettings(MethodSettings):
    """configs/prune/fisher.yaml: the paper's and the reference code's values, with their sources."""
    macs_budget: float = 0.5
    calibration: CalibrationSettings = field(default_factory=CalibrationSettings)
    fisher: str = "per_sentence"
    rearrange: bool = True
    tune: bool = True
    tune_max_scale: float = 10
    export: bool = True


def check_settings(p: DictConfig) -> None:
    check_attention_types(p.types, "prune.types")
    if not 0 < p.macs_budget <= 1:
        raise UserError(f"prune.macs_budget={p.macs_budget} is outside (0, 1]: it is the fraction of the attention "
                        "MACs to keep, e.g. prune.macs_budget=0.5")
    c = p.calibration
    if p.fisher not in ("per_sentence", "per_batch"):
        raise UserError(f"prune.fisher={p.fisher}: choose per_sentence (the paper's Fisher) or per_batch (the "
                        "reference code's)")
    if c.sentences < 1 or c.batch_size < 1:
        raise UserError(f"prune.calibration.sentences={c.sentences} and .batch_size={c.batch_size} must be >= 1")
    if p.tune_max_scale <= 0:
        raise UserError(f"prune.tune_max_scale={p.tune_max_scale} must be > 0")


# --------------------------------------------------------------------------------------------- search
def search(order: List[Head], budget: float, costs, types, model, pool: set) -> set:
    """The longest prefix of `order` (most important first, heads of `pool`) whose attention MACs fit in
    `budget` (MACs per target token): the heads kept."""
    kept: set = set()
    for head in order:
        trial = kept | {head}
        if mask_macs(costs, mask_without(model, pool - trial), types) > budget + 1e-9:
            break
        kept = trial
    return kept


def search_per_stack(importance: Dict[Head, float], budget: float, costs, types, model, pool: set,
                     floor: int) -> set:
    """prune.layout=per_stack: of every per_stack head set (pruning/heads.per_stack_masks) whose attention MACs fit
    in `budget`, the one with the largest summed Fisher information (the search's own objective, exactly)."""
    fitting = [kept for kept in per_stack_masks(pool, importance, floor)
               if mask_macs(costs, mask_without(model, pool - kept), types) <= budget + 1e-9]
    if not fitting:
        raise UserError(f"no per_stack layout fits this MACs budget: even {floor} head(s) per layer cost more; raise "
                        "prune.macs_budget or use prune.layout=free")
    return max(fitting, key=lambda kept: (sum(importance[h] for h in kept), len(kept)))


def rearrange(kept: set, heads: List[Head], grads: torch.Tensor, types) -> set:
    """Kwon et al.'s greedy rearrangement, layer by layer: start from the layer's lowest-Fisher heads as the
    pruned set, then offer each other head in turn and drop from the set the one whose leaving makes the
    summed gradient smallest, Σ_b (Σ_{pruned} g_bh)²."""
    index = {head: i for i, head in enumerate(heads)}
    result = set(kept)
    layers = sorted({head[:2] for head in heads if head[0] in types})
    for layer in layers:
        members = [h for h in heads if h[:2] == layer]
        n_pruned = sum(h not in kept for h in members)
        if n_pruned in (0, len(members)):
            continue
        g = grads[:, [index[h] for h in members]].t()  # (members, batches)
        ascending = sorted(range(len(members)), key=lambda i: (float(g[i].pow(2).sum()), i))
        pruned = ascending[:n_pruned]
        for candidate in ascending[n_pruned:]:
            pruned.append(candidate)
            vectors = g[pruned]
            without = vectors.sum(0, keepdim=True) - vectors  # the summed gradient with each one left out
            del pruned[int(without.pow(2).sum(1).argmin())]
        result -= set(members)
        result |= {members[i] for i in range(len(members)) if i not in pruned}
    return result


# --------------------------------------------------------------------------------------------- tuning
def forward_order(model) -> list:
    """The attention sublayers in the order the data meets them (the plugin's Sublayer: attn_type, layer, module,
    the transformer layer and which of its residual connections is this one's)."""
    return [s for s in model.sublayers() if s.attn_type is not None]


def _real(sample: dict, attn_type: str, pad: int) -> torch.Tensor:
    """(len, batch) booleans: the real tokens of the sublayer's queries (time-major, as fairseq's layers)."""
    tokens = sample["net_input"]["src_tokens"] if attn_type == "enc-self" else sample["target"]
    return tokens.ne(pad).t()


@torch.no_grad()
def least_squares(student, teacher, attn_type: str, layer: int, batches: List[dict], pad: int, units: List[int]):
    """Normal equations (AᵀA, Aᵀb) of the scales of `units` (local indices) that make the student's sublayer
    output, residual included, closest to the teacher's over the calibration tokens."""
    at = {(s.attn_type, s.layer): s for s in forward_order(student)}[attn_type, layer]
    there = {(s.attn_type, s.layer): s for s in forward_order(teacher)}[attn_type, layer]
    module = at.module
    bias = getattr(getattr(module, "out_proj", None), "bias", None)
    gram = torch.zeros(len(units), len(units), dtype=torch.float64)
    target = torch.zeros(len(units), dtype=torch.float64)
    for sample in batches:
        seen_teacher, seen_student = [], []
        with teacher.capture_residuals(there, seen_teacher):  # (the plugin's: where the sublayer's output joins)
            teacher(**sample["net_input"])
        module.record_contributions = True
        try:
            with student.capture_residuals(at, seen_student):
                student(**sample["net_input"])
            shares = module.unit_contributions.permute(2, 0, 1, 3)  # (len, batch, units, d)
        finally:
            module.record_contributions, module.unit_contributions = False, None
        real = _real(sample, attn_type, pad)
        (update_t, residual_t), (_, residual_s) = seen_teacher[0], seen_student[0]
        goal = (update_t + residual_t - residual_s)[real].double()
        if bias is not None:
            goal = goal - bias.double()
        a = shares[real][:, units].double()  # (tokens, kept, d)
        gram += torch.einsum("nkd,njd->kj", a, a).cpu()
        target += torch.einsum("nkd,nd->k", a, goal).cpu()
    return gram, target


def tune(session, teacher_mask: dict, mask: dict, types, batches: List[dict], max_scale: float) -> Tuple[dict, str]:
    """Fold the least-squares scales into the kept heads, sublayer by sublayer from the bottom. Returns
    {(type, layer, head): scale} and why tuning stopped (or "done")."""
    model = session.model
    teacher = copy.deepcopy(model)
    teacher.set_head_mask(teacher_mask)
    session.set_mask(mask)
    model.eval()
    teacher.eval()
    scales: Dict[Head, float] = {}
    stopped = "done"
    first = {"enc-self": 0, "dec-self": 0}
    for sublayer in forward_order(model):
        attn_type, layer, module = sublayer.attn_type, sublayer.layer, sublayer.module
        units = [i for i, h in enumerate(module.head_ids) if mask[attn_type][layer][h]]
        if attn_type not in types or not units or first.get(attn_type) == layer:
            continue
        gram, target = least_squares(model, teacher, attn_type, layer, batches, session.pad, units)
        solution = torch.linalg.lstsq(gram, target.unsqueeze(-1)).solution.squeeze(-1)
        if not torch.isfinite(solution).all() or solution.abs().max() > max_scale:
            stopped = f"stopped at {attn_type} layer {layer}: scales outside ±{max_scale:g} (the reference's rule)"
            break
        values = torch.ones(module.num_heads, dtype=torch.float64)
        values[units] = solution
        module.scale_units(values.to(next(module.parameters()).device))
        scales.update({(attn_type, layer, module.head_ids[u]): float(s) for u, s in zip(units, solution)})
    del teacher
    return scales, stopped


# --------------------------------------------------------------------------------------------- the method
@register_method("fisher", procedure=True, settings=FisherSettings, check=check_settings,
                 report=Report(knobs=("macs_budget",), title="Kwon et al. (fisher)"))
def fisher(session, cfg: DictConfig, out: Path) -> dict:
    """Kwon et al. 2022: Fisher-ranked heads under a MACs budget, rearranged and rescaled, without retraining."""
    p, c, evaluator = cfg.prune, cfg.prune.calibration, Evaluator.of(session, cfg)
    model, types = session.model, list(p.types)
    started = time.perf_counter()  # the calibration data first: a missing or empty split stops before any output
    batches = session.sampled_batches(c.split, c.sentences, c.batch_size, c.seed)
    seconds = {"calibration": time.perf_counter() - started}
    pool = pool_of(model, types)
    costs = evaluator.unit_costs()
    base = mask_macs(costs, session.unpruned_mask(), types)
    unpruned = evaluator.evaluate(None)
    save_hypotheses(out, "unpruned", unpruned)

    started = time.perf_counter()
    heads, grads = mask_gradients(model, batches, session.pad, per=p.fisher.removeprefix("per_"))
    importance = grads.pow(2).sum(0)
    seconds["fisher"] = time.perf_counter() - started
    order = [heads[i] for i in sorted(range(len(heads)), key=lambda i: (-float(importance[i]), i)) if heads[i] in pool]
    started = time.perf_counter()
    if p.layout == "per_stack":  # rearrangement keeps each layer's count: the layout survives it
        by_head = {head: float(importance[i]) for i, head in enumerate(heads)}
        found = [search_per_stack(by_head, fraction * base, costs, types, model, pool, layer_floor(p.layout, 0))
                 for fraction in (p.macs_budget, math.sqrt(p.macs_budget))]
    else:
        found = [search(order, fraction * base, costs, types, model, pool)
                 for fraction in (p.macs_budget, math.sqrt(p.macs_budget))]
    kept, teacher_kept = {"search": found[0]}, found[1]
    seconds["search"] = time.perf_counter() - started
    if p.rearrange:
        started = time.perf_counter()
        kept["rearranged"] = rearrange(kept["search"], heads, grads, types)
        seconds["rearrange"] = time.perf_counter() - started
    final = kept.get("rearranged", kept["search"])
    mask = mask_without(model, pool - final)

    stages, results = [], {}
    for stage, heads_kept in kept.items():
        stage_mask = mask_without(model, pool - heads_kept)
        results[stage] = evaluator.evaluate(stage_mask)
        save_hypotheses(out, stage, results[stage])
        stages.append(_stage_row(evaluator, stage, stage_mask, results[stage], unpruned, types))
    scales, stopped = {}, "off"
    if p.tune:
        started = time.perf_counter()
        scales, stopped = tune(session, mask_without(model, pool - teacher_kept), mask, types, batches,
                               p.tune_max_scale)
        seconds["tune"] = time.perf_counter() - started
        results["tuned"] = evaluator.evaluate(mask)
        stages.append(_stage_row(evaluator, "tuned", mask, results["tuned"], unpruned, types))
    names, sig = list(results), cfg.significance  # each stage against the one before it, on the same sentences
    for row, before, stage in zip(stages[1:], names, names[1:]):
        test = paired_bootstrap(results[before].hypotheses, results[stage].hypotheses, results[stage].references,
                                sig.resamples or STAGE_RESAMPLES, sig.seed, results[stage].bleu_tokenize)
        row.update(p_vs_previous=round(test["p_value"], 4), significant_vs_previous=test["significant"])
    result = results["tuned" if p.tune else ("rearranged" if p.rearrange else "search")]
    save_hypotheses(out, "pruned", result)

    table = pd.DataFrame([{"type": h[0], "layer": h[1], "head": h[2], "fisher": float(importance[i]),
                           "kept_search": int(h in kept["search"]), "kept": int(h in final),
                           "scale": scales.get(h, 1.0 if h in final else 0.0)}
                          for i, h in enumerate(heads) if h[0] in types])
    write_atomic(out / "fisher.csv", table.to_csv(index=False))
    write_atomic(out / "stages.csv", pd.DataFrame(stages).to_csv(index=False))
    write_json(RunDir(out).head_mask, mask)
    macs = mask_macs(costs, mask, types)
    metrics = {
        "method": "fisher", "layout": p.layout, "split": cfg.split, "types": types, "macs_budget": p.macs_budget,
        "calibration_split": c.split, "calibration_sentences": sum(len(b["id"]) for b in batches),
        "rearrange": p.rearrange, "tune": p.tune, "tuning": stopped,
        **trained.outcome(evaluator, types, pool, pool - final, mask, result, unpruned),
        **{f"bleu_{stage}": results[stage].bleu for stage in results},
        "attention_macs_pool": round(base), "attention_macs_kept": round(macs),
        **{f"seconds_{stage}": round(s, 3) for stage, s in seconds.items()}, "seconds": round(sum(seconds.values()), 3),
        **session.provenance(),
    }
    if p.export:
        metrics.update(write_checked(evaluator, mask, RunDir(out).checkpoint(PRUNED), result))
    print(pd.DataFrame(stages).to_string(index=False))
    print(summary(metrics))
    return metrics


def _stage_row(evaluator: Evaluator, stage: str, mask: dict, result: Evaluation, unpruned: Evaluation, types) -> dict:
    return {"stage": stage, "kept_heads": sum(sum(map(sum, mask[attn_type])) for attn_type in types),
            "attention_macs_pct": evaluator.attention_macs_pct(mask, types), "bleu": result.bleu,
            "delta_bleu": result.delta_bleu(unpruned), "valid_loss": result.valid_loss}


def summary(m: dict) -> str:
    lines = [f"MACs budget {m['macs_budget']:g}: {m['kept_heads']} of {m['heads_pool']} heads kept ({describe_kept(m)}), "
             f"{m['attention_macs_pct']:g} % of the attention MACs; BLEU {m['bleu']:.2f} ({m['delta_bleu']:+.2f} vs "
             f"unpruned) in {m['seconds']:.1f} s without retraining (tuning: {m['tuning']})"]
    if "export_checkpoint" in m:
        lines.append(f"pruned checkpoint: {m['export_checkpoint']} ({m['params_removed_pct']} % fewer parameters, "
                     f"{m['attention_macs_per_token_pruned']:,} attention MACs per token counted, BLEU "
                     f"{m['export_bleu']:.2f})")
    return "\n".join(lines)
