"""Hard Concrete head gates (Louizos et al. 2018) as Voita et al. 2019 used them: one scalar gate per head, and
the expected-L0 penalty they add to the training objective (a mechanism: mechanisms/__init__.py).

With l < 0 < 1 < r the stretch limits, β the temperature and u ~ U(0, 1):
  training  s = sigmoid((log u - log(1 - u) + log α) / β),  g = clip(s (r - l) + l, 0, 1)   (one u per head)
  test      g = clip(sigmoid(log α) (r - l) + l, 0, 1)                                   (deterministic)
  P(g ≠ 0) = sigmoid(log α - β log(-l / r)),   P(g = 1) = sigmoid(log α - β log((1 - l) / (r - 1)))
Defaults are those of the-story-of-heads `ConcreteGate`: β = 0.33, (l, r) = (-0.1, 1.1), log α initialised
Glorot-uniform for their [1, H, 1, 1] shape, i.e. U(-sqrt(3/H), sqrt(3/H)).

The penalty (`l0_lambda`, criterion `hprune` adds it per target token): λ · L_C with L_C = Σ_heads P(gate ≠ 0)
(`l0_normalize=sum`, the paper) or its mean over gated layers (`layer_mean`, the-story-of-heads' code, where λ =
0.1 by default). Logged: `open_heads` (expected open gates), `alive_heads` (P(open) > 0.5 and a deterministic
gate > 0), `kept_heads` (deterministic gate > 0) and λ.

Head-budget mode (`l0_budget=K`): instead of a fixed λ, λ = l0_budget_gain · (kept − target) at every batch,
where kept counts the heads whose deterministic gate is > 0 (those the read-out keeps) and the target falls one
head at a time from the heads kept at the start to K over the first `l0_budget_warmup` updates. λ pushes gates
closed while too many heads are kept, is 0 once the count is on target (only the translation loss moves the
gates then), and negative, opening gates, when too few are. There is deliberately no integral term: Adam moves
every pushed gate at about its learning rate whatever λ is, so a gate crosses 0 hundreds of updates after λ
starts pushing it, and any memory of past excess (dual ascent) keeps λ positive after the count is reached and
closes the heads still in transit (measured: 2-3 of a target of 6). The state (updates taken, heads kept at the
start) is the model's integer buffer `budget_state`: saved with it, so a resumed run continues where it stopped,
and exact in fp16/bf16; the updates come from fairseq's update count, so the schedule is in updates whatever
the workers and update_freq.
"""
# (No `from __future__ import annotations`: fairseq builds its argument parser from real field types.)

import math
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

import torch
from fairseq.dataclass import FairseqDataclass
from torch import Tensor, nn

from hprune.attention_types import check_attention_types

from . import Mechanism, register_mechanism

EPS = 1e-6


def uniform_per_worker(like: Tensor, dtype: Optional[torch.dtype] = None) -> Tensor:
    """U(0, 1) noise shaped like `like`, a different draw on every data-parallel worker. fairseq seeds every
    worker alike at each update, so plain draws would repeat across the workers: W workers would then make one
    draw per update where one worker with update_freq W makes W. Each worker draws the noise of all of them
    and keeps its own row, so the random stream advances alike everywhere (dropout keeps fairseq's behaviour),
    and one worker draws exactly what it drew before."""
    import torch.distributed as dist

    world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_available() and dist.is_initialized() else (1, 0)
    return torch.rand((world, *like.shape), dtype=dtype or like.dtype, device=like.device)[rank]


