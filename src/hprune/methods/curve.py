"""The order curve, what `hprune prune` does with a method that ranks heads (an order: michel, lrp, ...):
score heads, prune them cumulatively, measure BLEU at each step.

Flow: score the heads (head_importance.csv) -> optional ablations on the unpruned model -> the pruning curve
for the method's order and any baseline orders (curve.csv/.md; each point's translations in hypotheses/, its
paired-bootstrap p-value against the unpruned model and, for a baseline, against the method's point; the
references in references.txt) -> pick
a mask (head_mask.json) -> optionally remove its heads physically (checkpoints/checkpoint_pruned.pt) and check
it against the masked model.
metrics.json is written last (by the verb wrapper): a run without it did not finish. Procedures (Voita's gates,
DSP, fisher) run their own flow under the same verb.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, List, NamedTuple, Optional, Set, Tuple

import pandas as pd
from omegaconf import DictConfig

from .. import console
from ..attention_types import ATTENTION_TYPES, check_attention_types
from ..deploy.fairseq_checkpoint import write_checked
from ..errors import UserError
from ..evaluation import Evaluation, Evaluator
from ..files import write_atomic, write_json
from ..pruning.heads import (
    Head,
    Mask,
    extend_pruned,
    heads_to_prune,
    kept_columns,
    mask_without,
    max_prunable,
    michel_id,
    moa_types,
    pool_of,
    present_heads,
    ranked,
)
from ..reporting import plots
from ..reporting.significance import paired_bootstrap
from ..reporting.tables import markdown
from ..rundir import PRUNED, RunDir, model_provenance, run_dir, save_hypotheses
from . import MethodSettings
from .training import finetune

log = logging.getLogger(__name__)
ABLATIONS = ("single", "one_head", "types")
CURVE_ONLY = ["step", "pct_target", "layout"]  # curve.csv's columns that curve.md leaves out (the layout: one per run)


def check_settings(p: DictConfig, orders: List[str]) -> List[float]:
    """Refuse bad settings before any work; returns the curve's percentages."""
    for method in [p.method, *p.baselines]:
        if method not in orders:
            raise UserError(f"unknown pruning order '{method}'; choose from {', '.join(orders)}")
    check_attention_types(p.types, "prune.types")
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
class ImportanceSettings:
    split: str = "valid"
    max_batches: Optional[int] = None
    max_tokens: int = 4096
    normalize_by_layer: bool = True


@dataclass
class FinetuneSettings:
    updates: int = 0
    lr: float = 1.0e-4
    max_tokens: int = 4096


@dataclass
class CurveSettings(MethodSettings):
    """The settings every order's curve takes (configs/prune/michel.yaml, which the other orders' yamls extend)."""
    importance: ImportanceSettings = field(default_factory=ImportanceSettings)
    step_pct: float = 10
    reestimate: bool = False
    min_heads_per_layer: int = 0
    finetune: FinetuneSettings = field(default_factory=FinetuneSettings)
    baselines: List[str] = field(default_factory=list)
    ablations: List[str] = field(default_factory=list)
    target_pct: Optional[float] = None
    max_bleu_drop: float = 1.0
    export: bool = False


def head_scores(session, cfg: DictConfig, method: str, mask: Optional[Mask] = None) -> pd.DataFrame:
    """A registered order's head scores (methods/), computed under `mask`."""
    from . import get_method

    with session.masked(mask):
        return get_method(method).score(session, cfg)


def ablations(evaluator: Evaluator, cfg: DictConfig, pool: Set[Head], importance: pd.DataFrame, unpruned: Evaluation,
              out: Path) -> None:
    """Ablations on the unpruned model: Michel et al.'s two (every head removed alone; every layer reduced to its
    most important head) and every head of one attention type removed at once (which type is most sensitive)."""
    p, model = cfg.prune, evaluator.session.model

    def row(mask: Mask, **where) -> dict:
        result = evaluator.evaluate(mask)
        return {**where, "bleu": result.bleu, "delta_bleu": result.delta_bleu(unpruned), "valid_loss": result.valid_loss}

    if "single" in p.ablations:
        rows = [row(mask_without(model, {head}), type=head[0], layer=head[1], head=head[2], id=michel_id(head))
                for head in present_heads(model) if head in pool]
        write_atomic(out / "ablation_single.csv", pd.DataFrame(rows).to_csv(index=False))
    if "one_head" in p.ablations:
        rows = []
        heads_in_table = importance[["type", "layer", "head"]].itertuples(index=False, name=None)
        in_pool = pd.Series([head in pool for head in heads_in_table], index=importance.index)
        for attn_type in ATTENTION_TYPES:
            for layer, heads in importance[in_pool & (importance["type"] == attn_type)].groupby("layer"):
                top = int(heads.sort_values(["importance", "head"], ascending=[False, True])["head"].iloc[0])
                others = {(attn_type, int(layer), int(h)) for h in heads["head"] if h != top}
                rows.append(row(mask_without(model, others), type=attn_type, layer=int(layer), kept_head=top,
                                heads_removed=len(others)))
        write_atomic(out / "ablation_one_head.csv", pd.DataFrame(rows).to_csv(index=False))
    if "types" in p.ablations:
        rows = [row(mask_without(model, {h for h in pool if h[0] == attn_type}), type=attn_type,
                    heads_removed=sum(h[0] == attn_type for h in pool)) for attn_type in ATTENTION_TYPES if attn_type in p.types]
        write_atomic(out / "ablation_types.csv", pd.DataFrame(rows).to_csv(index=False))


