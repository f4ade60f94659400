"""The head-statistics pass of `hprune analyze`: every attention's per-head maps on a split read with teacher
forcing, fed to each attention type's role measures (roles.py: positional, syntactic, rare-token; alignment.py:
alignment heads against reference alignments), the maps of the first sentences dumped (attention_maps.py); then
the table of every head's roles with its confidence (and LRP relevance), and the summary of what was found."""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Collection, Iterable, Optional

import pandas as pd
import torch

from ..errors import UserError
from ..pruning import scores
from . import attention_maps, relevance
from .alignment import AlignmentStats, word_ids
from .attention_maps import KEYS
from .roles import ENCODER_ROLES, PreviousTokenStats, RoleStats

ROLES = (*ENCODER_ROLES, "alignment")


def rank_correlation(a: pd.Series, b: pd.Series) -> float:
    """Spearman's ρ: Pearson's correlation of the ranks (ties get their mean rank)."""
    return float(a.rank().corr(b.rank()))


def head_statistics(model, batches: Iterable[dict], pad: int, source_count: Callable[[int], int], dictionaries: tuple,
                    post_process: Optional[str], arcs: Optional[list], alignments: Optional[list], dump: int,
                    dump_dir: Path, marks: Collection[str] = ()) -> tuple:
    """One teacher-forced pass over `batches`: each attention sublayer's role statistics ({(type, layer):
    stats}), the sentences whose arcs do not fit their tokens (subwords), and how many maps were dumped.
    `marks`: tokens that are no word (a multilingual model's language tokens), left out of the alignments."""
    source_dict, target_dict = dictionaries
    modules = list(model.attention_modules())
    measures = {"enc-self": RoleStats, "dec-self": PreviousTokenStats, "dec-enc": AlignmentStats}
    stats = {(attn_type, layer): measures[attn_type](m.num_heads) for attn_type, layer, m in modules
             if attn_type != "dec-enc" or alignments is not None}
    heads = {attn_type: max(m.total_heads for k, _, m in modules if k == attn_type) for attn_type in KEYS}
    head_ids = {attn_type: [list(m.head_ids) for k, _, m in modules if k == attn_type] for attn_type in KEYS}
    skipped_arcs, dumped = 0, 0
    model.record_heads(weights=True)
    with torch.no_grad():
        for sample in batches:
            model(**sample["net_input"])  # teacher forcing: every attention's maps on the reference
            for b, sentence_id in enumerate(sample["id"].tolist()):
                tokens = sample["net_input"]["src_tokens"][b]
                real = tokens.ne(pad).nonzero().squeeze(1)  # left-padded: the sentence, then EOS
                target = sample["target"][b]
                length = int(target.ne(pad).sum())  # right-padded: the sentence, then EOS
                words = tokens[real[:-1]].tolist()
                rarest = min(range(len(words)), key=lambda i: (source_count(words[i]), i)) if words else 0
                sentence_arcs = arcs[sentence_id] if arcs and sentence_id < len(arcs) else []
                if any(max(h, d) >= len(words) for _, h, d in sentence_arcs):  # subword tokens: arcs do not align
                    skipped_arcs, sentence_arcs = skipped_arcs + 1, []
                source = [source_dict[t] for t in words]
                target_pieces = [target_dict[t] for t in target[:length - 1].tolist()]
                aligned = alignments is not None and sentence_id < len(alignments)
                words_of = (word_ids(source, post_process, marks), word_ids(target_pieces, post_process, marks)) \
                    if aligned else None
                maps = {}
                for attn_type, layer, m in modules:
                    rows, columns = (real, real) if attn_type == "enc-self" else (slice(length), real if attn_type == "dec-enc"
                                                                             else slice(length))
                    if m.num_heads == 0:  # every head of the layer pruned away: nothing recorded
                        weights = torch.zeros(0, len(real) if attn_type == "enc-self" else length,
                                              length if attn_type == "dec-self" else len(real))
                    else:
                        weights = m.head_weights[b][:, rows][:, :, columns].float().cpu()
                    maps.setdefault(attn_type, []).append(weights.numpy())
                    if attn_type == "enc-self":
                        stats[(attn_type, layer)].add(weights, rarest, sentence_arcs)
                    elif attn_type == "dec-self":
                        stats[(attn_type, layer)].add(weights)
                    elif aligned:
                        stats[(attn_type, layer)].add(weights, *words_of, *alignments[sentence_id])
                if sentence_id < dump:
                    attention_maps.write(
                        dump_dir / f"{sentence_id}.npz",
                        {"source_tokens": source + ["</s>"], "target_tokens": target_pieces + ["</s>"],
                         "decoder_tokens": ["</s>"] + target_pieces},
                        {attn_type: attention_maps.layer_stack(layer_maps, head_ids[attn_type], heads[attn_type])
                         for attn_type, layer_maps in maps.items()})
                    dumped += 1
    model.record_heads()

    return stats, skipped_arcs, dumped


