"""What half the heads buy in CTranslate2, beside fairseq: transformer_base dimensions (6+6 layers, d = 512,
8 heads; weights barely trained: speed does not depend on them), every layer keeping 4 of its 8 heads in every
sublayer (the per-stack layout CTranslate2 holds without padding), exported with `hprune export`'s writer. 64
test sentences, beam 4, every hypothesis forced to 30 tokens so both models decode the same steps; CTranslate2
int8 and float32 on 1 and 2 threads, and fairseq's beam search (hprune's, fp32) on the same sentences; pruned
and unpruned alternate, 3 rounds, medians. The MAC-predicted speed-up is fairseq's counted FLOPs ratio.
Goal: >= 1.4x in CTranslate2 int8.
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
from hprune.deploy import ctranslate2 as writer
from hprune.flops import count_flops
from hprune.pruning.heads import layout

SENTENCES, LENGTH, BEAM, ROUNDS = 64, 30, 4, 3


def main() -> None:
    import ctranslate2

    torch.manual_seed(1)
    cfg = config("prune", ["device=cpu", "ckpt=unused", f"data.params.n_test={SENTENCES}"])
    data = prepared_data(cfg)
    full = backend.load_model(base_checkpoint(), data)
    kept = {kind: [list(range(n // 2)) for n in per_layer] for kind, per_layer in layout(full.model).items()}
    models = {"unpruned": backend.pruned_model(full, {k: [list(range(n)) for n in v] for k, v in layout(full.model).items()}),
              "half the heads": backend.pruned_model(full, kept)}
    dictionaries = (full.task.source_dictionary, full.task.target_dictionary)
    sources = [source for source, _ in backend.split_symbols(full, "test")]

    # fairseq: hprune's beam search on the physically pruned model
    gen = OmegaConf.create({"beam": BEAM, "lenpen": 1.0, "max_len_a": 0, "max_len_b": LENGTH, "min_len": LENGTH,
                            "batch_size": SENTENCES, "max_tokens": None})
    with tempfile.TemporaryDirectory() as tmp:
        backend.export_pruned(full, kept, Path(tmp) / "pruned.pt")
        fairseq_models = {"unpruned": full, "half the heads": backend.load_model(Path(tmp) / "pruned.pt", data)}
    flops = {name: count_flops(backend.translate, m, gen, "test", 1) for name, m in fairseq_models.items()}
    fairseq_times: dict[str, list[float]] = {name: [] for name in fairseq_models}
    for _ in range(ROUNDS):
        for name, m in fairseq_models.items():
            fairseq_times[name].append(backend.translate(m, gen, "test", 1).seconds)
    fairseq_ratio = statistics.median(fairseq_times["unpruned"]) / statistics.median(fairseq_times["half the heads"])
    predicted = flops["unpruned"] / flops["half the heads"]

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for quantization in ("int8", "float32"):
            dirs = {}
            for name, model in models.items():
                dirs[name] = Path(tmp) / f"{quantization}-{name.replace(' ', '_')}"
                dirs[name].mkdir()
                writer.save(writer.model_spec(model, full.cfg.model, *dictionaries), dirs[name], quantization)
            for threads in (1, 2):
                translators = {name: ctranslate2.Translator(str(d), device="cpu", intra_threads=threads,
                                                            compute_type=quantization) for name, d in dirs.items()}
                times: dict[str, list[float]] = {name: [] for name in translators}
                for translator in translators.values():  # warm-up
                    translator.translate_batch(sources[:8], beam_size=BEAM, max_decoding_length=LENGTH)
                for _ in range(ROUNDS):
                    for name, translator in translators.items():
                        started = time.perf_counter()
                        results = translator.translate_batch(sources, beam_size=BEAM, min_decoding_length=LENGTH,
                                                             max_decoding_length=LENGTH, max_batch_size=SENTENCES)
                        times[name].append(time.perf_counter() - started)
                        assert all(len(r.hypotheses[0]) == LENGTH for r in results)
                t_full, t_half = (statistics.median(times[n]) for n in translators)
                rows.append((quantization, threads, SENTENCES / t_full, SENTENCES / t_half, t_full / t_half))

    print(f"  {'runtime':<24} {'unpruned':>10} {'half heads':>11}  speed-up   (sentences/s, beam {BEAM}, "
          f"{SENTENCES} sentences x {LENGTH} tokens)")
    for quantization, threads, full_speed, half_speed, ratio in rows:
        print(f"  CTranslate2 {quantization:<7} {threads} thr {full_speed:10.1f} {half_speed:11.1f}  {ratio:6.3f}")
    t_full, t_half = (statistics.median(fairseq_times[n]) for n in fairseq_models)
    print(f"  {'fairseq (hprune) fp32':<24} {SENTENCES / t_full:10.1f} {SENTENCES / t_half:11.1f}  {fairseq_ratio:6.3f}")
    print(f"  {'predicted from MACs':<24} {'':>10} {'':>11}  {predicted:6.3f}  (fairseq's counted FLOPs)")
    int8 = [r[4] for r in rows if r[0] == "int8"]
    print(f"CTranslate2 int8 speed-up at half the heads per stack = {min(int8):.3f} (1 thread {int8[0]:.3f}, 2 threads "
          f"{int8[1]:.3f}; goal >= 1.4); float32 {rows[2][4]:.3f} / {rows[3][4]:.3f}; fairseq {fairseq_ratio:.3f}; "
          f"MACs predict {predicted:.3f}  [transformer_base]")


if __name__ == "__main__":
    main()