def compared(result: Evaluation, unpruned: Evaluation, method_result: Optional[Evaluation],
             control: Optional[Evaluation], cfg: DictConfig) -> dict:
    """Paired bootstrap (sacreBLEU's) of a curve point against the unpruned model, against its fine-tuning control
    (when the curve fine-tunes) and, for a baseline order, against the method's own point at the same step:
    p-values, the point's 95 % interval, significance at 0.05."""
    sig = cfg.significance
    test = paired_bootstrap(unpruned.hypotheses, result.hypotheses, result.references, sig.resamples, sig.seed,
                            result.bleu_tokenize)
    row = {"bleu_ci95": round(test["bleu_ci95"], 4), "p_vs_unpruned": round(test["p_value"], 4),
           "significant_vs_unpruned": test["significant"]}
    for name, other in (("control", control), ("method", method_result)):
        if other is not None:
            versus = paired_bootstrap(other.hypotheses, result.hypotheses, result.references, sig.resamples, sig.seed,
                                      result.bleu_tokenize)
            row.update({f"p_vs_{name}": round(versus["p_value"], 4), f"significant_vs_{name}": versus["significant"]})
    return row


def finetuning_control(evaluator: Evaluator, cfg: DictConfig, pool: Set[Head], steps: List[float],
                       initial_state: dict) -> dict:
    """The control of a fine-tuned curve: the unpruned model fine-tuned exactly as the pruned one is at each step
    (the same updates, learning rate and batch order, cumulatively), nothing pruned. {step: its evaluation} for
    the steps that fine-tune; translations saved as `control.<step>`."""
    p, session = cfg.prune, evaluator.session
    session.load_state(initial_state)
    controls = {}
    log.info("fine-tuning control: %d updates per step, nothing pruned", p.finetune.updates)
    with console.progress("fine-tuning control", len(steps), "step") as bar:
        for step, pct in enumerate(steps):
            if heads_to_prune(len(pool), pct):
                finetune(session, None, p.finetune.updates, p.finetune.lr, p.finetune.max_tokens, cfg.seed + step)
                controls[step] = evaluator.evaluate(None)
                save_hypotheses(run_dir(), f"control.{step}", controls[step])
            bar.advance(1)
    session.load_state(initial_state)
    return controls


class ChosenStep(NamedTuple):
    """A curve's step that head_mask.json may be taken from: its row of curve.csv, its evaluation, its mask, and
    the weights after its fine-tuning (None: the curve does not fine-tune)."""
    row: dict
    result: Evaluation
    mask: Mask
    weights: Optional[dict]


