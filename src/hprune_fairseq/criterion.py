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

`hprune_distill`: the same, with word-level knowledge distillation from a teacher (Kim & Rush 2016, §3.1; Hinton
et al. 2015 at temperature 1): a pruned student recovering what the cut cost learns the unpruned model's
distribution over the vocabulary at every target position, mixed with the references:
    (1 − α) · label-smoothed cross-entropy + α · KL(teacher ‖ student),  per target token.
The KL's gradient is that of the cross-entropy to the teacher's distribution (they differ by the teacher's entropy,
a constant), and it is 0 when the student computes what the teacher does, so the logged `distill_kl` reads as
how far the student still is (in bits per token, as fairseq logs its loss).
"""
import math
from dataclasses import dataclass, field

import torch
from fairseq.criterions import register_criterion
from fairseq.criterions.label_smoothed_cross_entropy import (
    LabelSmoothedCrossEntropyCriterion,
    LabelSmoothedCrossEntropyCriterionConfig,
    label_smoothed_nll_loss,
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
        logged = [("moa_aux", 4), ("distill_kl", 4), *(item for m in mechanisms.MECHANISMS.values() for item in m.logged)]
        for key, digits in logged:
            if key in logging_outputs[0]:
                metrics.log_scalar(key, sum(float(log[key]) for log in logging_outputs) / batches, round=digits)


@dataclass
class DistillationConfig(LabelSmoothedCrossEntropyCriterionConfig):
    teacher: str = field(default="", metadata={
        "help": "the teacher's checkpoint (the unpruned model), on the same dictionaries (`hprune recover` passes the "
                "model it opened)"})
    teacher_weight: float = field(default=0.5, metadata={
        "help": "α: (1 − α) · cross-entropy on the references + α · KL(teacher ‖ student), per target token"})


@register_criterion("hprune_distill", dataclass=DistillationConfig)
class DistillationCriterion(HpruneCriterion):
    def __init__(self, task, sentence_avg, label_smoothing, teacher, teacher_weight, ignore_prefix_size=0,
                 report_accuracy=False):
        super().__init__(task, sentence_avg, label_smoothing, ignore_prefix_size, report_accuracy)
        if not teacher:
            raise ValueError("--criterion hprune_distill needs --teacher CHECKPOINT")
        if not 0 <= teacher_weight <= 1:
            raise ValueError(f"--teacher-weight {teacher_weight} must be in [0, 1]")
        self.teacher_path, self.teacher_weight = teacher, teacher_weight
        self._teacher = ()  # (model,) once loaded: held outside the module tree, so never trained, moved or saved
        self._kl = None

    def teacher(self, like: torch.Tensor):
        """The teacher in eval mode (no dropout), on the device and dtype of `like` (a weight of the student);
        loaded at the first batch (its building draws no random numbers of the training's: a resumed run's
        dropout is an uninterrupted one's)."""
        if not self._teacher:
            from fairseq import checkpoint_utils

            from .safe_load import allow_fairseq_checkpoint_globals

            allow_fairseq_checkpoint_globals()  # torch's weights-only loading of a fairseq checkpoint
            with torch.random.fork_rng(devices=[]):
                models, _ = checkpoint_utils.load_model_ensemble([self.teacher_path], task=self.task, strict=True)
            self._teacher = (models[0].eval().requires_grad_(False),)
        model = self._teacher[0]
        weight = next(model.parameters())
        if weight.device != like.device or weight.dtype != like.dtype:
            model.to(device=like.device, dtype=like.dtype)
        return model

    def compute_loss(self, model, net_output, sample, reduce=True):
        lprobs, target = self.get_lprobs_and_target(model, net_output, sample)
        loss, nll_loss = label_smoothed_nll_loss(lprobs, target, self.eps, ignore_index=self.padding_idx,
                                                 reduce=reduce)
        with torch.no_grad():
            teacher = self.teacher(next(model.parameters()))
            taught = teacher.get_normalized_probs(teacher(**sample["net_input"]), log_probs=True)
            if self.ignore_prefix_size > 0:
                taught = taught[:, self.ignore_prefix_size:, :]
            taught = taught.reshape(-1, taught.size(-1))
            probs = taught.exp()
            negative_entropy = (probs * taught).sum(-1)
        # KL = Σ p log p − Σ p log q: autograd keeps p (N × V) alone, beside the student's own log-probabilities
        kl = (negative_entropy - (probs * lprobs).sum(-1)).masked_fill(target.eq(self.padding_idx), 0.0)
        kl = kl.sum() if reduce else kl.unsqueeze(-1)  # (label_smoothed_nll_loss's shapes)
        self._kl = kl.detach().sum()
        return (1 - self.teacher_weight) * loss + self.teacher_weight * kl, nll_loss

    def forward(self, model, sample, reduce=True):
        loss, sample_size, logging = super().forward(model, sample, reduce=reduce)
        logging.update(distill_kl=self._kl / sample_size / math.log(2), extra_batches=1)  # bits, as fairseq's loss
        return loss, sample_size, logging
