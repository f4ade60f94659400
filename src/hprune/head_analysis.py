"""What each head does, on a split read with teacher forcing (`hprune analyze`, the library's Model.analyze).

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

from omegaconf import DictConfig

from .analysis.alignment import (
    corpus_aer,
    eflomal_alignments,
    pharaoh_lines,
    read_pharaoh,
    read_unscored,
    word_texts,
)
from .analysis.attention_maps import KEYS
from .analysis.roles import ENCODER_ROLES
from .analysis.statistics import MEASURED, ROLES, head_statistics, key_of, role_table, summarize
from .analysis.survival import has_role
from .errors import UserError
from .files import write_atomic
from .pruning.heads import moa_types
from .reporting import plots
from .rundir import model_provenance, run_dir


def read_arcs(path: Path) -> list:
    if not path.exists():
        raise UserError(f"arcs file {path} does not exist; pass arcs=<jsonl with one {{\"arcs\": [...]}} per sentence>")
    try:
        return [json.loads(line)["arcs"] for line in path.read_text().splitlines()]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise UserError(f"{path} is not an arcs file ({err}); each line must be {{\"arcs\": [[relation, head, "
                        "dependent], ...]}}") from None


def read_alignments(cfg: DictConfig, session) -> tuple:
    """Reference word alignments of cfg.split: alignments=FILE, alignments=eflomal (run here, written to the run
    dir as reference.align), else the data set's own (the synthetic task's gold ones); (alignments or None,
    their file, their source)."""
    if cfg.alignments == "eflomal":
        return (*eflomal_reference(cfg, session), "eflomal")
    path = Path(cfg.alignments) if cfg.alignments else session.prepared.raw_file(f"{cfg.split}.align")
    if cfg.alignments and not path.exists():
        raise UserError(f"alignments file {path} does not exist; pass alignments=<Pharaoh file: i-j links, one line "
                        f"a sentence of {cfg.split}> or alignments=eflomal")
    if not path.exists():
        return None, path, None
    if cfg.alignments:
        return read_pharaoh(path), path, "file"
    return read_unscored(path.with_suffix(".exclude"), read_pharaoh(path)), path, "data set"


def eflomal_reference(cfg: DictConfig, session, name: str = "reference.align") -> tuple:
    """eflomal's alignments of cfg.split, aligned together with up to cfg.aligner_sentences training sentences
    (a split of 400 sentences alone gives a statistical aligner too little to count); written to the run dir."""
    pairs = session.sentence_pairs(cfg.split)
    extra = []
    if cfg.aligner_sentences and cfg.split != "train":
        try:
            extra = session.sentence_pairs("train", cfg.aligner_sentences)
        except UserError:  # a model's own data set may hold test sets only: the split alone, then
            pass
    post_process = session.data.get("post_process")
    source, target = ([word_texts(side, post_process, session.language_marks) for side in sides]
                      for sides in zip(*(pairs + extra)))
    alignments = eflomal_alignments(source, target, len(pairs))
    return alignments, write_atomic(run_dir() / name, pharaoh_lines(alignments))


def aligner_baseline(cfg: DictConfig, session, alignments: list) -> tuple[dict, list]:
    """eflomal's AER against the same reference alignments as the heads' (aligner_baseline=eflomal): sure links
    where its two directions agree (intersection), and every link of either (union)."""
    aligned, path = eflomal_reference(cfg, session, "eflomal.align")
    both, either = corpus_aer([s for s, _ in aligned], alignments), corpus_aer([p for _, p in aligned], alignments)
    line = (f"eflomal on the same sentences (with up to {cfg.aligner_sentences} training sentences): AER "
            f"{both:.3f} (both directions' intersection), {either:.3f} (union), against the same reference")
    return {"eflomal_aer": round(both, 4), "eflomal_union_aer": round(either, 4), "eflomal_alignments": str(path)}, \
        [line]


def analyze(session, cfg: DictConfig, out: Path) -> dict:
    """The analysis of an opened model (hprune.session.Session) with an analyze config, written into `out`."""
    check_settings(cfg)
    model = session.model
    # gold arcs: arcs=FILE, else the data set's own (the synthetic task has them); without any, syntactic roles
    # are not measured (a WMT test set has no parses) and say so
    arcs_path = Path(cfg.arcs) if cfg.arcs else session.prepared.raw_file(f"{cfg.split}.arcs.jsonl")
    arcs = read_arcs(arcs_path) if cfg.arcs or arcs_path.exists() else None
    alignments, alignments_path, alignments_source = read_alignments(cfg, session)
    mask = session.read_mask(cfg.mask) if cfg.mask else None

    if moa_types(model):
        raise UserError(f"head roles need per-head attention maps; this model's {', '.join(sorted(moa_types(model)))} "
                        "attention is made of MoA layers, whose experts do not keep them")
    stats, skipped_arcs, dumped = head_statistics(
        model, session.batches(cfg.split, cfg.max_tokens), session.pad, session.source_count, session.dictionaries,
        session.data.get("post_process"), arcs, alignments, cfg.dump, out / "attention", session.language_marks)
    roles, layer_aer = role_table(model, stats, lambda: session.batches(cfg.split, cfg.max_tokens), session.pad,
                                  session.eos, arcs is not None, cfg.alignment_max_aer, cfg.rare_min_share, cfg.lrp)
    if mask is not None:
        roles["alive"] = [mask[t][layer][h] for t, layer, h in roles[["type", "layer", "head"]].itertuples(index=False)]
    front = ["type", "layer", "head", "confidence", *(["lrp"] if cfg.lrp else []),
             *[role for role in ROLES if role in roles]]
    roles = roles[front + [c for c in roles.columns if c not in front]]

    write_atomic(out / "head_roles.csv", roles.to_csv(index=False))
    by_type = {attn_type: roles[roles["type"] == attn_type] for attn_type in KEYS}
    for measure, kinds in (("confidence", KEYS), *((("lrp", KEYS),) if cfg.lrp else ()),
                           ("positional_prev", ("enc-self", "dec-self")), ("positional_next", ("enc-self",)),
                           ("rare_token", ("enc-self",)), ("alignment_aer", ("dec-enc",))):
        shown = roles[roles["type"].isin(kinds)]
        if measure in shown and shown[measure].notna().any():
            plots.head_heatmaps(shown.dropna(subset=[measure]), measure, out / f"roles_{measure}.png", measure)
    metrics, lines = summarize(cfg, roles, by_type, layer_aer, arcs, alignments)
    if cfg.aligner_baseline == "eflomal" and alignments is not None and alignments_source != "eflomal":
        baseline, said = aligner_baseline(cfg, session, alignments)
        metrics.update(baseline)
        lines += said
    metrics.update({"split": cfg.split, "arcs": str(arcs_path) if arcs is not None else None,
                    "sentences_without_arcs": skipped_arcs if arcs is not None else None,
                    "alignments": str(alignments_path) if alignments is not None else None,
                    "alignments_source": alignments_source,
                    "rare_min_share": cfg.rare_min_share, "alignment_max_aer": cfg.alignment_max_aer,
                    "attention_maps": dumped, **model_provenance(session)})
    if mask is not None:
        for attn_type, role in MEASURED:
            if metrics[f"{key_of(attn_type, role)}_heads"] is not None:
                heads = by_type[attn_type][by_type[attn_type][role].fillna(False).astype(bool)]
                metrics[f"{key_of(attn_type, role)}_heads_alive"] = int(heads["alive"].sum())
                lines.append(f"{attn_type} {role}: {int(heads['alive'].sum())} of {len(heads)} survived the mask")
        enc = by_type["enc-self"]
        measured = [role for role in ENCODER_ROLES if role in enc and enc[role].notna().any()]
        if measured:
            metrics["other_heads_alive"] = int(enc[~has_role(enc, measured)]["alive"].sum())
    write_atomic(out / "summary.txt", "\n".join(lines) + "\n")
    print("\n".join(lines))
    return metrics


def check_settings(cfg: DictConfig) -> None:
    """Settings refused before the model is opened."""
    if cfg.aligner_baseline not in (None, "eflomal"):
        raise UserError(f"aligner_baseline must be eflomal or null, not '{cfg.aligner_baseline}'")
