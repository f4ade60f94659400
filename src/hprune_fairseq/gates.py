"""Hard Concrete head gates (Louizos et al. 2018) as Voita et al. 2019 used them: one scalar gate per head.

With l < 0 < 1 < r the stretch limits, β the temperature and u ~ U(0, 1):
  training  s = sigmoid((log u - log(1 - u) + log α) / β),  g = clip(s (r - l) + l, 0, 1)   (one u per head)
  test      g = clip(sigmoid(log α) (r - l) + l, 0, 1)                                   (deterministic)
  P(g ≠ 0) = sigmoid(log α - β log(-l / r)),   P(g = 1) = sigmoid(log α - β log((1 - l) / (r - 1)))
Defaults are those of the-story-of-heads `ConcreteGate`: β = 0.33, (l, r) = (-0.1, 1.1), log α initialised
Glorot-uniform for their [1, H, 1, 1] shape, i.e. U(-sqrt(3/H), sqrt(3/H)).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor, nn

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


class Gated:
    """Gates on the units of an attention module (the heads of HeadAttention, the experts of MoAAttention): `gate`
    is None, a HardConcreteGate with one gate per unit present (`num_heads` of them; its log α is
    `<module>.gate.log_alpha`), or a SubsetGate, the module's slice of the model's DSP mask (subset.py). Either
    is called for this step's values and has `deterministic()`."""

    def add_gate(self, init: Optional[float] = None) -> None:
        device = next(self.parameters()).device
        self.gate = HardConcreteGate(self.num_heads, init=init).to(device).train(self.training)

    def upgrade_state_dict_named(self, state_dict, name):
        """A gated model loads an ungated checkpoint: the gates keep their initial values."""
        parent = getattr(super(), "upgrade_state_dict_named", None)
        if parent is not None:
            parent(state_dict, name)
        key = f"{name}.gate.log_alpha" if name else "gate.log_alpha"
        if isinstance(self.gate, HardConcreteGate) and key not in state_dict:
            state_dict[key] = self.gate.log_alpha.detach().clone()

    def keep_gates(self, local) -> None:
        """Physical pruning: keep the gates of the units at these positions (a DSP gate, a view of the model's
        selector, cannot be sliced: fold it first)."""
        if isinstance(self.gate, HardConcreteGate):
            self.gate.log_alpha = nn.Parameter(self.gate.log_alpha[local])
        elif self.gate is not None:
            raise ValueError("fold the subset-selection gates before removing heads")
