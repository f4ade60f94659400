"""The end of scripts/study_roles.sh: head roles and the survival test per training seed, and over the seeds.

    python scripts/study_roles.py outputs/roles

Reads <seed>/analyze (head_roles.csv, metrics.json) and <seed>/voita_dec_enc (the masks of Voita's gates on the
encoder-decoder heads) for every seed folder; writes survival.json beside them.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd

from hprune.analysis.survival import pooled_survival_test, role_survival_test, sweep_masks
from hprune.files import write_atomic


def main(root: Path) -> None:
    studies, rows = [], []
    for folder in sorted(p for p in root.iterdir() if (p / "analyze" / "metrics.json").exists()):
        metrics = json.loads((folder / "analyze" / "metrics.json").read_text())
        roles = pd.read_csv(folder / "analyze" / "head_roles.csv")
        dec_enc, masks = roles[roles["type"] == "dec-enc"], sweep_masks(folder / "voita_dec_enc")
        test = role_survival_test(dec_enc, masks, ["alignment"])
        studies.append((dec_enc, masks))
        rows.append({"seed": folder.name, **{f"enc-self {r}": metrics[f"{r}_heads"] for r in ("positional", "syntactic", "rare")},
                     "dec-self positional": metrics["dec_self_positional_heads"],
                     "alignment heads": metrics["alignment_heads"], "best AER": metrics["best_alignment_aer"],
                     "kept per λ": " ".join(f"{lam:g}:{sum(map(sum, m['dec-enc']))}" for lam, m in sorted(masks.items())),
                     "open, role": test["mean_open_role"], "open, other": test["mean_open_other"], "p": test["p_value"]})
    table = pd.DataFrame(rows)
    pooled = pooled_survival_test(studies, ["alignment"])
    print(table.to_markdown(index=False))
    print(f"\nover the {pooled['models']} seeds ({pooled['role_heads']} alignment heads, {pooled['other_heads']} others; "
          f"labels permuted within each seed): open at {pooled['mean_open_role']} vs {pooled['mean_open_other']} "
          f"of the λ > 0, p = {pooled['p_value']}")
    write_atomic(root / "survival.json", json.dumps({"seeds": rows, "pooled": pooled}, indent=1) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "outputs/roles"))