def role_table(model, stats: dict, batches: Callable[[], Iterable[dict]], pad: int, eos: int, measured_arcs: bool,
               alignment_max_aer: float, rare_min_share: float, lrp: bool) -> tuple:
    """(every head's roles with its confidence and, with `lrp`, its LRP relevance; each layer's mean-map AER).
    `batches()`: a fresh pass over the split."""
    modules = list(model.attention_modules())
    tables, layer_aer = [], {}
    for (attn_type, layer), stat in stats.items():
        if attn_type == "dec-enc":
            table, layer_aer[layer] = stat.table(alignment_max_aer)
        else:
            table = stat.table()
        tables.append(table.assign(type=attn_type, layer=layer))
    roles = pd.concat(tables) if tables else pd.DataFrame(columns=["type", "layer", "head"])
    roles["head"] = [m.head_ids[h] for attn_type, layer, m in modules if (attn_type, layer) in stats for h in range(m.num_heads)]
    if "rare_token" in roles:
        roles["rare"] = (roles["rare_token"] >= rare_min_share).where(roles["type"] == "enc-self")
    if not measured_arcs and "syntactic" in roles:
        roles["syntactic"] = None  # not measured: empty in head_roles.csv, not "no"
    confidence = scores.confidence(model, batches(), pad, eos)
    roles = confidence.rename(columns={"importance": "confidence"}).merge(roles, on=["type", "layer", "head"], how="left")
    if lrp:  # Voita et al. compare the two measures: their rank correlation goes to metrics.json
        try:
            relevant, _ = relevance.head_relevance(model, batches(), pad)
        except relevance.UnsupportedModel as err:
            raise UserError(f"lrp: {err}; or set lrp=false") from None
        roles = roles.merge(relevant.rename(columns={"importance": "lrp"}), on=["type", "layer", "head"], how="left")
    return roles, layer_aer


# (type, role) pairs that are measured, and their metrics.json counts: positional_heads (enc-self, as before),
# dec_self_positional_heads, alignment_heads
MEASURED = (("enc-self", "positional"), ("enc-self", "syntactic"), ("enc-self", "rare"), ("dec-self", "positional"),
            ("dec-enc", "alignment"))


def key_of(attn_type: str, role: str) -> str:
    return {"enc-self": role, "dec-self": "dec_self_positional", "dec-enc": "alignment"}[attn_type]


def summarize(cfg, roles, by_type, layer_aer, arcs, alignments) -> tuple:
    """metrics.json's role counts and the summary lines."""
    metrics, lines = {}, []
    for attn_type, role in MEASURED:
        table = by_type[attn_type]
        measured = role in table and table[role].notna().any()
        metrics[f"{key_of(attn_type, role)}_heads"] = int(table[role].fillna(False).astype(bool).sum()) if measured else None
    for attn_type in KEYS:
        counts = [f"{metrics[f'{key_of(k, role)}_heads']} {role}" for k, role in MEASURED
                  if k == attn_type and metrics[f"{key_of(k, role)}_heads"] is not None]
        if counts:
            lines.append(f"{len(by_type[attn_type])} {attn_type} heads on {cfg.split}: " + ", ".join(counts))
    layer_aer = {layer: value for layer, value in layer_aer.items() if value == value}  # layers left with heads
    if layer_aer:
        aligned = by_type["dec-enc"].dropna(subset=["alignment_aer"])
        best = aligned.loc[aligned["alignment_aer"].idxmin()]
        best_layer = min(layer_aer, key=layer_aer.get)
        metrics.update(best_alignment_aer=round(float(best["alignment_aer"]), 4),
                       best_alignment_head=f"dec-enc {int(best['layer'])} {int(best['head'])}",
                       best_layer_aer=round(layer_aer[best_layer], 4), best_layer=best_layer)
        lines.append(f"alignment: the best head (dec-enc layer {int(best['layer'])}, head {int(best['head'])}) has "
                     f"AER {best['alignment_aer']:.3f}; the best layer's mean map (layer {best_layer}) "
                     f"{layer_aer[best_layer]:.3f}")
    if cfg.lrp:
        for name, rows in (("all", roles), ("enc_self", by_type["enc-self"])):
            metrics[f"lrp_confidence_spearman_{name}"] = round(rank_correlation(rows["confidence"], rows["lrp"]), 4)
        lines.append(f"LRP relevance vs confidence, Spearman's rank correlation: "
                     f"{metrics['lrp_confidence_spearman_all']:+.2f} over all {len(roles)} heads, "
                     f"{metrics['lrp_confidence_spearman_enc_self']:+.2f} over the encoder self-attention heads")
    if arcs is None:
        lines.append(f"syntactic: not measured, {cfg.split} has no dependency arcs (arcs=<jsonl> adds them)")
    if alignments is None:
        lines.append(f"alignment: not measured, {cfg.split} has no reference alignments (alignments=<Pharaoh file> "
                     "adds them)")
    return metrics, lines


