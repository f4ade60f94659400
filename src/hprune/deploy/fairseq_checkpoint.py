"""`format=fairseq`: the physically pruned checkpoint, an `hprune_transformer` checkpoint that stock
`fairseq-generate --user-dir <plugin>` loads, checked against the masked model. `prune.export=true` writes the
same through `write_checked`."""
from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Optional

import torch

from ..errors import UserError
from ..flops import pruned_macs
from ..rundir import PRUNED, RunDir
from . import register_exporter

log = logging.getLogger(__name__)


def write_checked(evaluator, mask: dict, dest: Path, masked, config_from: Optional[Path] = None) -> dict:
    """Physically remove the heads `mask` drops into `dest`, reopen it, and check it against the evaluator's model
    under the mask (`masked`: evaluator.evaluate(mask)): largest output difference on a batch of the loss split,
    BLEU, same translations, size, MACs per target token counted on both over the loss split (whole model and
    attention; as the budget's unit costs are) and speed. config_from: see backend.export_pruned."""
    session, measure = evaluator.session, evaluator.measure
    pruned = evaluator.on(session.write_pruned(mask, dest, config_from))
    sample = next(session.batches(measure.loss_split, measure.max_tokens, 1))
    with torch.no_grad(), session.masked(mask):
        reference = session.model(**sample["net_input"])[0].float()
        difference = (pruned.session.model(**sample["net_input"])[0].float() - reference).abs().max().item()
    result = pruned.evaluate(None)
    same = result.hypotheses == masked.hypotheses
    if not same:
        log.warning("the physically pruned model's translations differ from the masked model's")
    n_params, n_params_pruned = session.n_params(), pruned.session.n_params()
    return {"export_checkpoint": str(dest.absolute()), "export_max_abs_diff": difference,
            "export_bleu": result.bleu, "export_same_translations": same, "n_params_pruned": n_params_pruned,
            "params_removed_pct": round(100 * (1 - n_params_pruned / n_params), 2),
            **pruned_macs(session.model, pruned.session.model, evaluator.lengths()),
            "sentences_per_s_masked": masked.sentences_per_s, "sentences_per_s_pruned": result.sentences_per_s}


@register_exporter("fairseq")
def export(evaluator, mask: dict, out, cfg) -> dict:
    """The pruned fairseq checkpoint, checked against the masked model (outputs, translations, size, MACs)."""
    dest = RunDir(out).checkpoint(PRUNED)
    metrics = write_checked(evaluator, mask, dest, evaluator.evaluate(mask))
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
