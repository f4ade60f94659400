"""Differentiable Subset Pruning (Li, Cotterell and Sachan, TACL 2021; code rycolab/differentiable-subset-pruning):
a learned logit per head, and a mask that keeps exactly K heads.

Training, from the logits w (one per head of the selected attention types, pooled as the reference pools every
head of the model): r = w + Gumbel noise, then K rounds of
    p_j = softmax(r / τ),   r <- r + log(max(1 - p_j, tiny))
and the mask is Σ_j p_j (Plötz and Roth's relaxed top-K, as the reference's `gumbel_soft_top_k`): it sums to
exactly K, and as τ -> 0 it is the hard top-K of r. τ falls log-linearly from the initial to the final
temperature over `cooldown` training steps, then stays. With `straight_through` the mask is the hard top-K
of w, and gradients pass to w unchanged (the reference's STEFunction). In evaluation the mask is the hard top-K
of w: exactly K heads. A selector with K at least the number of heads is the identity (every mask 1): the
control, the same training without the selection.

Each selected module's `gate` is a `SubsetGate`, its slice of the model's mask, so it scales the head (or
expert) outputs exactly as a Hard Concrete gate does, and folds into out_proj the same way. The logits are
`logit_scale` · θ: Adam moves θ by about its learning rate per step whatever the gradient's size, so with a
fixed learning rate lr and logit_scale = pruning_lr / lr the logits move at about pruning_lr per step, as the
reference's own parameter group for them does (its Adam leaves that group's rate out of the schedule), and
fairseq-train needs no optimizer of its own.
"""
# (No `from __future__ import annotations`: fairseq builds its argument parser from real field types.)

import math
from dataclasses import dataclass, field
from typing import List, Optional

import torch
from fairseq.dataclass import FairseqDataclass
from torch import Tensor, nn

from hprune.attention_types import ATTENTION_TYPES, check_attention_types

from . import Mechanism, register_mechanism
from .gates import uniform_per_worker

TINY = torch.finfo(torch.float64).tiny
TEMPERATURE, COOLDOWN = (0.1, 1e-8), 250  # the reference code's IWSLT schedule


def soft_top_k(scores: Tensor, k: int, temperature: float) -> Tensor:
    """The relaxed top-k mask of scores (float64): Σ of k successive softmaxes, each with the mass already taken
    removed; sums to k."""
    keys = scores.double()
    mask = torch.zeros_like(keys)
    for _ in range(k):
        p = torch.softmax(keys / temperature, dim=-1)
        mask = mask + p
        keys = keys + torch.log((1 - p).clamp(min=TINY))
    return mask


def hard_top_k(scores: Tensor, k: int) -> Tensor:
    """1 on the k largest scores (ties: the lower index), 0 elsewhere."""
    mask = torch.zeros_like(scores)
    return mask.scatter(-1, scores.topk(k, dim=-1, sorted=False).indices, 1.0)


class _StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scores: Tensor, k: int) -> Tensor:
        return hard_top_k(scores, k)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


class SubsetSelector(nn.Module):
    def __init__(self, count: int, k: int, temperature: tuple = TEMPERATURE, cooldown: int = COOLDOWN,
                 straight_through: bool = False, logit_scale: float = 1.0, init_bound: float = 0.5):
        super().__init__()
        if k < 0 or count <= 0:
            raise ValueError(f"DSP needs 0 <= K and at least one head, got K={k} of {count}")
        initial, final = temperature
        if not (initial > 0 and final > 0 and cooldown >= 0 and logit_scale > 0):
            raise ValueError("DSP needs positive temperatures and logit scale and a cooldown >= 0")
        self.count, self.k, self.initial, self.final, self.cooldown = count, k, initial, final, cooldown
        self.straight_through, self.logit_scale = straight_through, logit_scale
        self.theta = nn.Parameter(torch.empty(count).uniform_(-init_bound, init_bound) / logit_scale)
        # updates taken (fairseq's, set before each training batch): resumes with the model, and counts alike on
        # one worker with update_freq W and on W workers
        self.register_buffer("step", torch.zeros((), dtype=torch.long))
        self.current: Tensor | None = None

    @property
    def logits(self) -> Tensor:
        return self.theta * self.logit_scale

    def set_num_updates(self, num_updates: int) -> None:
        self.step.fill_(num_updates)

    def temperature(self) -> float:
        step = int(self.step)
        if self.cooldown == 0 or step >= self.cooldown:
            return self.final
        return math.exp(math.log(self.initial) - step / self.cooldown * (math.log(self.initial) - math.log(self.final)))

    def deterministic(self) -> Tensor:
        """The evaluation mask: the hard top-K of the logits."""
        if self.k >= self.count:
            return torch.ones_like(self.theta)
        return hard_top_k(self.logits.detach(), self.k)

    def sample(self) -> Tensor:
        """A training batch's mask (kept in `current` for the gates), at the temperature of the update."""
        if self.k >= self.count:
            mask = torch.ones_like(self.theta)
        elif self.straight_through:
            mask = _StraightThrough.apply(self.logits, self.k)
        else:
            uniform = uniform_per_worker(self.theta, torch.float64) * (1 - TINY) + TINY
            noisy = self.logits.double() - torch.log(-torch.log(uniform))
            mask = soft_top_k(noisy, self.k, self.temperature()).to(self.theta.dtype)
        self.current = mask
        return mask

    def gates(self, sizes: List[int]) -> List["SubsetGate"]:
        """One gate per module, over consecutive slices of the logits."""
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return [SubsetGate(self, start, size) for start, size in zip(starts, sizes)]


