"""`hprune prune --method voita ckpt=PATH`: Hard Concrete head gates trained with an L0 penalty (Voita et al.).

1. Continue training the converged checkpoint with fairseq-train (so an interrupted run resumes): a gate on every
   head of `prune.types`, the `hprune` criterion, a fixed λ or a head budget that adjusts λ.
2. Read the deterministic gates out (gates.csv): a head is alive when its gate is > 0 (head_mask.json). The
   gates are folded into the out_proj weights, so the masked ungated model computes exactly what the gated one
   did; its BLEU is the run's BLEU (and `bleu_gates`, the gated model's own, checks that).
3. Optionally (a) fine-tune with that mask fixed, (b) train the same head configuration from scratch, and
   export the physically pruned model.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

import pandas as pd
from omegaconf import DictConfig, OmegaConf

from .. import backend
from ..attention_types import check_attention_types
from ..checkpoint_ref import identify
from ..errors import UserError
from ..evaluation import Evaluation, Evaluator
from ..files import write_atomic
from ..pruning.heads import describe_kept, pool_of
from ..reporting import plots
from ..reporting.significance import paired_bootstrap
from ..rundir import BEST, LAST, RunDir, save_hypotheses
from . import Control, MethodSettings, Report, register_method, trained
from .curve import FinetuneSettings

ALIVE_COLUMNS = ("kept_heads", "alive_heads", "open_heads", "l0_lambda")  # logged by the gates (criterion hprune)


@dataclass
class VoitaSettings(MethodSettings):
    """configs/prune/voita.yaml: the paper's and the reference code's values, with their sources."""
    types: List[str] = field(default_factory=lambda: ["enc-self"])
    l0_lambda: float = 0.1
    l0_normalize: str = "layer_mean"
    head_budget: Optional[int] = None
    budget_gain: float = 0.05
    budget_warmup: int = 400
    gate_init: Optional[float] = None
    freeze_decoder: bool = True
    optim: Dict[str, Any] = field(default_factory=dict)  # fairseq-train flags of the gated training
    finetune: FinetuneSettings = field(default_factory=FinetuneSettings)
    from_scratch: bool = False
    export: bool = False


def check_settings(p: DictConfig) -> None:
    types = check_attention_types(p.types, "prune.types")
    if p.l0_lambda < 0:
        raise UserError(f"prune.l0_lambda={p.l0_lambda} is negative; use λ >= 0 (e.g. 0.01 to 0.1)")
    if p.l0_normalize not in ("sum", "layer_mean"):
        raise UserError(f"prune.l0_normalize={p.l0_normalize}: use sum (paper) or layer_mean (reference code)")
    if p.freeze_decoder and types != ["enc-self"]:
        raise UserError("prune.freeze_decoder=true trains only the encoder, so only enc-self gates would learn; "
                        "set prune.types=[enc-self] or prune.freeze_decoder=false")
    if p.head_budget is not None and (p.budget_gain <= 0 or p.budget_warmup < 0):
        raise UserError(f"prune.budget_gain={p.budget_gain} must be > 0 and prune.budget_warmup="
                        f"{p.budget_warmup} >= 0")
    if p.finetune.updates < 0:
        raise UserError(f"prune.finetune.updates={p.finetune.updates} must be >= 0")
    backend.check_schedule(p.optim, "prune.optim")


def check_budget(p: DictConfig, n_heads: int) -> None:
    if p.head_budget is not None and not 0 <= p.head_budget <= n_heads:
        raise UserError(f"prune.head_budget={p.head_budget} is not a number of heads this model can keep: "
                        f"{', '.join(p.types)} has {n_heads}; use 0..{n_heads}")


def training_recipe(ckpt: Path) -> DictConfig:
    """The `hprune train` settings ckpt was trained with (its run dir's config)."""
    run = identify(ckpt).run
    recipe = run.config() if run is not None else None
    if recipe is None or recipe.get("verb") != "train":
        raise UserError(f"prune.from_scratch=true needs the `hprune train` run of {ckpt} (no run dir holds it); "
                        "train the control yourself: hprune train head_mask=<this run>/head_mask.json <its settings>")
    return OmegaConf.create(recipe)


def alive_over_training(log: Path) -> pd.DataFrame:
    """(num_updates, kept, alive and expected open heads, λ) from fairseq's progress lines in the run's log."""
    rows = []
    for line in log.read_text().splitlines() if log.exists() else []:
        if "train_inner" in line and "alive_heads=" in line:
            fields = dict(re.findall(r"(\w+)=(-?[\d.]+)", line))
            rows.append((int(fields["num_updates"]), *(float(fields[k]) for k in ALIVE_COLUMNS)))
    return pd.DataFrame(rows, columns=["num_updates", *ALIVE_COLUMNS])


def gate_table(model) -> pd.DataFrame:
    """One row per gated head: log α, P(open), the deterministic gate, kept (gate > 0: the read-out keeps it) and
    alive (Voita et al.'s count: P(open) > 0.5 and gate > 0)."""
    rows = []
    for attn_type, layer, m in model.gated_modules():  # (Hard Concrete gates: the mechanism this method trains)
        for log_alpha, p_open, gate, head in zip(m.gate.log_alpha.tolist(), m.gate.p_open().tolist(),
                                                 m.gate.deterministic().tolist(), m.head_ids):
            rows.append({"type": attn_type, "layer": layer, "head": head, "log_alpha": round(log_alpha, 6),
                         "p_open": round(p_open, 6), "gate": round(gate, 6), "kept": int(gate > 0),
                         "alive": int(p_open > 0.5 and gate > 0)})
    return pd.DataFrame(rows)


def exact_budget(gates: pd.DataFrame, budget: int) -> pd.DataFrame:
    """The head budget's controller lands within a head or two of K: read out exactly the K heads with the largest
    log α (P(open) and the deterministic gate rise with it, so where the gates kept K this is their read-out).
    `kept_gates` keeps the gates' own (gate > 0); a head kept here whose gate is 0 is reopened at its full output
    when the gates are folded (Session.fold_mechanisms)."""
    top = gates.sort_values("log_alpha", ascending=False, kind="stable").index[:budget]
    return gates.assign(kept_gates=gates["kept"], kept=gates.index.isin(top).astype(int))


def gate_options(p: DictConfig) -> list:
    """The model and criterion flags of the gated training."""
    options = ["--l0-lambda", str(p.l0_lambda), "--l0-normalize", p.l0_normalize, "--head-gates", ",".join(p.types)]
    if p.head_budget is not None:
        options += ["--l0-budget", str(p.head_budget), "--l0-budget-gain", str(p.budget_gain),
                    "--l0-budget-warmup", str(p.budget_warmup)]
    options += ["--gate-log-alpha-init", str(p.gate_init)] if p.gate_init is not None else []
    return options + (["--freeze-decoder"] if p.freeze_decoder else [])


def from_scratch(start: Evaluator, cfg: DictConfig, recipe: DictConfig, mask_path: Path, out: Path,
                 unpruned: Evaluation) -> dict:
    """Voita et al.'s control: the surviving head configuration trained from scratch, with the checkpoint's own
    training settings (model, optim, seed) on this run's data; its BLEU on the same split. Its own reference is
    the start model: the full head configuration trained from scratch by the same recipe (`unpruned`, its
    evaluation), so delta_bleu_scratch is what the head configuration alone costs, with its paired bootstrap
    p-value when significance.resamples is set."""
    data = start.session.data
    control = OmegaConf.create({
        "model": recipe.model, "optim": recipe.optim, "seed": recipe.seed, "log_interval": recipe.log_interval,
        "save_interval_updates": recipe.save_interval_updates, "data": OmegaConf.to_container(data, resolve=True),
        "device": cfg.device, "precision": cfg.precision, "head_mask": str(mask_path),
        "tensorboard": cfg.get("tensorboard", False)})
    scratch = RunDir(out / "scratch")
    save = scratch.checkpoints
    backend.train(backend.train_argv(control, start.session.data_bin, save), script=out / "scratch" / "fairseq-train.sh",
                  label="from scratch", distributed=cfg.get("distributed"))
    trained = start.reopen(scratch.checkpoint(BEST))
    result = trained.evaluate(None)
    save_hypotheses(out, "scratch", result)
    metrics = {"bleu_scratch": result.bleu, "delta_bleu_scratch": result.delta_bleu(unpruned),
               "valid_loss_scratch": result.valid_loss,
               "scratch_checkpoint": str(scratch.checkpoint(BEST).absolute()),
               "scratch_updates": backend.checkpoint_summary(scratch.checkpoint(LAST))["num_updates"]}
    sig = cfg.significance
    if sig.resamples:
        test = paired_bootstrap(unpruned.hypotheses, result.hypotheses, result.references, sig.resamples,
                                sig.seed, result.bleu_tokenize)
        metrics.update(p_scratch_vs_start=round(test["p_value"], 4), significant_scratch_vs_start=test["significant"])
    return metrics


# λ = 0 without a head budget: the same continued training with gates but no penalty
CONTROL = Control("λ=0 control", lambda p, metrics: p.l0_lambda == 0 and p.head_budget is None,
                  Control.shares + ("prune.l0_normalize", "prune.gate_init", "prune.freeze_decoder"))


REPORT = Report(knobs=("l0_lambda", "head_budget"),
                columns=("alive_heads", "bleu_finetuned", "bleu_scratch", "delta_bleu_scratch", "p_scratch_vs_start"),
                sweep_columns=("bleu_finetuned", "bleu_scratch"),
                heatmaps=(("gates.csv", "gate", "deterministic gates"),), title="Voita gates")


@register_method("voita", procedure=True, settings=VoitaSettings, check=check_settings, control=CONTROL,
                 report=REPORT)
def voita(session, cfg: DictConfig, out: Path) -> dict:
    """Voita et al. 2019: Hard Concrete gates trained with an L0 penalty; closed gates are pruned heads."""
    p, start = cfg.prune, Evaluator.of(session, cfg)
    recipe = training_recipe(session.checkpoint) if p.from_scratch else None
    check_budget(p, len(pool_of(session.model, p.types)))
    pool, unpruned = trained.unpruned(start, cfg, out)

    with trained.train(start, cfg, gate_options(p), out, "gates") as (gated, seconds):
        gates = gate_table(gated.session.model)
        kept_by_gates = int(gates["kept"].sum())
        if p.head_budget is not None:
            gates = exact_budget(gates, p.head_budget)
        bleu_gates = gated.translate()[1].bleu  # eval mode: the deterministic gates
        gates, closed, mask, pruned = trained.read_out(gated, gates, "log_alpha", p, out)

        write_atomic(out / "gates.csv", gates.to_csv(index=False))
        plots.head_heatmaps(gates, "gate", out / "gates.png", "deterministic gates, "
                            + (f"λ={p.l0_lambda}" if p.head_budget is None else f"budget {p.head_budget} heads"))
        alive = alive_over_training(out / "prune.log")
        if len(alive):
            write_atomic(out / "alive_heads.csv", alive.to_csv(index=False))
            plots.line(alive, "num_updates", ["kept_heads", "alive_heads", "open_heads"], out / "alive_heads.png",
                       "gated heads over training: kept (gate > 0), alive (P(open) > 0.5), expected open")
        metrics = {
            **trained.metrics(start, cfg, pool, closed, mask, pruned, unpruned, seconds),
            "l0_lambda": p.l0_lambda if p.head_budget is None else None, "l0_normalize": p.l0_normalize,
            "head_budget": p.head_budget,
            **{f"budget_{k}": p[f"budget_{k}"] if p.head_budget is not None else None for k in ("gain", "warmup")},
            "l0_lambda_final": float(alive["l0_lambda"].iloc[-1]) if len(alive) else None,
            "freeze_decoder": p.freeze_decoder, "gate_init": p.gate_init, "bleu_gates": bleu_gates,
            "alive_heads": int(gates["alive"].sum()), "kept_heads_gates": kept_by_gates,
            "gates_binary": bool(((gates["gate"] == 0) | (gates["gate"] == 1)).all()),
        }
        metrics.update(trained.finetune_and_export(start, gated, cfg, mask, pruned, unpruned, out))
    if p.from_scratch:
        metrics.update(from_scratch(start, cfg, recipe, RunDir(out).head_mask, out, unpruned))
    print(summary(metrics))
    return metrics


def summary(m: dict) -> str:
    setting = (f"budget {m['head_budget']} (final λ {m['l0_lambda_final']:.4g})" if m["head_budget"] is not None
               else f"λ={m['l0_lambda']}")
    lines = [f"{setting} ({m['l0_normalize']}): {m['kept_heads']} of {m['heads_pool']} gated heads kept "
             f"(kept: {describe_kept(m)}); BLEU {m['bleu']:.2f} ({m['delta_bleu']:+.2f} vs the start)"]
    lines += trained.export_lines(m)
    if "bleu_scratch" in m:
        lines.append(f"the same heads trained from scratch ({m['scratch_updates']} updates): BLEU {m['bleu_scratch']:.2f} "
                     f"({m['delta_bleu_scratch']:+.2f} vs the start, its control: all heads, the same recipe)")
    return "\n".join(lines)