def curve(evaluator: Evaluator, cfg: DictConfig, pool: Set[Head], method: str, steps: List[float], unpruned: Evaluation,
          initial_state: Optional[dict],
          on_row: Callable[[list], None], candidate: Callable[[dict], bool],
          against: Optional[dict] = None, controls: Optional[dict] = None) -> tuple[list, Optional[ChosenStep], dict]:
    """Prune cumulatively in the method's order. Returns the rows, the last step that is a `candidate` for
    head_mask.json (a ChosenStep), and each step's
    evaluation; `against`: the method's evaluations by step, which a baseline order is tested against;
    `controls`: the fine-tuning control's evaluations by step (finetuning_control)."""
    against, controls = against or {}, controls or {}
    results = {}
    p, session = cfg.prune, evaluator.session
    if initial_state is not None:  # fine-tuning changed the weights: every order starts from the checkpoint
        session.load_state(initial_state)
    session.set_mask(None)
    table = head_scores(session, cfg, method)
    pruned: Set[Head] = set()
    rows, chosen = [], None
    log.info("curve: the %s order, %d steps", method, len(steps))
    with console.progress(f"curve {method}", len(steps), "step") as bar:
        for step, pct in enumerate(steps):
            n = heads_to_prune(len(pool), pct)
            if p.reestimate and pruned:
                table = head_scores(session, cfg, method, mask_without(session.model, pruned))
            pruned = extend_pruned(table, pruned, n, pool, p.min_heads_per_layer, p.layout)
            mask = mask_without(session.model, pruned)
            n = len(pruned)  # per_stack may prune a few more than the step's share
            if p.finetune.updates and n:
                finetune(session, mask, p.finetune.updates, p.finetune.lr, p.finetune.max_tokens, cfg.seed + step)
            result = unpruned if n == 0 else evaluator.evaluate(mask)
            control = controls.get(step)
            row = {"order": method, "layout": p.layout, "step": step, "pct_target": pct, "heads_pruned": n,
                   "pct_pruned": round(100 * n / len(pool), 2), **kept_columns(mask),
                   "attention_macs_pct": evaluator.attention_macs_pct(mask, p.types), "bleu": result.bleu,
                   "delta_bleu": result.delta_bleu(unpruned), "chrf": result.chrf, "valid_loss": result.valid_loss}
            if control is not None:
                row.update(bleu_control=control.bleu, delta_bleu_control=result.delta_bleu(control))
            if n and cfg.significance.resamples:
                row.update(compared(result, unpruned, against.get(step), control, cfg))
            save_hypotheses(run_dir(), f"{method}.{step}", result)
            rows.append(row)
            results[step] = result
            on_row(rows)
            if candidate(row):
                chosen = ChosenStep(row, result, mask, session.state() if p.finetune.updates else None)
            bar.advance(1, pruned=f"{row['pct_pruned']:g}%", bleu=f"{row['bleu']:.1f}")
    return rows, chosen, results


def run(session, cfg: DictConfig, out: Path) -> dict:
    """An order's run: scores, ablations, the curves of the method and its baselines, head_mask.json, export."""
    from . import method_names

    p, evaluator = cfg.prune, Evaluator.of(session, cfg)
    orders = method_names(procedure=False)
    steps = check_settings(p, orders)
    pool = pool_of(session.model, p.types)
    check_pool(session.model, p, orders, steps, pool)
    importance = score_heads(session, cfg, pool, out)
    unpruned = evaluator.evaluate(None)
    initial_state = session.state() if p.finetune.updates else None
    if p.ablations:
        ablations(evaluator, cfg, pool, importance, unpruned, out)
    table, chosen = curves(evaluator, cfg, pool, steps, unpruned, initial_state, out)
    plots.bleu_curve(table, unpruned.bleu, out / "curve.png", f"{cfg.data.name}: BLEU vs heads pruned")
    write_json(RunDir(out).head_mask, chosen.mask)
    metrics = run_metrics(session, cfg, pool, chosen, unpruned)
    if p.export:
        if chosen.weights is not None:
            session.load_state(chosen.weights)  # the fine-tuned weights of the chosen step
        metrics.update(write_checked(evaluator, chosen.mask, RunDir(out).checkpoint(PRUNED), chosen.result))
    print_summary(table, chosen, len(pool), p, metrics)
    return metrics


def check_pool(model, p: DictConfig, orders: List[str], steps: List[float], pool: Set[Head]) -> None:
    """Refuse, before any work, what this model's heads cannot give: per-head attention maps of MoA experts, or
    more heads pruned than the layout and the minimum per layer leave."""
    from . import get_method

    experts = sorted(moa_types(model) & set(p.types))
    needs_maps = [name for name in (p.method, *p.baselines) if get_method(name).needs_head_maps]
    if experts and needs_maps:
        others = ", ".join(name for name in orders if not get_method(name).needs_head_maps)
        raise UserError(f"{needs_maps[0]} needs per-head attention maps, which the MoA experts of {', '.join(experts)} "
                        f"do not have; rank experts with {others} (prune.baselines=...)")
    if max(steps) > 0 and heads_to_prune(len(pool), max(steps)) > max_prunable(pool, p.min_heads_per_layer, p.layout):
        raise UserError(f"{max(steps)} % of the {len(pool)} heads of {', '.join(p.types)} is more than can be pruned "
                        f"with prune.min_heads_per_layer={p.min_heads_per_layer} and prune.layout={p.layout}; lower "
                        "prune.step_pct's range, prune.target_pct or that minimum")


