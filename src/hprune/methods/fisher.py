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

prune.units=[heads,neurons]: the FFN neurons too, the paper's whole framework (a mask on each neuron's activation,
fc2's input): their Fisher from the same rows, the reference's search over both under one budget on the MACs of
attention and FFN (each number of heads, the neurons filling the rest), rearrangement and tuning per FFN (the
normal equations from fc2's Gram, solved damped toward 1 as the reference's LSMR). prune.latency_budget: the same
search on a CTranslate2 latency table measured on this machine (deploy/latency.py), per_stack.

Where hprune departs from the reference: the loss is the NLL of whole sentences, as the reference's is the
cross-entropy of its examples (not the checkpoint's label-smoothed training loss); heads only by default, their
budget on the attention MACs of prune.types, not on the whole model; the least squares of heads fit the scales
alone, undamped (the reference fits a constant too and drops it, which can leave the error above the untuned one);
the first self-attention of the encoder and of the decoder is not tuned, as the reference leaves its first layer
(teacher and student see the same input there); the latency table times whole translations (docs/methods.md).
"""
from __future__ import annotations

import contextlib
import copy
import importlib.util
import itertools
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

import pandas as pd
import torch
from omegaconf import DictConfig

from ..attention_types import ATTENTION_TYPES, FFN_TYPES, STACK, check_attention_types
from ..deploy.fairseq_checkpoint import write_checked
from ..deploy.latency import LatencySettings, LatencyTable, calibrated, latency_metrics, seconds_per_sentence, table_of
from ..errors import UserError
from ..evaluation import Evaluation, Evaluator
from ..files import write_atomic, write_json
from ..flops import mask_macs
from ..pruning.heads import Head, describe_kept, layer_floor, mask_without, moa_types, per_stack_masks, pool_of
from ..pruning.scores import mask_gradients
from ..reporting.significance import paired_bootstrap
from ..rundir import PRUNED, RunDir, model_provenance, save_hypotheses
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
    units: List[str] = field(default_factory=lambda: ["heads"])
    latency_budget: Optional[float] = None


UNITS = ("heads", "neurons")


def check_settings(p: DictConfig) -> None:
    check_attention_types(p.types, "prune.types")
    units = list(p.units)
    if not units or set(units) - set(UNITS) or len(set(units)) < len(units):
        raise UserError(f"prune.units={units}: choose heads, neurons (FFN hidden units) or both, e.g. "
                        "prune.units=[heads,neurons] (an MoA layer's experts are pruned as its heads)")
    if p.latency_budget is not None:
        if not 0 < p.latency_budget <= 1:
            raise UserError(f"prune.latency_budget={p.latency_budget} is outside (0, 1]: it is the fraction of the "
                            "unpruned model's latency in CTranslate2 to reach, e.g. prune.latency_budget=0.6")
        if p.layout != "per_stack":
            raise UserError("prune.latency_budget searches the masks CTranslate2 holds, one head count per stack: add "
                            "prune.layout=per_stack")
        if importlib.util.find_spec("ctranslate2") is None:
            raise UserError("prune.latency_budget needs the ctranslate2 package (latency is measured in it): pip "
                            "install 'hprune[deploy]'")
    if not 0 < p.macs_budget <= 1:
        raise UserError(f"prune.macs_budget={p.macs_budget} is outside (0, 1]: it is the fraction of the MACs of "
                        "the prunable units to keep, e.g. prune.macs_budget=0.5")
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


def search_with_neurons(head_sets: List[set], importance: Dict[Head, float], budget: float, costs, types, model,
                        neurons: List[Head]) -> set:
    """Kwon et al.'s search over heads and neurons under one budget (their prune/search.py): for each candidate
    head set, the neurons (most important first) fill the MACs the heads leave, as many as fit; of these, the
    units with the largest summed Fisher information. `head_sets`: the free layout's prefixes of the head order,
    or the per_stack sets; `neurons`: ordered by importance."""
    head_types = [t for t in types if t not in FFN_TYPES]
    cost = torch.tensor([costs[n[:2]].per_unit for n in neurons], dtype=torch.float64)
    spent, gained = torch.cumsum(cost, 0), torch.cumsum(torch.tensor([importance[n] for n in neurons],
                                                                        dtype=torch.float64), 0)
    best, best_value = None, -math.inf
    for heads in head_sets:
        left = budget - (mask_macs(costs, mask_without(model, pool_of(model, head_types) - heads), head_types)
                         if head_types else 0.0)
        if left < -1e-9:
            continue
        fit = int(torch.searchsorted(spent, torch.tensor([left + 1e-9], dtype=torch.float64), right=True))
        value = sum(importance[h] for h in heads) + (float(gained[fit - 1]) if fit else 0.0)
        if value > best_value:
            best, best_value = heads | set(neurons[:fit]), value
    if best is None:
        raise UserError("no mask fits this MACs budget with the heads a layout keeps; raise prune.macs_budget or use "
                        "prune.layout=free")
    return best


def stack_counts(kept: set, model, pool: set) -> Dict[str, int]:
    """The heads per layer each CTranslate2 stack holds for the pool heads `kept` (its largest sublayer's count;
    a sublayer outside the pool keeps every head)."""
    counts: Dict[str, int] = {}
    for attn_type, layer, module in model.attention_modules():
        ids = [(attn_type, layer, h) for h in module.head_ids]
        alive = sum(h in kept for h in ids) if any(h in pool for h in ids) else len(ids)
        counts[STACK[attn_type]] = max(counts.get(STACK[attn_type], 1), alive)
    return counts


def ffn_widths(kept: set, model, neurons: bool) -> Dict[str, List[int]]:
    """Each stack's FFN widths per layer for the units `kept` (every neuron, unless neurons are pruned)."""
    widths: Dict[str, List[int]] = {}
    for ffn_type, layer, block in model.ffn_layers():
        ids = block.fc2.neuron_ids
        widths.setdefault(STACK[ffn_type], []).append(
            sum((ffn_type, layer, n) in kept for n in ids) if neurons else len(ids))
    return widths


def search_latency(head_sets: List[set], importance: Dict[Head, float], budget: float, table, model,
                   pool: set, neurons: List[Head], with_neurons: bool) -> set:
    """Kwon et al.'s search under a latency budget (seconds per sentence), on the latency table's predictions: for
    each per_stack head set, the neurons (most important first) join while the predicted latency fits; of these,
    the units with the largest summed Fisher information. The neurons' joins are the same for every head set (each
    FFN starts empty): their cost is summed once along the order, and the joins that fit found by bisection (each
    join takes time: the latency grows along the order)."""
    lost = neuron_costs(table, model, neurons) if with_neurons else {}
    gained = list(itertools.accumulate((importance[u] for u in neurons), initial=0.0))
    best, best_value, fastest = None, -math.inf, math.inf
    for heads in head_sets:
        savings = table.savings(stack_counts(heads, model, pool), ffn_widths(heads, model, with_neurons))

        def latency(joined: int) -> float:
            return table.latency({**savings, **{f"{stack}_ffn": savings[f"{stack}_ffn"] - cost[joined]
                                                for stack, cost in lost.items()}})

        fastest = min(fastest, latency(0))
        if latency(0) > budget + 1e-12:
            continue
        low, high = 0, len(neurons) if with_neurons else 0  # the most joins that fit: in [low, high]
        while low < high:
            middle = (low + high + 1) // 2
            low, high = (middle, high) if latency(middle) <= budget + 1e-12 else (low, middle - 1)
        value = sum(importance[u] for u in heads) + gained[low]
        if value > best_value:
            best, best_value = set(heads) | set(neurons[:low]), value
    if best is None:
        shares = table.shares()
        held = f"heads hold {100 * shares['heads']:.0f} %" + (
            f" and FFN neurons {100 * shares['ffn']:.0f} %" if with_neurons else "")
        raise UserError(f"no mask meets this latency budget: {held} of this model's time in CTranslate2 (the rest, "
                        f"embeddings, output projection and beam search, cannot be pruned), so the fastest the table "
                        f"predicts is {100 * fastest / table.unpruned:.1f} % of the unpruned latency (one head per "
                        f"stack{', no FFN neuron' if with_neurons else ''}); raise prune.latency_budget to at least "
                        f"{math.ceil(1000 * fastest / table.unpruned) / 1000:g}"
                        f"{'' if with_neurons else ' or prune FFN neurons too (prune.units=[heads,neurons])'}")
    return best


def neuron_costs(table, model, neurons: List[Head]) -> Dict[str, List[float]]:
    """{stack: [the stack's FFN saving lost once the first m neurons of `neurons` have joined, for each m]}, every
    FFN starting empty."""
    widths = {stack: [0] * len(per_layer) for stack, per_layer in ffn_widths(set(), model, True).items()}
    lost = {stack: [0.0] for stack in widths}
    for neuron in neurons:
        stack, layer = STACK[neuron[0]], neuron[1]
        width = widths[stack][layer]
        widths[stack][layer] = width + 1
        for name, costs in lost.items():
            costs.append(costs[-1] + (table.ffn_saving(stack, width) - table.ffn_saving(stack, width + 1)
                                      if name == stack else 0.0))
    return lost


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
def unit_type(sublayer) -> str:
    """A sublayer's attention type, or its FFN type (enc-ffn, dec-ffn)."""
    return sublayer.attn_type or FFN_TYPES[sublayer.stack == "decoder"]


def forward_order(model) -> dict:
    """{(unit type, layer): sublayer} in the order the data meets them (the plugin's Sublayer: attn_type, layer,
    module, the transformer layer and which of its residual connections is this one's)."""
    return {(unit_type(s), s.layer): s for s in model.sublayers()}


def _real(sample: dict, attn_type: str, pad: int) -> torch.Tensor:
    """(len, batch) booleans: the real tokens of the sublayer's queries (time-major, as fairseq's layers)."""
    tokens = sample["net_input"]["src_tokens"] if attn_type in ("enc-self", "enc-ffn") else sample["target"]
    return tokens.ne(pad).t()


def _goal(student, teacher, key, sample: dict) -> torch.Tensor:
    """One forward of each model on `sample`, up to sublayer `key`: the teacher's output of the sublayer plus its
    residual, less the student's residual: what the student's sublayer output should be."""
    update_t, residual_t = teacher.forward_to(forward_order(teacher)[key], **sample["net_input"])
    _, residual_s = student.forward_to(forward_order(student)[key], **sample["net_input"])
    return update_t + residual_t - residual_s


@torch.no_grad()
def neuron_least_squares(student, teacher, ffn_type: str, layer: int, batches: List[dict], pad: int,
                         units: List[int]):
    """The normal equations of the scales of an FFN's neurons `units` (local indices), as least_squares for heads:
    a neuron's share of the output is its activation a_n times its fc2 column w_n, so AᵀA = (WᵀW) ∘ (Σ_t a aᵀ) and
    Aᵀb = Σ_t a_n ⟨w_n, b_t⟩ (the reference's prune/rescale.py, without the (tokens·d, neurons) matrix)."""
    fc2 = forward_order(student)[ffn_type, layer].block.fc2
    columns = fc2.weight[:, units].double()  # (d, kept)
    gram = torch.zeros(len(units), len(units), dtype=torch.float64)
    target = torch.zeros(len(units), dtype=torch.float64)
    student.record_neurons(inputs=True)
    try:
        for sample in batches:
            goal = _goal(student, teacher, (ffn_type, layer), sample)
            real = _real(sample, ffn_type, pad)
            goal = goal[real].double() - (fc2.bias.double() if fc2.bias is not None else 0.0)
            a = fc2.neuron_inputs[real][:, units].double()  # (tokens, kept)
            gram += ((columns.t() @ columns) * (a.t() @ a)).cpu()
            target += (a * (goal @ columns)).sum(0).cpu()
    finally:
        student.record_neurons()
    return gram, target


@torch.no_grad()
def least_squares(student, teacher, attn_type: str, layer: int, batches: List[dict], pad: int, units: List[int]):
    """Normal equations (AᵀA, Aᵀb) of the scales of `units` (local indices) that make the student's sublayer
    output, residual included, closest to the teacher's over the calibration tokens."""
    module = forward_order(student)[attn_type, layer].module
    bias = getattr(getattr(module, "out_proj", None), "bias", None)
    gram = torch.zeros(len(units), len(units), dtype=torch.float64)
    target = torch.zeros(len(units), dtype=torch.float64)
    for sample in batches:
        module.record_contributions = True
        try:
            goal = _goal(student, teacher, (attn_type, layer), sample)
            shares = module.unit_contributions.permute(2, 0, 1, 3)  # (len, batch, units, d)
        finally:
            module.record_contributions, module.unit_contributions = False, None
        real = _real(sample, attn_type, pad)
        goal = goal[real].double()
        if bias is not None:
            goal = goal - bias.double()
        a = shares[real][:, units].double()  # (tokens, kept, d)
        gram += torch.einsum("nkd,njd->kj", a, a).cpu()
        target += torch.einsum("nkd,nd->k", a, goal).cpu()
    return gram, target


def damped_toward_one(gram: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The reference's solver (utils/linalg.py: cupyx LSMR with damp=1 on the normal equations, for δ = s - 1):
    δ minimises ‖Gδ - (t - G·1)‖² + ‖δ‖² (at convergence (G² + I)⁻¹ G (t - G·1)), by scipy's LSMR with the
    reference's defaults: matrix-vector products, where the closed form's G² and solve take 8/3 n³ operations
    (0.96 s a layer at 2,048 neurons on one core, growing as n³ to about a minute at NLLB-1.3B's 8,192; LSMR
    0.17 s at 2,048)."""
    from scipy.sparse.linalg import lsmr
    ones = torch.ones_like(target)
    rest = (target - gram @ ones).numpy()
    delta = lsmr(gram.numpy(), rest, damp=1.0)[0]
    return ones + torch.from_numpy(delta).to(target.dtype)


def tune(session, teacher_mask: dict, mask: dict, types, batches: List[dict], max_scale: float) -> Tuple[dict, str]:
    """Fold the least-squares scales into the kept heads (and neurons, where `types` has FFN types), sublayer by
    sublayer from the bottom. Returns {(type, layer, unit): scale} and why tuning stopped (or "done").
    The teacher keeps every unit the student keeps besides its own: the looser search that gives it may choose
    another layout (other head counts per stack; fewer heads and more neurons), and a teacher without some of the
    student's units would have the tuning undo them (a departure where the reference's is no superset:
    docs/methods.md)."""
    model = session.model
    teacher = copy.deepcopy(model)
    teacher.set_head_mask({kind: [[max(t, s) for t, s in zip(row_t, row_s)] for row_t, row_s in zip(rows, mask[kind])]
                           for kind, rows in teacher_mask.items()})
    session.set_mask(mask)
    model.eval()
    teacher.eval()
    scales: Dict[Head, float] = {}
    stopped = "done"
    first = {"enc-self": 0, "dec-self": 0}
    for (kind, layer), sublayer in forward_order(model).items():
        module = sublayer.module if kind not in FFN_TYPES else sublayer.block.fc2
        ids = module.head_ids if kind not in FFN_TYPES else module.neuron_ids
        if kind not in types or first.get(kind) == layer:
            continue
        units = [i for i, h in enumerate(ids) if mask[kind][layer][h]]
        if not units:
            continue
        solve = least_squares if kind not in FFN_TYPES else neuron_least_squares
        gram, target = solve(model, teacher, kind, layer, batches, session.pad, units)
        if kind in FFN_TYPES:  # hundreds of scales: the reference's damped solve (below) keeps them near 1
            solution = damped_toward_one(gram, target)
        else:
            solution = torch.linalg.lstsq(gram, target.unsqueeze(-1)).solution.squeeze(-1)
        if not torch.isfinite(solution).all() or solution.abs().max() > max_scale:
            stopped = f"stopped at {kind} layer {layer}: scales outside ±{max_scale:g} (the reference's rule)"
            break
        values = torch.ones(len(ids), dtype=torch.float64)
        values[units] = solution
        module.scale_units(values.to(next(module.parameters()).device))
        scales.update({(kind, layer, ids[u]): float(s) for u, s in zip(units, solution)})
    del teacher
    return scales, stopped


# --------------------------------------------------------------------------------------------- the method
@register_method("fisher", procedure=True, settings=FisherSettings, check=check_settings,
                 report=Report(knobs=("macs_budget",), title="Kwon et al. (fisher)"))
def fisher(session, cfg: DictConfig, out: Path) -> dict:
    """Kwon et al. 2022: Fisher-ranked heads under a MACs budget, rearranged and rescaled, without retraining."""
    p, c, evaluator, seconds = cfg.prune, cfg.prune.calibration, Evaluator.of(session, cfg), {}
    with timed(seconds, "calibration"):  # the calibration data first: a missing or empty split stops before any output
        batches = session.sampled_batches(c.split, c.sentences, c.batch_size, c.seed)
    prunable = Prunable.of(evaluator, p)
    unpruned = evaluator.evaluate(None)
    save_hypotheses(out, "unpruned", unpruned)
    with timed(seconds, "fisher"):
        scores = FisherScores.of(session, batches, p.fisher.removeprefix("per_"), prunable.neurons)
    chosen = choose(session, cfg, prunable, scores, seconds)
    mask = prunable.mask_keeping(chosen.final)
    stages, results = evaluate_stages(evaluator, prunable, chosen.stages, unpruned, out)
    scales, stopped = {}, "off"
    if p.tune:  # stage 4, against the teacher the looser search found
        with timed(seconds, "tune"):
            scales, stopped = tune(session, prunable.mask_keeping(chosen.looser), mask, prunable.types, batches,
                                   p.tune_max_scale)
        results["tuned"] = evaluator.evaluate(mask)
        stages.append(_stage_row(evaluator, "tuned", mask, results["tuned"], unpruned, prunable.types, prunable.base))
    compare_stages(stages, results, cfg.significance)
    result = results["tuned" if p.tune else ("rearranged" if p.rearrange else "search")]
    save_hypotheses(out, "pruned", result)
    write_tables(out, p, prunable, scores, chosen, scales, stages, mask)
    metrics = run_metrics(evaluator, cfg, prunable, chosen, mask, result, results, unpruned, batches, stopped, seconds)
    if p.export:
        metrics.update(write_checked(evaluator, mask, RunDir(out).checkpoint(PRUNED), result))
    print(pd.DataFrame(stages).to_string(index=False))
    print(summary(metrics))
    return metrics


@contextlib.contextmanager
def timed(seconds: Dict[str, float], stage: str) -> Iterator[None]:
    """Record in `seconds` how long the block took, as `stage` (metrics.json's seconds_<stage>)."""
    started = time.perf_counter()
    yield
    seconds[stage] = time.perf_counter() - started


@dataclass
class Prunable:
    """What a run prunes: the units of `types` in `pool` (the heads of prune.types, and every FFN neuron where
    prune.units has neurons), `heads` the pool's heads, their MACs per target token (`costs`) and those of the
    whole pool (`base`, the budget's unit)."""
    model: torch.nn.Module
    types: List[str]
    neurons: bool
    pool: set
    heads: set
    costs: dict
    base: float

    @classmethod
    def of(cls, evaluator: Evaluator, p: DictConfig) -> "Prunable":
        model, neurons = evaluator.session.model, "neurons" in p.units
        types = (list(p.types) if "heads" in p.units else []) + (list(FFN_TYPES) if neurons else [])
        pool = pool_of(model, types)
        costs = evaluator.unit_costs()
        base = mask_macs(costs, mask_without(model, (), neurons), types)
        return cls(model, types, neurons, pool, {unit for unit in pool if unit[0] not in FFN_TYPES}, costs, base)

    def mask_keeping(self, kept: set) -> dict:
        """The mask that removes every unit of the pool but `kept`."""
        return mask_without(self.model, self.pool - kept, self.neurons)


@dataclass
class FisherScores:
    """Stage 1: each unit's mask gradients (a row per calibration sentence, or per batch), in the model's order,
    and its importance, Σ_s g_su² (the diagonal of the empirical Fisher information)."""
    units: List[Head]
    grads: torch.Tensor
    importance: torch.Tensor

    @classmethod
    def of(cls, session, batches: List[dict], per: str, neurons: bool) -> "FisherScores":
        units, grads = mask_gradients(session.model, batches, session.pad, per=per, neurons=neurons)
        return cls(units, grads, grads.pow(2).sum(0))

    def order(self, pool: set) -> List[Head]:
        """The units of `pool`, most important first (ties in the model's order)."""
        units, importance = self.units, self.importance
        return [units[i] for i in sorted(range(len(units)), key=lambda i: (-float(importance[i]), i)) if units[i] in pool]

    def by_unit(self) -> Dict[Head, float]:
        return {unit: float(self.importance[i]) for i, unit in enumerate(self.units)}


@dataclass
class LatencySearch:
    """How a latency budget was searched: the latency table, the target fraction the kept mask was found for, its
    fraction measured in CTranslate2 (None: not measured) and each measurement (`calibrated`)."""
    table: LatencyTable
    target: float
    measured: Optional[float]
    calibration: list
    ratios: tuple = ()  # the kept mask's measurement, round by round (latency_metrics: its noise)


@dataclass
class Chosen:
    """The units kept after each stage that chooses them ("search", then "rearranged" with prune.rearrange), the
    looser search's at the budget's square root (the tuning's teacher), and a latency budget's search."""
    stages: Dict[str, set]
    looser: set
    latency: Optional[LatencySearch] = None

    @property
    def final(self) -> set:
        return self.stages.get("rearranged", self.stages["search"])


def choose(session, cfg: DictConfig, prunable: Prunable, scores: FisherScores, seconds: dict) -> Chosen:
    """Stages 2 and 3: the search under the budget (and its square root), then the rearrangement."""
    p, order = cfg.prune, scores.order(prunable.pool)
    if p.latency_budget is not None:  # per_stack (checked): CTranslate2's layout
        searched, looser, latency = search_under_latency(session, cfg, prunable, order, scores.by_unit(), seconds)
    else:
        with timed(seconds, "search"):
            searched, looser = search_under_macs(p, prunable, order, scores.by_unit())
        latency = None
    chosen = Chosen({"search": searched}, looser, latency)
    if p.rearrange:
        with timed(seconds, "rearrange"):
            chosen.stages["rearranged"] = rearrange(searched, scores.units, scores.grads, prunable.types)
    return chosen


def search_under_macs(p: DictConfig, prunable: Prunable, order: List[Head], by_unit: Dict[Head, float]) -> List[set]:
    """The units kept under the MACs budget and under its square root, by the search the settings choose."""
    fractions = (p.macs_budget, math.sqrt(p.macs_budget))
    model, costs, types, pool, heads = prunable.model, prunable.costs, prunable.types, prunable.pool, prunable.heads
    if prunable.neurons:  # the reference's sweep: each number of heads (at least one), the neurons filling the rest
        head_order = [unit for unit in order if unit in heads]
        head_sets = per_stack_masks(heads, by_unit, layer_floor(p.layout, 0)) if p.layout == "per_stack" else \
            [set(head_order[:n]) for n in range(min(1, len(head_order)), len(head_order) + 1)]
        neuron_order = [unit for unit in order if unit not in heads]
        return [search_with_neurons(head_sets or [set()], by_unit, fraction * prunable.base, costs, types, model,
                                    neuron_order) for fraction in fractions]
    if p.layout == "per_stack":  # rearrangement keeps each layer's count: the layout survives it
        return [search_per_stack(by_unit, fraction * prunable.base, costs, types, model, pool, layer_floor(p.layout, 0))
                for fraction in fractions]
    return [search(order, fraction * prunable.base, costs, types, model, pool) for fraction in fractions]


def search_under_latency(session, cfg: DictConfig, prunable: Prunable, order: List[Head], by_unit: Dict[Head, float],
                         seconds: dict) -> Tuple[set, set, LatencySearch]:
    """The units kept under the latency budget (searched on the latency table, checked by measurement) and under
    the square root of the target it was found for."""
    p, model, heads = cfg.prune, prunable.model, prunable.heads
    with timed(seconds, "latency_table"):
        if moa_types(model):
            raise UserError("prune.latency_budget is measured in CTranslate2, which has no mixture-of-attention layer: "
                            "prune an MoA model's experts under prune.macs_budget (and its FFN neurons with "
                            "prune.units=[heads,neurons])")
        settings = LatencySettings(**cfg.latency)
        table = table_of(session, settings, Path(cfg.paths.data_root) / "latency")
    with timed(seconds, "search"):
        head_sets = per_stack_masks(heads, by_unit, layer_floor(p.layout, 0)) if heads else [set()]
        neuron_order = [unit for unit in order if unit not in heads]

        def search_at(fraction: float) -> set:
            return search_latency(head_sets, by_unit, fraction * table.unpruned, table, model, heads, neuron_order,
                                  prunable.neurons)

        predicted = {}  # target: the table's prediction for the mask found for it
        rounds = {}  # measured fraction: its rounds' ratios

        def measure(kept: set, target: float) -> float:
            mask = prunable.mask_keeping(kept)
            timing = seconds_per_sentence(session, mask, settings)
            fraction = timing["pruned"] / timing["unpruned"]
            rounds[round(fraction, 4)] = tuple(timing["ratios"])
            predicted[round(target, 4)] = round(predicted_latency(table, model, mask), 4)
            print(f"latency budget {p.latency_budget:g}: the mask found for the table's {100 * target:.1f} % "
                  f"(predicted {100 * predicted[round(target, 4)]:.1f} %) measures {100 * fraction:.1f} % in "
                  f"CTranslate2 ({settings.compute_type}, {settings.threads} thread(s), beam {settings.beam})")
            return fraction

        searched, target, measured, calibration = calibrated(search_at, measure, p.latency_budget,
                                                             settings.calibrate, settings.calibrate_tolerance)
        calibration = [{**row, "predicted": predicted[row["target"]]} for row in calibration]
        looser = search_at(math.sqrt(target))
    return searched, looser, LatencySearch(table, target, measured, calibration,
                                           rounds.get(round(measured, 4), ()) if measured is not None else ())


def evaluate_stages(evaluator: Evaluator, prunable: Prunable, stages: Dict[str, set], unpruned: Evaluation,
                    out: Path) -> Tuple[List[dict], Dict[str, Evaluation]]:
    """Each stage's mask evaluated, its translations saved: stages.csv's rows, and the evaluations by stage."""
    rows, results = [], {}
    for stage, kept in stages.items():
        stage_mask = prunable.mask_keeping(kept)
        results[stage] = evaluator.evaluate(stage_mask)
        save_hypotheses(out, stage, results[stage])
        rows.append(_stage_row(evaluator, stage, stage_mask, results[stage], unpruned, prunable.types, prunable.base))
    return rows, results


def compare_stages(stages: List[dict], results: Dict[str, Evaluation], sig: DictConfig) -> None:
    """Each stage's row gets its paired bootstrap against the stage before it, on the same sentences."""
    names = list(results)
    for row, before, stage in zip(stages[1:], names, names[1:]):
        test = paired_bootstrap(results[before].hypotheses, results[stage].hypotheses, results[stage].references,
                                sig.resamples or STAGE_RESAMPLES, sig.seed, results[stage].bleu_tokenize)
        row.update(p_vs_previous=round(test["p_value"], 4), significant_vs_previous=test["significant"])


def write_tables(out: Path, p: DictConfig, prunable: Prunable, scores: FisherScores, chosen: Chosen, scales: dict,
                 stages: List[dict], mask: dict) -> None:
    """fisher.csv (each unit's importance, what each stage kept, its scale), stages.csv, head_mask.json."""
    final, looser = chosen.final, chosen.looser
    table = pd.DataFrame([{"type": h[0], "layer": h[1], "head": h[2], "fisher": float(scores.importance[i]),
                           "kept_search": int(h in chosen.stages["search"]), "kept": int(h in final),
                           "teacher": int(h in looser or h in final) if p.tune else None,  # as tune() takes it
                           "scale": scales.get(h, 1.0 if h in final else 0.0)}
                          for i, h in enumerate(scores.units) if h[0] in prunable.types])
    write_atomic(out / "fisher.csv", table.to_csv(index=False))
    write_atomic(out / "stages.csv", pd.DataFrame(stages).to_csv(index=False))
    write_json(RunDir(out).head_mask, mask)


def run_metrics(evaluator: Evaluator, cfg: DictConfig, prunable: Prunable, chosen: Chosen, mask: dict,
                result: Evaluation, results: Dict[str, Evaluation], unpruned: Evaluation, batches: List[dict],
                stopped: str, seconds: dict) -> dict:
    """metrics.json's keys, the export's aside (`result`: the final stage's evaluation)."""
    p, model, pool, heads = cfg.prune, prunable.model, prunable.pool, prunable.heads
    macs, base = mask_macs(prunable.costs, mask, prunable.types), prunable.base
    neuron_pool = pool - heads
    metrics = {
        "method": "fisher", "layout": p.layout, "split": cfg.split,
        "types": [t for t in prunable.types if t not in FFN_TYPES], "units": list(p.units),
        "macs_budget": p.macs_budget if p.latency_budget is None else None,
        "calibration_split": p.calibration.split, "calibration_sentences": sum(len(b["id"]) for b in batches),
        "rearrange": p.rearrange, "tune": p.tune, "tuning": stopped,
        **trained.outcome(evaluator, list(p.types), heads or pool_of(model, p.types), heads - chosen.final, mask,
                          result, unpruned),
        **{f"bleu_{stage}": results[stage].bleu for stage in results},
        **({"neurons_pool": len(neuron_pool), "kept_neurons": len(neuron_pool & chosen.final),
            "macs_pool": round(base), "macs_kept": round(macs), "macs_pct": round(100 * macs / base, 2)}
           if prunable.neurons else {"attention_macs_pool": round(base), "attention_macs_kept": round(macs)}),
        **{f"seconds_{stage}": round(s, 3) for stage, s in seconds.items()}, "seconds": round(sum(seconds.values()), 3),
        **model_provenance(evaluator.session),
    }
    if chosen.latency is not None:
        metrics.update(latency_metrics_of(chosen.latency, p.latency_budget, model, mask))
    return metrics


def latency_metrics_of(search: LatencySearch, budget: float, model, mask: dict) -> dict:
    """The table's prediction beside the kept mask's measurement (of the searched mask: rearranging and tuning keep
    every layer's head count and FFN width, all CTranslate2's latency depends on); without one, Model.prune
    measures."""
    found = {"latency_budget": budget, "latency_table": search.table.key,
             "latency_pct_predicted": round(100 * predicted_latency(search.table, model, mask), 2),
             "latency_calibration": search.calibration, "latency_target": round(search.target, 4)}
    if search.measured is not None:
        found.update(latency_metrics(search.measured, search.ratios), latency_met=search.measured <= budget)
    return found


def predicted_latency(table, model, mask: dict) -> float:
    """The latency table's prediction for `mask`, as a fraction of the unpruned model's."""
    kept = {(t, layer, u) for t, rows in mask.items() for layer, row in enumerate(rows) for u, v in enumerate(row) if v}
    counts = stack_counts(kept, model, pool_of(model, ATTENTION_TYPES))
    return table.predict(counts, ffn_widths(kept, model, any(t in mask for t in FFN_TYPES))) / table.unpruned


def _stage_row(evaluator: Evaluator, stage: str, mask: dict, result: Evaluation, unpruned: Evaluation, types,
               base: float) -> dict:
    head_types = [t for t in types if t not in FFN_TYPES]
    row = {"stage": stage, "kept_heads": sum(sum(map(sum, mask[attn_type])) for attn_type in head_types),
           "attention_macs_pct": evaluator.attention_macs_pct(mask, head_types)}
    if len(head_types) < len(types):  # neurons too: the budget's MACs are those of heads and neurons
        row.update(kept_neurons=sum(sum(map(sum, mask[t])) for t in FFN_TYPES),
                   macs_pct=round(100 * mask_macs(evaluator.unit_costs(), mask, types) / base, 2))
    return {**row, "bleu": result.bleu, "delta_bleu": result.delta_bleu(unpruned), "valid_loss": result.valid_loss}


def summary(m: dict) -> str:
    neurons = (f"{m['kept_neurons']} of {m['neurons_pool']} FFN neurons kept, {m['macs_pct']:g} % of the MACs of "
               "heads and neurons, ") if "kept_neurons" in m else ""
    budget = f"latency budget {m['latency_budget']:g}" if "latency_budget" in m else f"MACs budget {m['macs_budget']:g}"
    lines = [f"{budget}: {m['kept_heads']} of {m['heads_pool']} heads kept ({describe_kept(m)}), "
             f"{neurons}{m['attention_macs_pct']:g} % of the attention MACs; BLEU {m['bleu']:.2f} ({m['delta_bleu']:+.2f} vs "
             f"unpruned) in {m['seconds']:.1f} s without retraining (tuning: {m['tuning']})"]
    if "latency_met" in m:
        lines.append(f"latency in CTranslate2: {m['latency_pct_measured']:g} % of the unpruned model's, measured "
                     f"(the table predicts {m['latency_pct_predicted']:g} %), after {len(m['latency_calibration'])} "
                     "measurement(s): " + ("the budget is met" if m["latency_met"] else
                                           "the budget is NOT met (more searches, latency.calibrate, or a "
                                           "lower prune.latency_budget may reach it)"))
    elif "latency_budget" in m:
        lines.append(f"the latency table predicts {m['latency_pct_predicted']:g} % of the unpruned model's latency in "
                     "CTranslate2 (measured next)")
    if "export_checkpoint" in m:
        lines.append(f"pruned checkpoint: {m['export_checkpoint']} ({m['params_removed_pct']} % fewer parameters, "
                     f"{m['attention_macs_per_token_pruned']:,} attention MACs per token counted, BLEU "
                     f"{m['export_bleu']:.2f})")
    return "\n".join(lines)
