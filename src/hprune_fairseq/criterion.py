"""`hprune`: label-smoothed cross-entropy, plus MoA's auxiliary losses on MoA models and Voita et al.'s
expected-L0 penalty on gated models. On a plain model it is label_smoothed_cross_entropy.

fairseq criteria return token-summed losses that the trainer divides by the sample size (target tokens), so
both extra terms are added multiplied by sample_size: after that division the objective is
    mean per-token cross-entropy + Σ_MoA layers (0.01 L_switch + 0.001 L_z + ...) + λ · L_C.
The MoA coefficients therefore weigh against the per-token cross-entropy, as the paper states them; the
released MoA code added them to the token-summed loss, which divides their effective weight by the tokens per
update (262k in its run.sh). The L0 part is, as in Voita et al.'s reference code,
with L_C = Σ_heads P(gate ≠ 0) (`l0_normalize=sum`, the paper) or its mean over gated layers (`layer_mean`,
the-story-of-heads' code, where λ = 0.1 by default). The logged `loss` is that whole objective; `nll_loss` is
the translation loss alone, `open_heads` the expected number of open gates and `alive_heads` those with
P(open) > 0.5 and a deterministic gate > 0.

Head-budget mode (`l0_budget=K`): instead of a fixed λ, λ = l0_budget_gain · (kept − target) at every
batch, where kept counts the heads whose deterministic gate is > 0 (those the read-out keeps) and the target
falls one head at a time from the heads kept at the start to K over the first `l0_budget_warmup` updates. λ
pushes gates closed while too many heads are kept, is 0 once the count is on target (only the translation
loss moves the gates then), and negative, opening gates, when too few are. There is deliberately no integral
term: Adam moves every pushed gate at about its learning rate whatever λ is, so a gate crosses 0 hundreds of
updates after λ starts pushing it, and any memory of past excess (dual ascent) keeps λ positive after the
count is reached and closes the heads still in transit (measured: 2-3 of a target of 6). The state (updates
taken, heads kept at the start) is the model's integer buffer `budget_state`: saved with it, so a resumed run
continues where it stopped, and exact in fp16/bf16.
(No `from __future__ import annotations`: fairseq builds its argument parser from real field types.)
"""

from dataclasses import dataclass, field
from typing import Optional

import torch
from fairseq.criterions import register_criterion
from fairseq.criterions.label_smoothed_cross_entropy import (
    LabelSmoothedCrossEntropyCriterion,
    LabelSmoothedCrossEntropyCriterionConfig,
)
from fairseq.logging import metrics


@dataclass
class HpruneCriterionConfig(LabelSmoothedCrossEntropyCriterionConfig):
    l0_lambda: float = field(default=0.0, metadata={"help": "weight λ of the expected-L0 penalty on head gates"})
    l0_normalize: str = field(default="sum", metadata={"help": "sum (over gated heads) or layer_mean"})
    l0_budget: Optional[int] = field(default=None, metadata={
        "help": "head-budget mode: set λ (l0_lambda is not used) until this many gated heads are kept"})
    l0_budget_gain: float = field(default=0.05, metadata={
        "help": "head-budget mode: λ = l0_budget_gain · (kept heads − target)"})
    l0_budget_warmup: int = field(default=0, metadata={
        "help": "head-budget mode: updates over which the target falls from the heads kept at the start to "
                "l0_budget"})


@register_criterion("hprune", dataclass=HpruneCriterionConfig)
class HpruneCriterion(LabelSmoothedCrossEntropyCriterion):
    def __init__(self, task, sentence_avg, label_smoothing, l0_lambda=0.0, l0_normalize="sum", l0_budget=None,
                 l0_budget_gain=0.05, l0_budget_warmup=0, ignore_prefix_size=0, report_accuracy=False):
        super().__init__(task, sentence_avg, label_smoothing, ignore_prefix_size, report_accuracy)
        if l0_lambda < 0:
            raise ValueError(f"l0_lambda={l0_lambda} must be >= 0")
        if l0_normalize not in ("sum", "layer_mean"):
            raise ValueError(f"unknown l0_normalize '{l0_normalize}'; use sum or layer_mean")
        if l0_budget is not None and min(l0_budget, l0_budget_gain, l0_budget_warmup) < 0:
            raise ValueError(f"l0_budget={l0_budget}, its gain and its warm-up must be >= 0")
        self.l0_lambda, self.l0_normalize = l0_lambda, l0_normalize
        self.l0_budget, self.l0_budget_gain, self.l0_budget_warmup = l0_budget, l0_budget_gain, l0_budget_warmup

    def forward(self, model, sample, reduce=True):
        loss, sample_size, logging = super().forward(model, sample, reduce=reduce)
        aux = model.moa_aux_loss() if hasattr(model, "moa_aux_loss") else None
        if aux is not None:
            loss = loss + aux * sample_size
            logging.update(loss=loss.data, moa_aux=aux.data, extra_batches=1)
        if hasattr(model, "gates") and next(model.gates(), None) is not None:
            loss = self.add_l0_penalty(model, loss, sample_size, logging)
        return loss, sample_size, logging

    def add_l0_penalty(self, model, loss, sample_size, logging):
        training = model.training and torch.is_grad_enabled()  # a training batch, not validation
        open_probabilities = model.gate_open_probabilities()
        with torch.no_grad():  # tensors, not Python numbers: no host-device synchronisation per step
            p_open, kept = open_probabilities[0].detach(), open_probabilities[1] > 0
            open_heads, kept_heads = p_open.sum(), kept.sum()
            alive_heads = ((p_open > 0.5) & kept).sum()  # alive as Voita et al. count heads
            multiplier = (self.l0_lambda if self.l0_budget is None
                          else self.budget_multiplier(model, kept_heads, advance=training))
        loss = loss + multiplier * model.gate_penalty(self.l0_normalize, open_probabilities) * sample_size
        logging.update(loss=loss.data, open_heads=open_heads, alive_heads=alive_heads, kept_heads=kept_heads,
                       l0_lambda=torch.as_tensor(multiplier, dtype=torch.float32), extra_batches=1)
        return loss

    def budget_multiplier(self, model, kept_heads, advance: bool):
        """λ of the head-budget mode for this batch; `advance` (training batches) records the heads kept at the
        start. The schedule runs on the updates taken (the model's budget_state[0], set from fairseq's update
        count): the same λ for every batch of an update, and the same update count on any number of workers."""
        updates, start = model.budget_state
        start = torch.where(updates == 0, kept_heads, start)
        warmup = max(self.l0_budget_warmup, 1)
        above = (start - self.l0_budget) * (self.l0_budget_warmup - updates).clamp(min=0)
        target = self.l0_budget + (above + warmup - 1) // warmup  # ceil: whole heads
        if advance:
            model.budget_state[1] = start
        return self.l0_budget_gain * (kept_heads - target).float()

    @classmethod
    def reduce_metrics(cls, logging_outputs) -> None:
        """Every extra value is logged per batch with `extra_batches` = 1: with several workers fairseq sums the
        update's logging outputs into one dict (logging_outputs_can_be_summed), with one it hands them over one
        by one, and the sum over `extra_batches` is the mean per batch either way."""
        super().reduce_metrics(logging_outputs)
        batches = sum(float(log.get("extra_batches", 0)) for log in logging_outputs)
        if not batches:
            return
        for key, digits in (("moa_aux", 4), ("open_heads", 2), ("alive_heads", 1), ("kept_heads", 1), ("l0_lambda", 4)):
            if key in logging_outputs[0]:
                metrics.log_scalar(key, sum(float(log[key]) for log in logging_outputs) / batches, round=digits)