class HardConcreteGate(nn.Module):
    def __init__(self, num_heads: int, temperature: float = 0.33, stretch: tuple = (-0.1, 1.1),
                 init: Optional[float] = None):
        super().__init__()
        low, high = stretch
        if not (low < 0 and high > 1 and temperature > 0):
            raise ValueError(f"Hard Concrete needs l < 0 < 1 < r and β > 0, got l={low}, r={high}, β={temperature}")
        self.temperature, self.low, self.high = temperature, low, high
        self.log_alpha = nn.Parameter(torch.empty(num_heads))
        self.reset_parameters(init)

    @torch.no_grad()
    def reset_parameters(self, init: Optional[float] = None) -> None:
        """init=None: Glorot-uniform as the reference code; a number: every log α set to it."""
        if init is None:
            bound = math.sqrt(3.0 / max(len(self.log_alpha), 1))
            self.log_alpha.uniform_(-bound, bound)
        else:
            self.log_alpha.fill_(init)

    def forward(self) -> Tensor:
        """A fresh noisy gate per head in training, the deterministic gate otherwise; shape (heads,)."""
        if not self.training:
            return self.deterministic()
        noise = torch.logit(uniform_per_worker(self.log_alpha), eps=EPS)  # log u - log(1 - u), u in [ε, 1-ε]
        s = torch.sigmoid((noise + self.log_alpha) / self.temperature)
        return (s * (self.high - self.low) + self.low).clamp(0.0, 1.0)

    def deterministic(self, log_alpha: Optional[Tensor] = None) -> Tensor:
        """The test-time gate per head, of this gate's log α or of the given ones (same β, l, r)."""
        log_alpha = self.log_alpha if log_alpha is None else log_alpha
        return (torch.sigmoid(log_alpha) * (self.high - self.low) + self.low).clamp(0.0, 1.0)

    def p_open(self, log_alpha: Optional[Tensor] = None) -> Tensor:
        """P(gate ≠ 0) per head, the expected L0 norm's terms; of this gate's log α or of the given ones."""
        log_alpha = self.log_alpha if log_alpha is None else log_alpha
        shift = self.temperature * math.log(-self.low / self.high)
        return torch.sigmoid(log_alpha - shift).clamp(EPS, 1 - EPS)

    def keep(self, local) -> None:
        """Physical pruning: keep the gates of the heads at these positions."""
        self.log_alpha = nn.Parameter(self.log_alpha[local])


@dataclass
class GatesConfig(FairseqDataclass):
    """The model flags of Hard Concrete gates and their L0 penalty (fairseq generates them from this)."""
    head_gates: Optional[str] = field(default=None, metadata={
        "help": "Hard Concrete gates on the heads of these attention types, comma-separated (enc-self, dec-self, "
                "dec-enc)"})
    gate_log_alpha_init: Optional[float] = field(default=None, metadata={
        "help": "initial log alpha of every gate (default: Glorot-uniform, as Voita et al.)"})
    l0_lambda: float = field(default=0.0, metadata={"help": "weight λ of the expected-L0 penalty on the gates"})
    l0_normalize: str = field(default="sum", metadata={"help": "sum (over gated heads) or layer_mean"})
    l0_budget: Optional[int] = field(default=None, metadata={
        "help": "head-budget mode: set λ (l0_lambda is not used) until this many gated heads are kept"})
    l0_budget_gain: float = field(default=0.05, metadata={
        "help": "head-budget mode: λ = l0_budget_gain · (kept heads − target)"})
    l0_budget_warmup: int = field(default=0, metadata={
        "help": "head-budget mode: updates over which the target falls from the heads kept at the start to "
                "l0_budget"})


class HardConcreteGates(Mechanism):
    name = "hard_concrete_gates"
    config = GatesConfig
    logged = (("open_heads", 2), ("alive_heads", 1), ("kept_heads", 1), ("l0_lambda", 4))

    def install(self, model, args) -> None:
        settings = GatesConfig(**{key: getattr(args, key, getattr(GatesConfig, key)) for key in self.flags()})
        if settings.l0_lambda < 0:
            raise ValueError(f"l0_lambda={settings.l0_lambda} must be >= 0")
        if settings.l0_normalize not in ("sum", "layer_mean"):
            raise ValueError(f"unknown l0_normalize '{settings.l0_normalize}'; use sum or layer_mean")
        if settings.l0_budget is not None and min(settings.l0_budget, settings.l0_budget_gain,
                                                   settings.l0_budget_warmup) < 0:
            raise ValueError(f"l0_budget={settings.l0_budget}, its gain and its warm-up must be >= 0")
        types = check_attention_types(settings.head_gates.split(","), "--head-gates", "enc-self")
        for attn_type, _, module in model.attention_modules():
            if attn_type in types:
                add_gate(module, settings.gate_log_alpha_init)
        model.gate_settings = settings
        # the head-budget controller's state: the updates taken and the heads kept at the start; integers, so
        # fp16/bf16 cannot round them away; saved with the model, so a resumed run continues where it stopped
        model.register_buffer("budget_state", torch.zeros(2, dtype=torch.long))

    def present(self, model) -> bool:
        return any(isinstance(m.gate, HardConcreteGate) for _, _, m in model.attention_modules())

    def set_num_updates(self, model, num_updates: int) -> None:
        if hasattr(model, "budget_state"):
            model.budget_state[0] = num_updates

    def loss(self, model, training: bool) -> Tuple[Optional[Tensor], Dict[str, Tensor]]:
        settings = model.gate_settings
        open_probabilities = gate_open_probabilities(model)
        with torch.no_grad():  # tensors, not Python numbers: no host-device synchronisation per step
            p_open, kept = open_probabilities[0].detach(), open_probabilities[1] > 0
            open_heads, kept_heads = p_open.sum(), kept.sum()
            alive_heads = ((p_open > 0.5) & kept).sum()  # alive as Voita et al. count heads
            multiplier = (settings.l0_lambda if settings.l0_budget is None
                          else budget_multiplier(model, settings, kept_heads, advance=training))
        penalty = multiplier * gate_penalty(model, settings.l0_normalize, open_probabilities)
        return penalty, {"open_heads": open_heads, "alive_heads": alive_heads, "kept_heads": kept_heads,
                         "l0_lambda": torch.as_tensor(multiplier, dtype=torch.float32)}

    def upgrade_state_dict(self, model, state_dict: dict, prefix: str) -> None:
        """A gated model loads an ungated checkpoint: the gates keep their initial values, the budget its zeros."""
        for name, module in model.named_modules():
            if isinstance(module, HardConcreteGate) and f"{prefix}{name}.log_alpha" not in state_dict:
                state_dict[f"{prefix}{name}.log_alpha"] = module.log_alpha.detach().clone()
        if hasattr(model, "budget_state") and f"{prefix}budget_state" not in state_dict:
            state_dict[f"{prefix}budget_state"] = torch.zeros(2, dtype=torch.long)

    def remove(self, model) -> None:
        if hasattr(model, "budget_state"):
            delattr(model, "budget_state")


