"""`hprune analyze ckpt=PATH`: what each head does, on a split read with teacher forcing.

Encoder self-attention heads get Voita et al.'s positional, syntactic and rare-token measures, decoder
self-attention heads the positional one (analysis/roles.py), encoder-decoder heads their word alignments
scored against reference alignments (analysis/alignment.py); every head gets its confidence
(pruning/scores.py) and, with lrp=true, its LRP relevance (analysis/relevance.py), with the rank correlation of
the two. `dump=N` writes the attention maps of N sentences (analysis/attention_maps.py). With
`mask=head_mask.json`, the summary says which roles survived.
"""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import torch
from omegaconf import DictConfig

from ..analysis import attention_maps, relevance
from ..analysis.alignment import AlignmentStats, eflomal_alignments, pharaoh_lines, read_pharaoh, word_ids, word_texts
from ..analysis.attention_maps import KEYS
from ..analysis.roles import ENCODER_ROLES, PreviousTokenStats, RoleStats
from ..analysis.survival import has_role
from ..errors import UserError
from ..files import run_dir, write_atomic
from ..pruning import scores
from ..pruning.heads import moa_types
from ..reporting import plots
from . import hydra_app

ROLES = (*ENCODER_ROLES, "alignment")


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


def read_alignments(cfg: DictConfig, session) -> tuple:
    """Reference word alignments of cfg.split: alignments=FILE, alignments=eflomal (run here, written to the run
    dir as reference.align), else the data set's own (the synthetic task's gold ones); (alignments or None,
    their file, their source)."""
    if cfg.alignments == "eflomal":
        return (*eflomal_reference(cfg, session), "eflomal")
    path = Path(cfg.alignments) if cfg.alignments else session.data_bin.parent / "raw" / f"{cfg.split}.align"
    if cfg.alignments and not path.exists():
        raise UserError(f"alignments file {path} does not exist; pass alignments=<Pharaoh file: i-j links, one line "
                        f"a sentence of {cfg.split}> or alignments=eflomal")
    return (read_pharaoh(path), path, "file" if cfg.alignments else "data set") if path.exists() else (None, path, None)


def eflomal_reference(cfg: DictConfig, session) -> tuple:
    """eflomal's alignments of cfg.split, aligned together with up to cfg.aligner_sentences training sentences
    (a split of 400 sentences alone gives a statistical aligner too little to count)."""
    pairs = session.sentence_pairs(cfg.split)
    extra = []
    if cfg.aligner_sentences and cfg.split != "train":
        try:
            extra = session.sentence_pairs("train", cfg.aligner_sentences)
        except UserError:  # a model's own data set may hold test sets only: the split alone, then
            pass
    post_process = session.data.get("post_process")
    source, target = ([word_texts(side, post_process) for side in sides] for sides in zip(*(pairs + extra)))
    alignments = eflomal_alignments(source, target, len(pairs))
    return alignments, write_atomic(run_dir() / "reference.align", pharaoh_lines(alignments))