def score_heads(session, cfg: DictConfig, pool: Set[Head], out: Path) -> pd.DataFrame:
    """The method's head scores, ranked, with Michel et al.'s head ids (head_importance.csv and its heatmaps)."""
    p = cfg.prune
    log.info("scoring %d heads of %s (%s)", len(pool), ", ".join(p.types), p.method)
    importance = ranked(head_scores(session, cfg, p.method))
    importance.insert(3, "id", [michel_id(h) for h in importance[["type", "layer", "head"]].itertuples(index=False, name=None)])
    write_atomic(out / "head_importance.csv", importance.sort_values(["type", "layer", "head"]).to_csv(index=False))
    plots.head_heatmaps(importance, "importance", out / "head_importance.png", f"{p.method} head scores")
    return importance


def curves(evaluator: Evaluator, cfg: DictConfig, pool: Set[Head], steps: List[float], unpruned: Evaluation,
           initial_state: Optional[dict], out: Path) -> Tuple[pd.DataFrame, ChosenStep]:
    """The curves of the method's order and then of each baseline order, curve.csv/.md rewritten after every point;
    returns the table of all of them and the step head_mask.json is taken from: the last candidate of the method's
    own order (within prune.max_bleu_drop, or at prune.target_pct; step 0 always is one)."""
    p = cfg.prune
    all_rows: list = []

    def write_curve(rows: list) -> None:
        table = pd.DataFrame(all_rows + rows)
        write_atomic(out / "curve.csv", table.to_csv(index=False))
        write_atomic(out / "curve.md", markdown(table.drop(columns=CURVE_ONLY)))

    def candidate(row: dict) -> bool:
        """head_mask.json is the last candidate step of the method's own order."""
        if row["order"] != p.method:
            return False
        if p.target_pct is not None:
            return row["pct_target"] == p.target_pct
        return row["delta_bleu"] >= -p.max_bleu_drop

    method_results: dict = {}
    controls = finetuning_control(evaluator, cfg, pool, steps, initial_state) if p.finetune.updates else {}
    for order in dict.fromkeys([p.method, *p.baselines]):  # the method first, each order once
        rows, last_candidate, results = curve(evaluator, cfg, pool, order, steps, unpruned, initial_state, write_curve,
                                              candidate, None if order == p.method else method_results, controls)
        all_rows += rows
        if order == p.method:
            chosen = last_candidate  # step 0 always is one
            method_results = {step: r for step, r in results.items() if step > 0}
    return pd.DataFrame(all_rows), chosen


def run_metrics(session, cfg: DictConfig, pool: Set[Head], chosen: ChosenStep, unpruned: Evaluation) -> dict:
    """metrics.json's keys, the export's aside."""
    p, row = cfg.prune, chosen.row
    return {
        "method": p.method, "layout": p.layout, "split": cfg.split,
        "bleu": row["bleu"], "delta_bleu": row["delta_bleu"], "bleu_unpruned": unpruned.bleu,
        "chrf": row["chrf"], "valid_loss": row["valid_loss"], "valid_loss_unpruned": unpruned.valid_loss,
        "pct_pruned": row["pct_pruned"], "heads_pruned": row["heads_pruned"], "heads_pool": len(pool),
        **kept_columns(chosen.mask), "bleu_signature": unpruned.bleu_signature,
        "types": list(p.types), "step_pct": p.step_pct, "target_pct": p.target_pct, "max_bleu_drop": p.max_bleu_drop,
        "reestimate": p.reestimate, "min_heads_per_layer": p.min_heads_per_layer,
        "finetune_updates": p.finetune.updates, "importance_split": p.importance.split,
        "importance_max_batches": p.importance.max_batches, "normalize_by_layer": p.importance.normalize_by_layer,
        "baselines": list(p.baselines), "ablations": list(p.ablations), **model_provenance(session),
    }


def print_summary(table: pd.DataFrame, chosen: ChosenStep, heads_pool: int, p: DictConfig, metrics: dict) -> None:
    """The curves' table, the step head_mask.json took and the export, on the terminal."""
    row = chosen.row
    print(markdown(table.drop(columns=CURVE_ONLY)), end="")
    print(f"head_mask.json: {row['pct_pruned']} % of {heads_pool} heads pruned ({p.layout} layout), BLEU "
          f"{row['bleu']:.2f} ({row['delta_bleu']:+.2f} vs unpruned)")
    if p.export:
        print(f"pruned checkpoint: {metrics['export_checkpoint']} ({metrics['params_removed_pct']} % fewer "
              f"parameters, BLEU {metrics['export_bleu']:.2f}, max |diff| {metrics['export_max_abs_diff']:.1e})")