class SubsetGate:
    """A module's slice of the selector's mask, in the `gate` interface of the attention modules: called, the
    training step's mask (or the evaluation mask outside training); `deterministic()`, the evaluation mask.
    Not an nn.Module: the selector (a submodule of the model) owns the parameters."""

    def __init__(self, selector: SubsetSelector, start: int, size: int):
        self.selector, self.start, self.size = selector, start, size

    def __call__(self) -> Tensor:
        selector = self.selector
        mask = selector.current if selector.training and selector.current is not None else selector.deterministic()
        return mask[self.start:self.start + self.size]

    def deterministic(self) -> Tensor:
        return self.selector.deterministic()[self.start:self.start + self.size]


@dataclass
class SubsetConfig(FairseqDataclass):
    """The model flags of DSP's subset selection (fairseq generates them from this)."""
    dsp_heads: Optional[int] = field(default=None, metadata={
        "help": "Differentiable Subset Pruning: keep exactly K heads of --dsp-types"})
    dsp_types: Optional[str] = field(default=None, metadata={
        "help": "attention types whose heads DSP selects from, comma-separated (default: all three)"})
    dsp_temperature: str = field(default=",".join(map(str, TEMPERATURE)), metadata={
        "help": "DSP: initial and final temperature, T0,T1"})
    dsp_cooldown: int = field(default=COOLDOWN, metadata={
        "help": "DSP: updates over which the temperature falls (log-linearly)"})
    dsp_straight_through: bool = field(default=False, metadata={
        "help": "DSP: hard top-K in the forward pass, gradients straight through"})
    dsp_logit_scale: float = field(default=1.0, metadata={
        "help": "DSP: logits = C · θ, so Adam moves them about C times the learning rate"})
    dsp_logits_only: bool = field(default=False, metadata={
        "help": "DSP: train the logits only, the model frozen (the reference's pipelined mode)"})


def _draw_subset(model, args) -> None:
    """Each training forward draws its mask first (a hook, not a forward override: the model stays scriptable)."""
    selector = getattr(model, "head_selector", None)
    if selector is not None and model.training:
        selector.sample()


class SubsetSelection(Mechanism):
    name = "subset_selection"
    config = SubsetConfig

    def wanted(self, args) -> bool:
        return getattr(args, "dsp_heads", None) is not None

    def install(self, model, args) -> None:
        """One logit per head of --dsp-types, initialised Xavier-uniform for a (sublayers, heads per sublayer)
        matrix as the reference's; each module's gate its slice of the mask."""
        temperature = getattr(args, "dsp_temperature", None)
        initial, final = (float(t) for t in temperature.split(",")) if temperature else TEMPERATURE
        types = check_attention_types((getattr(args, "dsp_types", None) or ",".join(ATTENTION_TYPES)).split(","),
                                      "--dsp-types", "enc-self")
        modules = [m for attn_type, _, m in model.attention_modules() if attn_type in types]
        sizes = [m.num_heads for m in modules]
        bound = math.sqrt(6.0 / (len(modules) + max(sizes)))
        model.head_selector = SubsetSelector(sum(sizes), args.dsp_heads, (initial, final),
                                             getattr(args, "dsp_cooldown", COOLDOWN),
                                             getattr(args, "dsp_straight_through", False),
                                             getattr(args, "dsp_logit_scale", 1.0), bound
                                             ).to(next(model.parameters()).device)
        for module, gate in zip(modules, model.head_selector.gates(sizes)):
            module.gate = gate
        model.register_forward_pre_hook(_draw_subset)
        if getattr(args, "dsp_logits_only", False):
            for name, p in model.named_parameters():
                p.requires_grad_(name == "head_selector.theta")

    def present(self, model) -> bool:
        return getattr(model, "head_selector", None) is not None

    def upgrade_state_dict(self, model, state_dict: dict, prefix: str) -> None:
        """A DSP model loads a plain checkpoint: its logits where they were initialised, its update count 0."""
        if f"{prefix}head_selector.theta" not in state_dict:
            state_dict[f"{prefix}head_selector.theta"] = model.head_selector.theta.detach().clone()
            state_dict[f"{prefix}head_selector.step"] = torch.zeros((), dtype=torch.long)

    def remove(self, model) -> None:
        delattr(model, "head_selector")


register_mechanism(SubsetSelection())
