"""The end of scripts/study_ffn.sh: heads + FFN neurons against heads alone at the same latency, per calibration
draw, with sacreBLEU's paired bootstrap between the two runs' translations of the test set.

    python scripts/study_ffn_summary.py outputs/study_ffn
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from hprune.bleu import tokenize_of
from hprune.reporting.significance import paired_bootstrap


def main(root: Path) -> None:
    rows = []
    for draw in sorted(p for p in root.iterdir() if (p / "heads" / "metrics.json").exists()):
        runs = {name: json.loads((draw / name / "metrics.json").read_text()) for name in ("ffn", "heads")}
        hyps = {name: (draw / name / "hypotheses" / "pruned.txt").read_text().splitlines() for name in runs}
        references = (draw / "ffn" / "references.txt").read_text().splitlines()
        test = paired_bootstrap(hyps["heads"], hyps["ffn"], references, 1000, 12345,
                                tokenize_of(runs["ffn"]["bleu_signature"]))
        rows.append({"draw": draw.name, **{f"bleu_{n}": m["bleu"] for n, m in runs.items()},
                     **{f"latency_{n}": m["latency_pct_measured"] for n, m in runs.items()},
                     "predicted_heads": runs["heads"]["latency_pct_predicted"],
                     "model_macs_ffn": 100 * runs["ffn"]["macs_per_token_pruned"] / runs["ffn"]["macs_per_token_unpruned"],
                     "model_macs_heads": 100 * runs["heads"]["macs_per_token_pruned"]
                     / runs["heads"]["macs_per_token_unpruned"],
                     "kept": f"{runs['ffn']['kept_heads']} heads + {runs['ffn']['kept_neurons']} neurons / "
                             f"{runs['heads']['kept_heads']} heads", "p": test["p_value"],
                     "winner": ("heads + FFN" if test["bleu"] > test["reference_bleu"] else "heads")
                     if test["significant"] else "neither (p >= 0.05)"})
    print("draw  heads+FFN: BLEU  latency %  MACs %   heads only: BLEU  latency % (predicted)  MACs %   kept   p   "
          "better")
    for r in rows:
        print(f"{r['draw']:>4}  {r['bleu_ffn']:15.2f} {r['latency_ffn']:9.1f} {r['model_macs_ffn']:7.1f}   "
              f"{r['bleu_heads']:16.2f} {r['latency_heads']:9.1f} ({r['predicted_heads']:.1f}) {r['model_macs_heads']:9.1f}"
              f"   {r['kept']}   {r['p']:.4f}  {r['winner']}")
    if len(rows) > 1:
        for name, label in (("ffn", "heads + FFN"), ("heads", "heads only")):
            bleu = [r[f"bleu_{name}"] for r in rows]
            latency = [r[f"latency_{name}"] for r in rows]
            print(f"{label}: BLEU {statistics.mean(bleu):.2f} ± {statistics.stdev(bleu):.2f}, latency "
                  f"{statistics.mean(latency):.1f} ± {statistics.stdev(latency):.1f} % of the unpruned model's "
                  f"({len(rows)} calibration draws)")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "outputs/study_ffn"))
