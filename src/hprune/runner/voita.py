"""`hprune prune --method voita ckpt=PATH`: Hard Concrete head gates trained with an L0 penalty (Voita et al.).

Continues training the converged checkpoint with fairseq-train (so an interrupted run resumes), a gate on every
head of `prune.types` and the `hprune_l0` criterion; then reads the deterministic gates out into gates.csv and
head_mask.json (alive = gate > 0) and measures BLEU with the gates and with the 0/1 mask.
"""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pandas as pd
from omegaconf import DictConfig

from ..data.prepare import prepare
from ..errors import UserError
from ..files import git_sha, run_dir, write_atomic, write_json
from ..pruning.heads import ATTENTION_TYPES, check_types, kept_columns, mask_without
from ..reporting import plots
from .evaluate import resolve_checkpoint, translate_and_score


def check_settings(p: DictConfig) -> None:
    types = check_types(p.types)
    if p.l0_lambda < 0:
        raise UserError(f"prune.l0_lambda={p.l0_lambda} is negative; use λ >= 0 (e.g. 0.01 to 0.1)")
    if p.l0_normalize not in ("sum", "layer_mean"):
        raise UserError(f"prune.l0_normalize={p.l0_normalize}: use sum (paper) or layer_mean (reference code)")
    if p.freeze_decoder and types != ["enc-self"]:
        raise UserError("prune.freeze_decoder=true trains only the encoder, so only enc-self gates would learn; "
                        "set prune.types=[enc-self] or prune.freeze_decoder=false")


def bleu(cfg: DictConfig, loaded, data_bin: Path) -> float:
    return translate_and_score(cfg, loaded, data_bin)[1]["bleu"]


def alive_over_training(log: Path) -> pd.DataFrame:
    """(num_updates, alive_heads, open_heads) from fairseq's progress lines in the run's log."""
    rows = []
    for line in log.read_text().splitlines() if log.exists() else []:
        if "train_inner" in line and "alive_heads=" in line:
            fields = dict(re.findall(r"(\w+)=([\d.]+)", line))
            rows.append((int(fields["num_updates"]), float(fields["alive_heads"]), float(fields["open_heads"])))
    return pd.DataFrame(rows, columns=["num_updates", "alive_heads", "open_heads"])


def run(cfg: DictConfig) -> dict:
    from .. import backend

    p = cfg.prune
    check_settings(p)
    ckpt = resolve_checkpoint(cfg.ckpt)
    data_bin = prepare(cfg.data, cfg.paths.data_root)
    start = backend.load_model(ckpt, data_bin, cfg.device, cfg.precision)
    bleu_start = bleu(cfg, start, data_bin)

    out = run_dir()
    save = out / "checkpoints"
    argv = backend.continue_training_argv(ckpt, start.cfg.model, start.cfg.task, data_bin, save, cfg.device,
                                          cfg.precision, cfg.seed)
    argv += ["--criterion", "hprune_l0", "--label-smoothing", str(start.cfg.criterion.get("label_smoothing", 0.0)),
             "--l0-lambda", str(p.l0_lambda), "--l0-normalize", p.l0_normalize, "--head-gates", ",".join(p.types)]
    argv += ["--gate-log-alpha-init", str(p.gate_init)] if p.gate_init is not None else []
    argv += ["--freeze-decoder"] if p.freeze_decoder else []
    argv += backend._flags(p.optim)
    write_atomic(out / "fairseq-train.sh", shlex.join(["fairseq-train", *argv]) + "\n")
    backend.train(argv)

    gated = backend.load_model(save / "checkpoint_last.pt", data_bin, cfg.device, cfg.precision)
    rows = []
    for kind, layer, m in gated.model.gates():
        for log_alpha, p_open, gate, head in zip(m.gate.log_alpha.tolist(), m.gate.p_open().tolist(),
                                                 m.gate.deterministic().tolist(), m.head_ids):
            rows.append({"type": kind, "layer": layer, "head": head, "log_alpha": round(log_alpha, 6),
                         "p_open": round(p_open, 6), "gate": round(gate, 6), "alive": int(gate > 0)})
    gates = pd.DataFrame(rows)
    bleu_gates = bleu(cfg, gated, data_bin)  # eval mode: the deterministic gates
    closed = {(r.type, r.layer, r.head) for r in gates.itertuples() if not r.alive}
    mask = mask_without(gated.model, closed)
    for _, _, m in gated.model.gates():
        m.gate = None
    gated.model.set_head_mask(mask)
    bleu_mask = bleu(cfg, gated, data_bin)

    write_atomic(out / "gates.csv", gates.to_csv(index=False))
    write_json(out / "head_mask.json", mask)
    plots.head_heatmaps(gates, "gate", out / "gates.png", f"deterministic gates, λ={p.l0_lambda}")
    alive = alive_over_training(out / "prune.log")
    if len(alive):
        write_atomic(out / "alive_heads.csv", alive.to_csv(index=False))
        plots.line(alive, "num_updates", ["alive_heads", "open_heads"], out / "alive_heads.png",
                   "gated heads alive / expected open over training")
    gated_heads = len(gates)
    metrics = {
        "verb": "prune", "method": "voita", "data": cfg.data.name, "split": cfg.split,
        "l0_lambda": p.l0_lambda, "l0_normalize": p.l0_normalize, "types": list(p.types),
        "freeze_decoder": p.freeze_decoder, "gate_init": p.gate_init, "updates": int(p.optim.max_update),
        "bleu": bleu_mask, "bleu_gates": bleu_gates, "bleu_start": bleu_start,
        "delta_bleu": round(bleu_mask - bleu_start, 4), "gated_heads": gated_heads,
        "alive_gated_heads": int(gates["alive"].sum()), "pct_pruned": round(100 * len(closed) / gated_heads, 2),
        **kept_columns(mask), "gates_binary": bool(((gates["gate"] == 0) | (gates["gate"] == 1)).all()),
        "n_params": backend.count_parameters(start.model), "device": start.device, "precision": cfg.precision,
        "seed": cfg.seed, "git_sha": git_sha(), "checkpoint": str(ckpt.absolute()), "data_bin": str(data_bin),
    }
    write_json(out / "metrics.json", metrics)
    per_type = ", ".join(f"{k} {metrics['kept_' + k.replace('-', '_')]}" for k in ATTENTION_TYPES)
    print(f"λ={p.l0_lambda} ({p.l0_normalize}): {metrics['alive_gated_heads']} of {gated_heads} gated heads alive "
          f"(kept: {per_type}); BLEU {bleu_mask:.2f} ({metrics['delta_bleu']:+.2f} vs the start, "
          f"{bleu_gates:.2f} with the gates themselves)")
    return metrics
