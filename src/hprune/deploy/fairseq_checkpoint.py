"""`format=fairseq`: the physically pruned checkpoint (`prune.export=true` writes the same, through the same
code), an `hprune_transformer` checkpoint that stock `fairseq-generate --user-dir <plugin>` loads, checked
against the masked model."""
from __future__ import annotations

import shutil

from ..errors import UserError
from ..rundir import PRUNED, RunDir
from . import register_exporter


@register_exporter("fairseq")
def export(session, mask: dict, out, cfg) -> dict:
    """The pruned fairseq checkpoint, checked against the masked model (outputs, translations, size, MACs)."""
    dest = RunDir(out).checkpoint(PRUNED)
    metrics = session.export(mask, dest, session.evaluate(mask))
    # the same runtime on both sides: translations may differ only where rounding breaks a tie
    tolerance = 1e-3 if cfg.precision == "fp32" else 0.5
    if not metrics["export_same_translations"] and metrics["export_max_abs_diff"] > tolerance:
        shutil.rmtree(dest.parent)
        raise UserError(f"the pruned checkpoint computes other outputs than the masked model (largest difference "
                        f"{metrics['export_max_abs_diff']:.2g}, above {tolerance:g}) and translates differently; "
                        "nothing was written")
    print(f"pruned checkpoint: {metrics['export_checkpoint']} ({metrics['params_removed_pct']} % fewer parameters, "
          f"BLEU {metrics['export_bleu']:.2f}, same translations as the masked model: "
          f"{'yes' if metrics['export_same_translations'] else 'NO'})")
    return metrics
