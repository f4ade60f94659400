"""Physically pruned vs unpruned transformer_base (half the heads of every attention layer removed): encoder
forward (batch 128) and batched beam search (batch 32, beam 5, every hypothesis forced to the same length so both models
do the same number of steps). The measured speed-up is printed next to the one predicted from FLOPs counted
with torch.utils.flop_counter. Goal: measured / predicted >= 0.9.
"""
from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch
from common import base_checkpoint, config, prepared_data
from omegaconf import OmegaConf

from hprune import backend
from hprune.flops import count_flops
from hprune.pruning.heads import layout

BATCH, LENGTH, ROUNDS, ENCODER_REPS = 32, 20, 3, 10
ENCODER_BATCH = 128  # sentences of about 10 tokens: at 32 the encoder is too small to be bound by FLOPs
SMALL_TEST = ["data.params.n_test=64"]  # 2 batches of 32; the training split (the vocabulary) is unchanged


def main() -> None:
    torch.manual_seed(1)
    cfg = config("prune", ["device=cpu", "ckpt=unused", *SMALL_TEST])
    data = prepared_data(cfg)
    full = backend.load_model(base_checkpoint(), data)
    kept = {kind: [list(range(n // 2)) for n in per_layer] for kind, per_layer in layout(full.model).items()}
    with tempfile.TemporaryDirectory() as tmp:
        backend.export_pruned(full, kept, Path(tmp) / "pruned.pt")
        pruned = backend.load_model(Path(tmp) / "pruned.pt", data)
    models = {"unpruned": full, "50% heads removed": pruned}
    sample = next(backend.batches(full, "valid", None, 1, max_sentences=ENCODER_BATCH))
    src, lengths = sample["net_input"]["src_tokens"], sample["net_input"]["src_lengths"]
    gen = OmegaConf.create({"beam": 5, "lenpen": 1.0, "max_len_a": 0, "max_len_b": LENGTH, "min_len": LENGTH,
                            "batch_size": BATCH, "max_tokens": None})

    def encode(loaded) -> float:
        started = time.perf_counter()
        with torch.no_grad():
            for _ in range(ENCODER_REPS):
                loaded.model.encoder(src, src_lengths=lengths)
        return time.perf_counter() - started

    def beam(loaded) -> float:
        return backend.translate(loaded, gen, "test", 1).seconds

    flops = {name: {"encoder": count_flops(m.model.encoder, src, src_lengths=lengths),
                    "beam search": count_flops(backend.translate, m, gen, "test", 1)} for name, m in models.items()}
    for m in models.values():  # warm-up (the FLOP count above ran beam search once already)
        encode(m)
    times: dict[str, dict[str, list[float]]] = {n: {"encoder": [], "beam search": []} for n in models}
    for _ in range(ROUNDS):
        for name, m in models.items():
            times[name]["encoder"].append(encode(m))
            times[name]["beam search"].append(beam(m))

    n_full, n_pruned = (backend.count_parameters(m.model) for m in models.values())
    print(f"  parameters: {n_full:,} -> {n_pruned:,} ({100 * (1 - n_pruned / n_full):.1f} % fewer)")
    for what in ("encoder", "beam search"):
        t_full, t_pruned = (statistics.median(times[n][what]) for n in models)
        f_full, f_pruned = (flops[n][what] for n in models)
        measured, predicted = t_full / t_pruned, f_full / f_pruned
        print(f"  {what:<12} {t_full:6.3f} s -> {t_pruned:6.3f} s   GFLOP {f_full / 1e9:7.2f} -> {f_pruned / 1e9:7.2f}")
        batch = ENCODER_BATCH if what == "encoder" else BATCH
        print(f"{what} speed-up measured {measured:.3f} / predicted from FLOPs {predicted:.3f} = "
              f"{measured / predicted:.3f}  (goal >= 0.9) [batch {batch}, transformer_base]")


if __name__ == "__main__":
    main()