def analyze(cfg: DictConfig) -> dict:
    from ..session import Session  # imports fairseq, which fills Hydra's config store: only once composed

    session = Session.open(cfg)
    model = session.model
    # gold arcs: arcs=FILE, else the data set's own (the synthetic task has them); without any, syntactic roles
    # are not measured (a WMT test set has no parses) and say so
    arcs_path = Path(cfg.arcs) if cfg.arcs else session.data_bin.parent / "raw" / f"{cfg.split}.arcs.jsonl"
    arcs = read_arcs(arcs_path) if cfg.arcs or arcs_path.exists() else None
    alignments, alignments_path, alignments_source = read_alignments(cfg, session)
    mask = session.read_mask(cfg.mask) if cfg.mask else None
    pad, eos = session.pad, session.eos
    source_dict, target_dict = session.dictionaries
    post_process = session.data.get("post_process")

    if moa_types(model):
        raise UserError(f"head roles need per-head attention maps; this model's {', '.join(sorted(moa_types(model)))} "
                        "attention is made of MoA layers, whose experts do not keep them")
    modules = list(model.attention_modules())
    measures = {"enc-self": RoleStats, "dec-self": PreviousTokenStats, "dec-enc": AlignmentStats}
    stats = {(kind, layer): measures[kind](m.num_heads) for kind, layer, m in modules
             if kind != "dec-enc" or alignments is not None}
    heads = {kind: max(m.total_heads for k, _, m in modules if k == kind) for kind in KEYS}
    head_ids = {kind: [list(m.head_ids) for k, _, m in modules if k == kind] for kind in KEYS}
    skipped_arcs, dumped = 0, 0
    model.record_heads(weights=True)
    with torch.no_grad():
        for sample in session.batches(cfg.split, cfg.max_tokens):
            model(**sample["net_input"])  # teacher forcing: every attention's maps on the reference
            for b, sentence_id in enumerate(sample["id"].tolist()):
                tokens = sample["net_input"]["src_tokens"][b]
                real = tokens.ne(pad).nonzero().squeeze(1)  # left-padded: the sentence, then EOS
                target = sample["target"][b]
                length = int(target.ne(pad).sum())  # right-padded: the sentence, then EOS
                words = tokens[real[:-1]].tolist()
                rarest = min(range(len(words)), key=lambda i: (session.source_count(words[i]), i)) if words else 0
                sentence_arcs = arcs[sentence_id] if arcs and sentence_id < len(arcs) else []
                if any(max(h, d) >= len(words) for _, h, d in sentence_arcs):  # subword tokens: arcs do not align
                    skipped_arcs, sentence_arcs = skipped_arcs + 1, []
                source = [source_dict[t] for t in words]
                target_pieces = [target_dict[t] for t in target[:length - 1].tolist()]
                aligned = alignments is not None and sentence_id < len(alignments)
                words_of = (word_ids(source, post_process), word_ids(target_pieces, post_process)) if aligned else None
                maps = {}
                for kind, layer, m in modules:
                    rows, columns = (real, real) if kind == "enc-self" else (slice(length), real if kind == "dec-enc"
                                                                             else slice(length))
                    if m.num_heads == 0:  # every head of the layer pruned away: nothing recorded
                        weights = torch.zeros(0, len(real) if kind == "enc-self" else length,
                                              length if kind == "dec-self" else len(real))
                    else:
                        weights = m.head_weights[b][:, rows][:, :, columns].float().cpu()
                    maps.setdefault(kind, []).append(weights.numpy())
                    if kind == "enc-self":
                        stats[(kind, layer)].add(weights, rarest, sentence_arcs)
                    elif kind == "dec-self":
                        stats[(kind, layer)].add(weights)
                    elif aligned:
                        stats[(kind, layer)].add(weights, *words_of, *alignments[sentence_id])
                if sentence_id < cfg.dump:
                    attention_maps.write(
                        run_dir() / "attention" / f"{sentence_id}.npz",
                        {"source_tokens": source + ["</s>"], "target_tokens": target_pieces + ["</s>"],
                         "decoder_tokens": ["</s>"] + target_pieces},
                        {kind: attention_maps.layer_stack(layer_maps, head_ids[kind], heads[kind])
                         for kind, layer_maps in maps.items()})
                    dumped += 1
    model.record_heads()

    tables, layer_aer = [], {}
    for (kind, layer), stat in stats.items():
        if kind == "dec-enc":
            table, layer_aer[layer] = stat.table(cfg.alignment_max_aer)
        else:
            table = stat.table()
        tables.append(table.assign(type=kind, layer=layer))
    roles = pd.concat(tables) if tables else pd.DataFrame(columns=["type", "layer", "head"])
    roles["head"] = [m.head_ids[h] for kind, layer, m in modules if (kind, layer) in stats for h in range(m.num_heads)]
    if "rare_token" in roles:
        roles["rare"] = (roles["rare_token"] >= cfg.rare_min_share).where(roles["type"] == "enc-self")
    if arcs is None and "syntactic" in roles:
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
    front = ["type", "layer", "head", "confidence", *(["lrp"] if cfg.lrp else []),
             *[role for role in ROLES if role in roles]]
    roles = roles[front + [c for c in roles.columns if c not in front]]

    out = run_dir()
    write_atomic(out / "head_roles.csv", roles.to_csv(index=False))
    by_type = {kind: roles[roles["type"] == kind] for kind in KEYS}
    for measure, kinds in (("confidence", KEYS), *((("lrp", KEYS),) if cfg.lrp else ()),
                           ("positional_prev", ("enc-self", "dec-self")), ("positional_next", ("enc-self",)),
                           ("rare_token", ("enc-self",)), ("alignment_aer", ("dec-enc",))):
        shown = roles[roles["type"].isin(kinds)]
        if measure in shown and shown[measure].notna().any():
            plots.head_heatmaps(shown.dropna(subset=[measure]), measure, out / f"roles_{measure}.png", measure)
    metrics, lines = summarize(cfg, roles, by_type, layer_aer, arcs, alignments)
    metrics.update({"split": cfg.split, "arcs": str(arcs_path) if arcs is not None else None,
                    "sentences_without_arcs": skipped_arcs if arcs is not None else None,
                    "alignments": str(alignments_path) if alignments is not None else None,
                    "alignments_source": alignments_source,
                    "rare_min_share": cfg.rare_min_share, "alignment_max_aer": cfg.alignment_max_aer,
                    "attention_maps": dumped, **session.provenance()})
    if mask is not None:
        for kind, role in MEASURED:
            if metrics[f"{_key(kind, role)}_heads"] is not None:
                heads = by_type[kind][by_type[kind][role].fillna(False).astype(bool)]
                metrics[f"{_key(kind, role)}_heads_alive"] = int(heads["alive"].sum())
                lines.append(f"{kind} {role}: {int(heads['alive'].sum())} of {len(heads)} survived the mask")
        enc = by_type["enc-self"]
        measured = [role for role in ENCODER_ROLES if role in enc and enc[role].notna().any()]
        if measured:
            metrics["other_heads_alive"] = int(enc[~has_role(enc, measured)]["alive"].sum())
    write_atomic(out / "summary.txt", "\n".join(lines) + "\n")
    print("\n".join(lines))
    return metrics


# (type, role) pairs that are measured, and their metrics.json counts: positional_heads (enc-self, as before),
# dec_self_positional_heads, alignment_heads
MEASURED = (("enc-self", "positional"), ("enc-self", "syntactic"), ("enc-self", "rare"), ("dec-self", "positional"),
            ("dec-enc", "alignment"))


def _key(kind: str, role: str) -> str:
    return {"enc-self": role, "dec-self": "dec_self_positional", "dec-enc": "alignment"}[kind]


def summarize(cfg, roles, by_type, layer_aer, arcs, alignments) -> tuple:
    """metrics.json's role counts and the summary lines."""
    metrics, lines = {}, []
    for kind, role in MEASURED:
        table = by_type[kind]
        measured = role in table and table[role].notna().any()
        metrics[f"{_key(kind, role)}_heads"] = int(table[role].fillna(False).astype(bool).sum()) if measured else None
    for kind in KEYS:
        counts = [f"{metrics[f'{_key(k, role)}_heads']} {role}" for k, role in MEASURED
                  if k == kind and metrics[f"{_key(k, role)}_heads"] is not None]
        if counts:
            lines.append(f"{len(by_type[kind])} {kind} heads on {cfg.split}: " + ", ".join(counts))
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


main = hydra_app("analyze")(analyze)