def add_gates(model, types, init: Optional[float] = None, **settings) -> None:
    """Install gates on the heads of `types` with these flag settings (GatesConfig's fields), as a model built
    with --head-gates gets them."""
    from argparse import Namespace
    HardConcreteGates().install(model, Namespace(**{**vars(GatesConfig()), **settings, "head_gates": ",".join(types),
                                                    "gate_log_alpha_init": init}))


def add_gate(module, init: Optional[float] = None) -> None:
    """A gate on every unit of one attention module (a HeadAttention's heads, a MoA layer's experts)."""
    module.gate = HardConcreteGate(module.num_heads, init=init).to(next(module.parameters()).device).train(module.training)


def gated_heads(model):
    """(type, layer, module) of the attention modules with Hard Concrete gates."""
    return ((attn_type, layer, m) for attn_type, layer, m in model.attention_modules() if isinstance(m.gate, HardConcreteGate))


def gate_open_probabilities(model) -> Tuple[Tensor, Tensor, int]:
    """P(gate ≠ 0) and the deterministic gate of every gated head, concatenated over the gated modules, and the
    number of those modules. One computation for all (every gate has the same β, l, r): per module, a training
    step's small ops cost more than the gates themselves."""
    gates = [m.gate for _, _, m in gated_heads(model)]
    if not gates:
        raise ValueError("the model has no head gates (--head-gates)")
    log_alpha = torch.cat([gate.log_alpha for gate in gates])
    return gates[0].p_open(log_alpha), gates[0].deterministic(log_alpha.detach()), len(gates)


def gate_penalty(model, normalize: str = "sum", open_probabilities=None) -> Tensor:
    """Expected number of open gates, Σ P(gate ≠ 0): over every gated head ("sum", the paper's L_C), or the mean
    over gated layers of each layer's sum ("layer_mean", the reference code's). open_probabilities:
    gate_open_probabilities(), when the caller has it already."""
    p_open, _, layers = open_probabilities or gate_open_probabilities(model)
    if normalize == "sum":
        return p_open.sum()
    if normalize == "layer_mean":
        return p_open.sum() / layers
    raise ValueError(f"unknown L0 normalisation '{normalize}'; use sum or layer_mean")


def budget_multiplier(model, settings: GatesConfig, kept_heads, advance: bool):
    """λ of the head-budget mode for this batch; `advance` (training batches) records the heads kept at the
    start. The schedule runs on the updates taken (the model's budget_state[0], set from fairseq's update
    count): the same λ for every batch of an update, and the same update count on any number of workers."""
    updates, start = model.budget_state
    start = torch.where(updates == 0, kept_heads, start)
    warmup = max(settings.l0_budget_warmup, 1)
    above = (start - settings.l0_budget) * (settings.l0_budget_warmup - updates).clamp(min=0)
    target = settings.l0_budget + (above + warmup - 1) // warmup  # ceil: whole heads
    if advance:
        model.budget_state[1] = start
    return settings.l0_budget_gain * (kept_heads - target).float()


register_mechanism(HardConcreteGates())
