"""Training tokens/s: hprune_transformer vs stock fairseq `transformer`, and hprune_transformer with Voita et al.'s
head gates and L0 criterion vs without, identical dimensions, data and flags.

Each arch is trained for the same number of updates, alternating (stock, ours, gated, stock, ...) so that machine
noise hits all; each round gives a ratio of median per-interval words-per-second between runs minutes apart,
and the median over rounds is printed (this machine's speed drifts by several % over the whole benchmark).
Goal: >= 0.95.
"""
from __future__ import annotations

import statistics
import sys
import tempfile

from common import BIN, config, floats, prepared_data, run

from hprune.backend import PLUGIN_DIR, flags

UPDATES, INTERVAL, ROUNDS = 80, 10, 4  # 4 alternating rounds: 2 left the ratio 0.93 to 1.05 run to run


def main() -> None:
    cfg = config("train", ["device=cpu"] + sys.argv[1:])
    data = prepared_data(cfg)
    common = [str(data), "--task", "translation", "--source-lang", cfg.data.src_lang, "--target-lang",
              cfg.data.tgt_lang, *flags(cfg.model, skip=("arch",)), *flags(cfg.optim, skip=("max_update", "criterion")),
              "--max-update", str(UPDATES), "--no-save", "--disable-validation", "--cpu", "--num-workers", "0",
              "--log-format", "simple", "--log-interval", str(INTERVAL), "--seed", "1"]
    ours = ["--user-dir", PLUGIN_DIR, "--arch", cfg.model.arch, "--criterion", "hprune"]
    archs = {"stock transformer": ["--arch", "transformer", "--criterion", "label_smoothed_cross_entropy"],
             "hprune_transformer": ours,
             # Voita et al.'s training: a Hard Concrete gate on every head and the L0 penalty
             "hprune + head gates": [*ours, "--head-gates", "enc-self,dec-self,dec-enc", "--l0-lambda", "0.1"]}
    wps: dict[str, list[float]] = {name: [] for name in archs}  # per round: the median interval
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(ROUNDS):
            for name, arch_flags in archs.items():
                log = run([str(BIN / "fairseq-train"), *common, *arch_flags, "--save-dir", tmp])
                intervals = floats(r"train_inner.*? wps=([\d.]+)", log)[1:]  # the first interval warms up
                wps[name].append(statistics.median(intervals))
    for name, values in wps.items():
        print(f"  {name:<22} {statistics.median(values):10.0f} target tokens/s (median over {ROUNDS} rounds; "
              f"rounds: {', '.join(f'{v:.0f}' for v in values)})")
    shape = f"[{cfg.model.encoder_layers}+{cfg.model.decoder_layers} layers, d={cfg.model.encoder_embed_dim}]"
    for label, ours_name, base in (("hprune/stock", "hprune_transformer", "stock transformer"),
                                   ("with head gates/without", "hprune + head gates", "hprune_transformer")):
        rounds = [a / b for a, b in zip(wps[ours_name], wps[base])]
        print(f"train tokens/s ratio {label} = {statistics.median(rounds):.3f}  (goal >= 0.95; rounds: "
              f"{', '.join(f'{r:.3f}' for r in rounds)})  {shape}")


if __name__ == "__main__":
    main()
