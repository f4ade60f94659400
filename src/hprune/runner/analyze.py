"""`hprune analyze ckpt=PATH`: head roles (Voita et al. 2019) on a split, with the gold dependency arcs.

Encoder self-attention heads get positional, syntactic and rare-token measures (analysis/roles.py); every head
gets its confidence (pruning/scores.py) and, with lrp=true, its LRP relevance (analysis/relevance.py), with the
rank correlation of the two. With `mask=head_mask.json`, the summary says which roles survived.
"""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import torch
from omegaconf import DictConfig

from ..analysis import relevance
from ..analysis.roles import RoleStats
from ..errors import UserError
from ..files import run_dir, write_atomic
from ..pruning import scores
from ..pruning.heads import moa_types
from ..reporting import plots
from . import hydra_app

ROLES = ("positional", "syntactic", "rare")


def read_arcs(path: Path) -> list:
    if not path.exists():
        raise UserError(f"arcs file {path} does not exist; pass arcs=<jsonl with one {{\"arcs\": [...]}} per sentence>")
    try:
        return [json.loads(line)["arcs"] for line in path.read_text().splitlines()]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise UserError(f"{path} is not an arcs file ({err}); each line must be {{\"arcs\": [[relation, head, "
                        "dependent], ...]}}") from None


def rank_correlation(a: pd.Series, b: pd.Series) -> float:
    """Spearman's ρ: Pearson's correlation of the ranks (ties get their mean rank)."""
    return float(a.rank().corr(b.rank()))


def analyze(cfg: DictConfig) -> dict:
    from ..session import Session  # imports fairseq, which fills Hydra's config store: only once composed

    session = Session.open(cfg)
    model = session.model
    # gold arcs: arcs=FILE, else the data set's own (the synthetic task has them); without any, syntactic roles
    # are not measured (a WMT test set has no parses) and say so
    arcs_path = Path(cfg.arcs) if cfg.arcs else session.data_bin.parent / "raw" / f"{cfg.split}.arcs.jsonl"
    arcs = read_arcs(arcs_path) if cfg.arcs or arcs_path.exists() else None
    mask = session.read_mask(cfg.mask) if cfg.mask else None
    pad, eos = session.pad, session.eos

    if "enc-self" in moa_types(model):
        raise UserError("head roles need per-head attention maps; this model's encoder self-attention is a MoA "
                        "layer, whose experts do not keep them")
    encoder = [(layer, m) for kind, layer, m in model.attention_modules() if kind == "enc-self"]
    stats = {layer: RoleStats(m.num_heads) for layer, m in encoder}
    skipped_arcs = 0
    model.record_heads(weights=True)
    with torch.no_grad():
        for sample in session.batches(cfg.split, cfg.max_tokens):
            model.encoder(sample["net_input"]["src_tokens"], src_lengths=sample["net_input"]["src_lengths"])
            for b, sentence_id in enumerate(sample["id"].tolist()):
                tokens = sample["net_input"]["src_tokens"][b]
                real = tokens.ne(pad).nonzero().squeeze(1)  # left-padded: the sentence, then EOS
                words = tokens[real[:-1]].tolist()
                rarest = min(range(len(words)), key=lambda i: (session.source_count(words[i]), i)) if words else 0
                sentence_arcs = arcs[sentence_id] if arcs and sentence_id < len(arcs) else []
                if any(max(h, d) >= len(words) for _, h, d in sentence_arcs):  # subword tokens: arcs do not align
                    skipped_arcs, sentence_arcs = skipped_arcs + 1, []
                for layer, m in encoder:
                    maps = m.head_weights[b][:, real][:, :, real].float().cpu()
                    stats[layer].add(maps, rarest, sentence_arcs)
    model.record_heads()

    roles = pd.concat([stats[layer].table().assign(type="enc-self", layer=layer) for layer, _ in encoder])
    roles["head"] = [m.head_ids[h] for layer, m in encoder for h in range(m.num_heads)]
    roles["rare"] = roles["rare_token"] >= cfg.rare_min_share
    if arcs is None:
        roles["syntactic"] = None  # not measured: empty in head_roles.csv, not "no"
    confidence = scores.confidence(model, session.batches(cfg.split, cfg.max_tokens), pad, eos)
    roles = confidence.rename(columns={"importance": "confidence"}).merge(roles, on=["type", "layer", "head"], how="left")
    if cfg.lrp:  # Voita et al. compare the two measures: their rank correlation goes to metrics.json
        try:
            relevant, _ = relevance.head_relevance(model, session.batches(cfg.split, cfg.max_tokens), pad)
        except relevance.UnsupportedModel as err:
            raise UserError(f"lrp: {err}; or set lrp=false") from None
        roles = roles.merge(relevant.rename(columns={"importance": "lrp"}), on=["type", "layer", "head"], how="left")
    if mask is not None:
        roles["alive"] = [mask[t][layer][h] for t, layer, h in roles[["type", "layer", "head"]].itertuples(index=False)]
    front = ["type", "layer", "head", "confidence", *(["lrp"] if cfg.lrp else []), *ROLES]
    roles = roles[front + [c for c in roles.columns if c not in front]]

    out = run_dir()
    write_atomic(out / "head_roles.csv", roles.to_csv(index=False))
    enc = roles[roles["type"] == "enc-self"]
    for measure in ("confidence", *(["lrp"] if cfg.lrp else []), "positional_prev", "positional_next", "rare_token"):
        plots.head_heatmaps(roles if measure in ("confidence", "lrp") else enc, measure, out / f"roles_{measure}.png",
                            measure)
    measured = [role for role in ROLES if role != "syntactic" or arcs is not None]
    metrics = {"split": cfg.split, "arcs": str(arcs_path) if arcs is not None else None,
               "sentences_without_arcs": skipped_arcs if arcs is not None else None, "rare_min_share": cfg.rare_min_share,
               **{f"{role}_heads": int(enc[role].sum()) if role in measured else None for role in ROLES},
               **session.provenance()}
    lines = [f"{len(enc)} encoder self-attention heads on {cfg.split}: "
             + ", ".join(f"{metrics[f'{role}_heads']} {role}" for role in measured)]
    if cfg.lrp:
        for name, rows in (("all", roles), ("enc_self", enc)):
            metrics[f"lrp_confidence_spearman_{name}"] = round(rank_correlation(rows["confidence"], rows["lrp"]), 4)
        lines.append(f"LRP relevance vs confidence, Spearman's rank correlation: "
                     f"{metrics['lrp_confidence_spearman_all']:+.2f} over all {len(roles)} heads, "
                     f"{metrics['lrp_confidence_spearman_enc_self']:+.2f} over the encoder self-attention heads")
    if arcs is None:
        lines.append(f"syntactic: not measured, {cfg.split} has no dependency arcs (arcs=<jsonl> adds them)")
    if mask is not None:
        for role in measured:
            heads = enc[enc[role].astype(bool)]
            metrics[f"{role}_heads_alive"] = int(heads["alive"].sum())
            lines.append(f"{role}: {int(heads['alive'].sum())} of {len(heads)} survived the mask")
        metrics["other_heads_alive"] = int(enc[~enc[measured].astype(bool).any(axis=1)]["alive"].sum())
    write_atomic(out / "summary.txt", "\n".join(lines) + "\n")
    print("\n".join(lines))
    return metrics


main = hydra_app("analyze")(analyze)
