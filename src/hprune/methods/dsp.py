"""`hprune prune --method dsp prune.head_budget=K ckpt=PATH`: Differentiable Subset Pruning (Li, Cotterell and
Sachan, TACL 2021; code rycolab/differentiable-subset-pruning), from a converged checkpoint.

1. Continue training with fairseq-train (an interrupted run resumes) with one logit per head of prune.types
   and, at every step, a Gumbel soft top-K mask on the head outputs (the plugin's subset.py): temperature
   falling log-linearly from temperature[0] to temperature[1] over `cooldown` steps (the reference code's
   schedule), or the straight-through hard top-K. With `joint` the model's weights train with the logits (the
   reference's joint pruning), without it only the logits do (its pipelined pruning).
2. Read out the hard top-K of the logits: exactly K heads kept (dsp_logits.csv, head_mask.json), the selection
   folded into the weights, so the masked model computes what the selecting model did in eval mode (its BLEU
   `bleu_selector` is the check).
3. Optionally fine-tune with the mask fixed, and export the physically pruned model (as Voita's gates).
A run with K = every head of the pool selects nothing: it is the control of the joint runs (the same extra
training without the selection), which `hprune report` measures them against.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List

import pandas as pd
from omegaconf import MISSING, DictConfig

from .. import backend
from ..attention_types import check_attention_types
from ..errors import UserError
from ..evaluation import Evaluator
from ..files import write_atomic
from ..pruning.heads import describe_kept, pool_of
from ..reporting import plots
from . import Control, MethodSettings, Report, register_method, trained
from .curve import FinetuneSettings


@dataclass
class DspSettings(MethodSettings):
    """configs/prune/dsp.yaml: the reference code's values, with their sources."""
    head_budget: int = MISSING
    temperature: List[float] = field(default_factory=lambda: [0.1, 1.0e-8])
    cooldown: int = 250
    straight_through: bool = False
    joint: bool = True
    pruning_lr: float = 0.2
    optim: Dict[str, Any] = field(default_factory=dict)  # fairseq-train flags of the training
    finetune: FinetuneSettings = field(default_factory=FinetuneSettings)
    export: bool = False


def check_settings(p: DictConfig) -> None:
    check_attention_types(p.types, "prune.types")
    if p.head_budget < 1:
        raise UserError(f"prune.head_budget={p.head_budget}: DSP keeps exactly K heads, K >= 1; e.g. "
                        "prune.head_budget=18")
    initial, final = p.temperature
    if not (initial > 0 and final > 0) or p.cooldown < 0 or p.pruning_lr <= 0:
        raise UserError(f"prune.temperature={list(p.temperature)} must be two temperatures > 0, prune.cooldown="
                        f"{p.cooldown} >= 0 and prune.pruning_lr={p.pruning_lr} > 0")
    if p.optim.lr_scheduler != "fixed":
        raise UserError(f"prune.optim.lr_scheduler={p.optim.lr_scheduler}: DSP gives its logits the learning rate "
                        "prune.pruning_lr through a fixed schedule; use prune.optim.lr_scheduler=fixed")
    if p.finetune.updates < 0:
        raise UserError(f"prune.finetune.updates={p.finetune.updates} must be >= 0")
    backend.check_schedule(p.optim, "prune.optim")


def selection_options(p: DictConfig) -> list:
    """The model flags of the DSP training (the plugin's --dsp-*)."""
    options = ["--dsp-heads", str(p.head_budget), "--dsp-types", ",".join(p.types),
               "--dsp-temperature", ",".join(str(float(t)) for t in p.temperature), "--dsp-cooldown", str(p.cooldown),
               "--dsp-logit-scale", str(p.pruning_lr / p.optim.lr)]  # Adam: logits move ~pruning_lr a step
    if p.straight_through:
        options.append("--dsp-straight-through")
    if not p.joint:
        options.append("--dsp-logits-only")
    return options


def logit_table(model) -> pd.DataFrame:
    """One row per selectable head: its logit and whether the read-out keeps it."""
    selector = model.head_selector
    logits, kept = selector.logits.detach().cpu().tolist(), selector.deterministic().cpu().tolist()
    heads = [(attn_type, layer, h) for attn_type, layer, m in model.attention_modules() if m.gate is not None for h in m.head_ids]
    return pd.DataFrame([{"type": attn_type, "layer": layer, "head": h, "logit": round(logit, 6), "kept": int(k)}
                         for (attn_type, layer, h), logit, k in zip(heads, logits, kept)])


# K = every head: the same continued training, nothing selected
CONTROL = Control("K=all control", lambda p, metrics: metrics["control"], Control.shares + ("prune.joint",))


REPORT = Report(knobs=("head_budget",), columns=("bleu_finetuned",), sweep_columns=("bleu_finetuned",),
                heatmaps=(("dsp_logits.csv", "logit", "DSP logits"),), title="DSP")


@register_method("dsp", procedure=True, settings=DspSettings, check=check_settings, control=CONTROL, report=REPORT)
def dsp(session, cfg: DictConfig, out: Path) -> dict:
    """Li et al. 2021: a Gumbel soft top-K over learned head logits keeps exactly K heads."""
    p, start = cfg.prune, Evaluator.of(session, cfg)
    pool = pool_of(session.model, p.types)
    if p.head_budget > len(pool):
        raise UserError(f"prune.head_budget={p.head_budget} is more heads than {', '.join(p.types)} has "
                        f"({len(pool)}); use 1..{len(pool)} ({len(pool)}: the control, nothing selected)")
    pool, unpruned = trained.unpruned(start, cfg, out)

    with trained.train(start, cfg, selection_options(p), out, "subset selection") as (selecting, seconds):
        logits = logit_table(selecting.session.model)
        bleu_selector = selecting.translate()[1].bleu  # eval mode: the hard top-K
        logits, closed, mask, pruned = trained.read_out(selecting, logits, "logit", p, out)
        write_atomic(out / "dsp_logits.csv", logits.to_csv(index=False))
        plots.head_heatmaps(logits, "logit", out / "dsp_logits.png", f"DSP logits, K = {p.head_budget}")
        metrics = {
            **trained.metrics(start, cfg, pool, closed, mask, pruned, unpruned, seconds),
            "head_budget": p.head_budget, "joint": p.joint, "straight_through": p.straight_through,
            "temperature_initial": float(p.temperature[0]), "temperature_final": float(p.temperature[1]),
            "cooldown": p.cooldown, "pruning_lr": p.pruning_lr, "bleu_selector": bleu_selector,
            "control": p.head_budget == len(pool),
        }
        metrics.update(trained.finetune_and_export(start, selecting, cfg, mask, pruned, unpruned, out))
    print(summary(metrics))
    return metrics


def summary(m: dict) -> str:
    mode = "straight-through" if m["straight_through"] else f"τ {m['temperature_initial']:g} -> {m['temperature_final']:g}"
    lines = [f"DSP K={m['head_budget']} ({'joint' if m['joint'] else 'logits only'}, {mode}): {m['kept_heads']} of "
             f"{m['heads_pool']} heads kept ({describe_kept(m)}); BLEU {m['bleu']:.2f} ({m['delta_bleu']:+.2f} vs the start)"
             + (" [the control: nothing selected]" if m["control"] else "")]
    return "\n".join(lines + trained.export_lines(m))
