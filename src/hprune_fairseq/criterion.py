"""`hprune`: label-smoothed cross-entropy, plus MoA's auxiliary losses on MoA models and what the pruning
mechanisms a model carries add (mechanisms/: Voita et al.'s expected-L0 penalty on Hard Concrete gates). On a
plain model it is label_smoothed_cross_entropy.

fairseq criteria return token-summed losses that the trainer divides by the sample size (target tokens), so
every extra term, a per-token quantity, is added multiplied by sample_size: after that division the objective is
    mean per-token cross-entropy + Σ_MoA layers (0.01 L_switch + 0.001 L_z + ...) + Σ_mechanisms (their terms).
The MoA coefficients therefore weigh against the per-token cross-entropy, as the paper states them; the
released MoA code added them to the token-summed loss, which divides their effective weight by the tokens per
update (262k in its run.sh). The logged `loss` is that whole objective; `nll_loss` is the translation loss
alone; `moa_aux` and each mechanism's own values are means over an update's batches.
"""

import torch
from fairseq.criterions import register_criterion
from fairseq.criterions.label_smoothed_cross_entropy import (
    LabelSmoothedCrossEntropyCriterion,
    LabelSmoothedCrossEntropyCriterionConfig,
)
from fairseq.logging import metrics

from . import mechanisms


@register_criterion("hprune", dataclass=LabelSmoothedCrossEntropyCriterionConfig)
class HpruneCriterion(LabelSmoothedCrossEntropyCriterion):
    def forward(self, model, sample, reduce=True):
        loss, sample_size, logging = super().forward(model, sample, reduce=reduce)
        aux = model.moa_aux_loss() if hasattr(model, "moa_aux_loss") else None
        if aux is not None:
            loss = loss + aux * sample_size
            logging.update(loss=loss.data, moa_aux=aux.data, extra_batches=1)
        training = model.training and torch.is_grad_enabled()  # a training batch, not validation
        for mechanism in (model.mechanisms() if hasattr(model, "mechanisms") else []):
            term, logged = mechanism.loss(model, training)
            if term is not None:
                loss = loss + term * sample_size
            logging.update(loss=loss.data, **logged, extra_batches=1)
        return loss, sample_size, logging

    @classmethod
    def reduce_metrics(cls, logging_outputs) -> None:
        """Every extra value is logged per batch with `extra_batches` = 1: with several workers fairseq sums the
        update's logging outputs into one dict (logging_outputs_can_be_summed), with one it hands them over one
        by one, and the sum over `extra_batches` is the mean per batch either way."""
        super().reduce_metrics(logging_outputs)
        batches = sum(float(log.get("extra_batches", 0)) for log in logging_outputs)
        if not batches:
            return
        logged = [("moa_aux", 4), *(item for m in mechanisms.MECHANISMS.values() for item in m.logged)]
        for key, digits in logged:
            if key in logging_outputs[0]:
                metrics.log_scalar(key, sum(float(log[key]) for log in logging_outputs) / batches, round=digits)
