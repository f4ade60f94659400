"""What heads and FFN neurons buy together in CTranslate2 (issue 43): transformer_base dimensions (6+6 layers,
d = 512, 8 heads, FFN 2048; weights barely trained: speed does not depend on them), exported with `hprune export`'s
writer. Models, each at the MACs per target token of its attention and FFN given as a fraction of the unpruned
model's (flops.unit_costs, counted over the test split, each sentence at its own length):
  * half the heads per stack (the heads-only bench's model, ctranslate2_speed.py): all heads can remove at most
    the attention's share, about 43 % of these MACs, so heads alone cannot reach half;
  * heads + FFN at the same MACs: 6 of 8 heads per stack, every FFN narrowed to make up the rest;
  * heads + FFN at half the MACs: 4 of 8 heads per stack, every FFN at the width that meets half; and the same
    MACs spent otherwise, 2 heads per stack and wider FFNs (a head saves more time per MAC than a neuron).
64 test sentences, beam 4, every hypothesis forced to 30 tokens (the same decoding steps), CTranslate2 int8 on 1
and 2 threads; the models alternate, the best of 3 rounds (deploy.ctranslate2.sentences_per_s). The MAC-predicted
speed-up counts the whole model's MACs per target token (embeddings and the output projection, which no pruning
touches, included). Goal: >= 2.0x in CTranslate2 int8 at half the MACs. Then the latency table hprune's latency
budget searches with (deploy/latency.py: whole translations of this model's pruned copies, the same settings on 1
thread) predicts each model's latency: goal within 10 % of the measured.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from common import base_checkpoint, config, prepared_data

from hprune import backend
from hprune.deploy import ctranslate2 as writer
from hprune.deploy.latency import LatencySettings, latency_table
from hprune.flops import macs_per_token, mask_macs, unit_costs
from hprune.pruning.heads import ffn_layout, layout

SENTENCES, LENGTH, BEAM, ROUNDS = 64, 30, 4, 3
TYPES = ["enc-self", "dec-self", "dec-enc", "enc-ffn", "dec-ffn"]


def kept(model, heads: int, width: int) -> dict:
    """The first `heads` heads of every attention sublayer and the first `width` neurons of every FFN."""
    return {**{kind: [list(range(heads)) for _ in per_layer] for kind, per_layer in layout(model).items()},
            **{kind: [list(range(width)) for _ in per_layer] for kind, per_layer in ffn_layout(model).items()}}


def as_mask(model, ids: dict) -> dict:
    shape = {**layout(model), **ffn_layout(model)}
    return {kind: [[int(u in set(row)) for u in range(n)] for row, n in zip(ids[kind], shape[kind])] for kind in ids}


def main() -> None:
    import ctranslate2  # noqa: F401 (the extra this bench needs)

    torch.manual_seed(1)
    cfg = config("prune", ["device=cpu", "ckpt=unused", f"data.params.n_test={SENTENCES}"])
    data = prepared_data(cfg)
    full = backend.load_model(base_checkpoint(), data)
    model = full.model
    lengths = backend.split_lengths(full, "test")
    costs = unit_costs(model, lengths)
    heads, d_ff = layout(model)["enc-self"][0], ffn_layout(model)["enc-ffn"][0]
    pool = mask_macs(costs, as_mask(model, kept(model, heads, d_ff)), TYPES)
    fraction = lambda ids: mask_macs(costs, as_mask(model, ids), TYPES) / pool  # noqa: E731

    def width_for(target: float, h: int) -> int:  # the widest FFN that keeps the MACs within target (bisection)
        low, high = 0, d_ff
        while low < high:
            middle = (low + high + 1) // 2
            low, high = (middle, high) if fraction(kept(model, h, middle)) <= target + 1e-9 else (low, middle - 1)
        return low

    heads_only = kept(model, heads // 2, d_ff)
    same = fraction(heads_only)
    choices = {"unpruned": kept(model, heads, d_ff), "half the heads": heads_only,
               "heads + FFN, same MACs": kept(model, 3 * heads // 4, width_for(same, 3 * heads // 4)),
               "heads + FFN, half the MACs": kept(model, heads // 2, width_for(0.5, heads // 2)),
               "heads + FFN, half, 2 heads": kept(model, 2, width_for(0.5, 2))}
    sources = [source for source, _ in backend.split_symbols(full, "test")]
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        dirs = {}
        for name, ids in choices.items():
            pruned = backend.pruned_model(full, ids)
            dirs[name] = str(Path(tmp) / name.replace(" ", "_").replace(",", "").replace("+", "and"))
            Path(dirs[name]).mkdir()
            writer.save(writer.model_spec(pruned, full.cfg.model, full.task.source_dictionary,
                                          full.task.target_dictionary), dirs[name], "int8")
            whole = macs_per_token(pruned, lengths)["macs_per_token"]
            rows[name] = {"fraction": fraction(ids), "heads": len(ids["enc-self"][0]), "width": len(ids["enc-ffn"][0]),
                          "macs": whole}
        for threads in (1, 2):
            speed = writer.sentences_per_s(dirs, sources, BEAM, threads, rounds=ROUNDS, lengths=(LENGTH,))[LENGTH]
            for name in choices:
                rows[name][threads] = speed[name]

        # the latency table (deploy/latency.py) measured for this model with the settings above (1 thread), and its
        # prediction for each model against the measured latency
        settings = LatencySettings(threads=1, beam=BEAM, sentences=SENTENCES, length=LENGTH, rounds=ROUNDS)
        table = latency_table(model, lambda ids: backend.pruned_model(full, ids), full.cfg.model,
                              (full.task.source_dictionary, full.task.target_dictionary), sources, settings,
                              Path(tmp) / "latency")
        for name, ids in choices.items():
            widths = {stack: [len(row) for row in ids[kind]] for stack, kind in (("encoder", "enc-ffn"),
                                                                                ("decoder", "dec-ffn"))}
            predicted = table.predict({"encoder": len(ids["enc-self"][0]), "decoder": len(ids["dec-self"][0])}, widths)
            rows[name]["predicted / measured"] = predicted * rows[name][1]  # seconds/sentence × sentences/s

    base = rows["unpruned"]
    print(f"  {'model':<28} {'heads':>5} {'FFN':>5} {'MACs':>6} {'1 thread':>9} {'2 threads':>10}  speed-up 1 / 2 thr"
          f"   predicted  table/measured  (CTranslate2 int8, sentences/s, beam {BEAM}, {SENTENCES} x {LENGTH} tokens)")
    for name, r in rows.items():
        print(f"  {name:<28} {r['heads']:>5} {r['width']:>5} {100 * r['fraction']:5.1f}% {r[1]:9.1f} {r[2]:10.1f}  "
              f"{r[1] / base[1]:6.3f} / {r[2] / base[2]:6.3f}   {base['macs'] / r['macs']:6.3f}     "
              f"{r['predicted / measured']:6.3f}")
    half, same_row, heads_row = rows["heads + FFN, half the MACs"], rows["heads + FFN, same MACs"], rows["half the heads"]
    two = rows["heads + FFN, half, 2 heads"]
    print(f"CTranslate2 int8 speed-up at half the MACs of attention and FFN (heads + FFN) = "
          f"{min(half[1] / base[1], half[2] / base[2]):.3f} (1 thread {half[1] / base[1]:.3f}, 2 threads "
          f"{half[2] / base[2]:.3f}; goal >= 2.0; MACs predict {base['macs'] / half['macs']:.3f}); with 2 heads per "
          f"stack {min(two[1] / base[1], two[2] / base[2]):.3f} ({two[1] / base[1]:.3f} / {two[2] / base[2]:.3f}, "
          f"MACs predict {base['macs'] / two['macs']:.3f}); at the MACs of half "
          f"the heads: heads + FFN {same_row[1] / base[1]:.3f} / {same_row[2] / base[2]:.3f} against heads only "
          f"{heads_row[1] / base[1]:.3f} / {heads_row[2] / base[2]:.3f}  [transformer_base]")
    error = max(abs(r["predicted / measured"] - 1) for r in rows.values())
    print(f"latency table (1 thread): predicted / measured latency of these models "
          f"{', '.join(format(r['predicted / measured'], '.3f') for r in rows.values())}; largest error "
          f"{100 * error:.1f} % (goal <= 10 %)")


if __name__ == "__main__":
    main()
