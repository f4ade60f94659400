"""`hprune eval` sentences/s vs stock `fairseq-generate` on the same checkpoint and settings; BLEU must be equal.

Both report beam-search time only (fairseq-generate's own timer), alternating stock/ours 4 times; medians. Goal: >= 0.95.
Uses outputs/demo (from `make demo`) when present, else trains a short model first.
"""
from __future__ import annotations

import json
import re
import statistics
import sys
import tempfile
from pathlib import Path

from common import BIN, config, demo_checkpoint, floats, prepared_data, run
from sacrebleu.metrics import BLEU

from hprune.backend import PLUGIN_DIR, generation_argv

ROUNDS = 4
# 2,000 test sentences (the training split, hence the vocabulary, is unchanged): a few seconds of beam search
# per run, long enough to rise above this machine's noise
LONGER_TEST = ["data.params.n_test=2000"]


def main() -> None:
    overrides = LONGER_TEST + sys.argv[1:]
    cfg = config("eval", ["device=cpu", "ckpt=unused"] + overrides)
    data = prepared_data(cfg)
    refs = (data.parent / "raw" / f"test.{cfg.data.tgt_lang}").read_text().splitlines()
    speeds: dict[str, list[float]] = {"fairseq-generate": [], "hprune eval": []}
    bleus: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = demo_checkpoint(tmp)
        for i in range(ROUNDS):
            # the same BPE removal as hprune's (the synthetic task's words are subword pieces)
            post_process = ["--post-process", cfg.data.post_process] if cfg.data.post_process else []
            log = run([str(BIN / "fairseq-generate"), str(data), "--path", str(ckpt), "--user-dir", PLUGIN_DIR,
                       *generation_argv(cfg.generation, "test", cfg.seed), *post_process, "--cpu"])
            speeds["fairseq-generate"] += floats(r"\(([\d.]+) sentences/s", log)
            hyps = dict(re.findall(r"^D-(\d+)\t[^\t]*\t(.*)$", log, flags=re.M))
            bleus["fairseq-generate"] = BLEU().corpus_score([hyps[str(j)] for j in range(len(refs))], [refs]).score
            out = Path(tmp) / f"eval{i}"
            run([str(BIN / "hprune"), "eval", f"ckpt={ckpt}", f"hydra.run.dir={out}", "device=cpu", *overrides])
            metrics = json.loads((out / "metrics.json").read_text())
            speeds["hprune eval"].append(metrics["sentences_per_s"])
            bleus["hprune eval"] = metrics["bleu"]
    for name, values in speeds.items():
        print(f"  {name:<17} {statistics.median(values):8.1f} sentences/s   BLEU {bleus[name]:.2f}   "
              f"(runs: {', '.join(f'{v:.0f}' for v in values)})")
    ratio = statistics.median(speeds["hprune eval"]) / statistics.median(speeds["fairseq-generate"])
    same = abs(bleus["hprune eval"] - bleus["fairseq-generate"]) < 1e-3
    print(f"eval sentences/s ratio hprune/fairseq-generate = {ratio:.3f}  (goal >= 0.95); "
          f"BLEU equal: {'yes' if same else 'NO'}  [beam {cfg.generation.beam}, {len(refs)} sentences]")
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
