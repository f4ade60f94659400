"""`hprune_l0`: label-smoothed cross-entropy plus Voita et al.'s expected-L0 penalty on the head gates.

fairseq criteria return token-summed losses that the trainer divides by the sample size (target tokens), so
the penalty is added as λ · L_C · sample_size: after that division the objective is, as in the reference code,
    mean per-token cross-entropy + λ · L_C,
with L_C = Σ_heads P(gate ≠ 0) (`l0_normalize=sum`, the paper) or its mean over gated layers (`layer_mean`,
the-story-of-heads' code, where λ = 0.1 by default). The logged `loss` is that whole objective; `nll_loss` is
the translation loss alone, `open_heads` the expected number of open gates and `alive_heads` those with
P(open) > 0.5 and a deterministic gate > 0.
(No `from __future__ import annotations`: fairseq builds its argument parser from real field types.)
"""

from dataclasses import dataclass, field

import torch
from fairseq.criterions import register_criterion
from fairseq.criterions.label_smoothed_cross_entropy import (
    LabelSmoothedCrossEntropyCriterion,
    LabelSmoothedCrossEntropyCriterionConfig,
)
from fairseq.logging import metrics


@dataclass
class L0CriterionConfig(LabelSmoothedCrossEntropyCriterionConfig):
    l0_lambda: float = field(default=0.0, metadata={"help": "weight λ of the expected-L0 penalty on head gates"})
    l0_normalize: str = field(default="sum", metadata={"help": "sum (over gated heads) or layer_mean"})


@register_criterion("hprune_l0", dataclass=L0CriterionConfig)
class L0Criterion(LabelSmoothedCrossEntropyCriterion):
    def __init__(self, task, sentence_avg, label_smoothing, l0_lambda=0.0, l0_normalize="sum",
                 ignore_prefix_size=0, report_accuracy=False):
        super().__init__(task, sentence_avg, label_smoothing, ignore_prefix_size, report_accuracy)
        if l0_lambda < 0:
            raise ValueError(f"l0_lambda={l0_lambda} must be >= 0")
        if l0_normalize not in ("sum", "layer_mean"):
            raise ValueError(f"unknown l0_normalize '{l0_normalize}'; use sum or layer_mean")
        self.l0_lambda, self.l0_normalize = l0_lambda, l0_normalize

    def forward(self, model, sample, reduce=True):
        loss, sample_size, logging = super().forward(model, sample, reduce=reduce)
        penalty = model.gate_penalty(self.l0_normalize)
        loss = loss + self.l0_lambda * penalty * sample_size
        logging["loss"] = loss.data
        with torch.no_grad():  # tensors, not Python numbers: no host-device synchronisation per step
            gates = [m.gate for _, _, m in model.gates()]
            logging["open_heads"] = sum(gate.p_open().sum() for gate in gates)
            logging["alive_heads"] = sum(gate.alive().sum() for gate in gates)
        return loss, sample_size, logging

    @classmethod
    def reduce_metrics(cls, logging_outputs) -> None:
        super().reduce_metrics(logging_outputs)
        if logging_outputs and "open_heads" in logging_outputs[0]:
            open_heads = sum(float(log["open_heads"]) for log in logging_outputs) / len(logging_outputs)
            metrics.log_scalar("open_heads", open_heads, round=2)
            # alive: P(open) > 0.5 and a deterministic gate > 0, as Voita et al. count them
            metrics.log_scalar("alive_heads", float(logging_outputs[-1]["alive_heads"]), round=1)
