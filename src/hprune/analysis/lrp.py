"""Layer-wise relevance propagation (LRP): the α-β rule of Voita et al.'s code (the-story-of-heads,
`lib/layers/lrp.py`), one function per kind of layer.

For a layer y = f(x) at the point x, with reference input x̂ = 0, the contribution of input i to output j is
    z_ji = f(0)_j / N + J_ji x_i          (J the Jacobian at x, N the number of inputs: the bias spread evenly)
and output j's relevance R_j is shared among the inputs by
    R_i = Σ_j R_j (α z⁺_ji / (Σ_i z⁺_ji + ε) + β z⁻_ji / (Σ_i z⁻_ji − ε)),      α = β = 0.5, ε = 1e-5.
Both fractions are >= 0, so relevance seeded positive stays positive. Each result is then rescaled so that
its total equals the output's, per sample and position (the reference's `LRP.rescale`): relevance is conserved
layer by layer by construction, up to ε where a row has no contribution at all.

Relevance tensors are (seeds, positions, features): every seed (one target position's top-1 logit) is its
own "sample", propagated at once through transitions computed once per sentence. Inputs are one sentence,
(positions, features), without padding.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

ALPHA, BETA, EPS = 0.5, 0.5, 1e-5


def transition(z: Tensor) -> Tensor:
    """Contributions z (..., out, in) -> the share of each output's relevance that each input receives."""
    positive, negative = z.clamp(min=0), z.clamp(max=0)
    return (ALPHA * positive / (positive.sum(-1, keepdim=True) + EPS)
            + BETA * negative / (negative.sum(-1, keepdim=True) - EPS))


def shared(relevance: Tensor, equations: Tuple[str, ...], *contributions: Tensor) -> list:
    """Σ_j R_j · transition(z)_ji for inputs split into parts (z: one tensor (outputs..., inputs of the part...)
    a part, the normalisers over all parts), computed as α Σ_j z⁺_ji R_j / (Σz⁺_j + ε) + β Σ_j z⁻_ji R_j / (Σz⁻_j − ε): the
    shares themselves are never formed (the contributions are the large tensors)."""
    outputs = relevance.dim() - 1  # z's leading dims are the outputs (relevance has the seeds in front)
    positives = [z.clamp(min=0) for z in contributions]
    negatives = [z - positive for z, positive in zip(contributions, positives)]
    up = relevance * (ALPHA / (sum(z.flatten(outputs).sum(-1) for z in positives) + EPS))
    down = relevance * (BETA / (sum(z.flatten(outputs).sum(-1) for z in negatives) - EPS))
    return [torch.einsum(eq, up, positive) + torch.einsum(eq, down, negative)
            for eq, positive, negative in zip(equations, positives, negatives)]


def conserve(reference: Tensor, *relevances: Tensor, dims: Tuple[int, ...] = (-1,)):
    """Scale relevances so that Σ|R| over `dims`, summed over all of them, equals the reference's."""
    target = reference.abs().sum(dims, keepdim=True)
    total = sum(r.abs().sum(dims, keepdim=True) for r in relevances) + EPS
    scaled = [r * (target / total) for r in relevances]
    return scaled[0] if len(scaled) == 1 else scaled


def linear(relevance: Tensor, x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """y = x Wᵀ + b, token by token: relevance (P, T, out), x (T, in), weight (out, in) or one per token
    (T, out, in) -> (P, T, in)."""
    z = weight * x.unsqueeze(-2) if weight.dim() == 3 else weight.unsqueeze(0) * x.unsqueeze(1)
    if bias is not None:
        z = z + (bias / x.size(-1)).view(1, -1, 1)
    return conserve(relevance, *shared(relevance, ("pto,toi->pti",), z))


def layer_norm(relevance: Tensor, x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float) -> Tensor:
    """y = (x - mean) / sqrt(var + eps) · w + b, token by token, through its exact Jacobian."""
    d = x.size(-1)
    centered = x - x.mean(-1, keepdim=True)
    std = (centered.pow(2).mean(-1, keepdim=True) + eps).sqrt()
    normed = centered / std
    eye = torch.eye(d, dtype=x.dtype, device=x.device)
    jacobian = (eye - 1.0 / d - normed.unsqueeze(-1) * normed.unsqueeze(-2) / d) / std.unsqueeze(-1)  # (T, j, i)
    if weight is not None:
        jacobian = jacobian * weight.view(1, -1, 1)
    z = jacobian * x.unsqueeze(-2)
    if bias is not None:
        z = z + (bias / d).view(1, -1, 1)
    return conserve(relevance, *shared(relevance, ("pto,toi->pti",), z))


def add(relevance: Tensor, a: Tensor, b: Tensor) -> Tuple[Tensor, Tensor]:
    """y = a + b, feature by feature (a residual connection): each output's relevance shared between the two."""
    z = torch.stack([a, b], dim=-1)  # (T, d, 2): one output, two inputs
    shares = transition(z)
    ra, rb = relevance * shares[..., 0], relevance * shares[..., 1]
    return conserve(relevance, ra, rb)


def attention(relevance: Tensor, q: Tensor, k: Tensor, v: Tensor, scaling: float, allowed: Optional[Tensor] = None
              ) -> Tuple[Tensor, Tensor, Tensor]:
    """Heads o = softmax(s q kᵀ) v, through their full Jacobian (queries and keys included, as the reference
    with consider_attn_constant off), all heads at once: relevance (P, H, n_q, D), q (H, n_q, D), k and v
    (H, n_kv, D) -> the relevance of q, k and v, conserved per seed and head. `allowed`: (n_q, n_kv) booleans,
    which keys a query sees (causal decoder self-attention)."""
    logits = scaling * q @ k.transpose(-1, -2)
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
    w = torch.softmax(logits, dim=-1)  # (h, t, s)
    o = w @ v  # (h, t, e)
    spread = w.unsqueeze(2) * (v.transpose(-1, -2).unsqueeze(1) - o.unsqueeze(-1))  # ∂o[t,e]/∂logit[t,s]: (h,t,e,s)
    z_q = scaling * (spread @ k.unsqueeze(1)) * q.unsqueeze(2)  # (h, t, e, c)
    z_k = scaling * spread.unsqueeze(-1) * (q.unsqueeze(2).unsqueeze(3) * k.unsqueeze(1).unsqueeze(1))  # (h,t,e,s,c)
    z_v = w.unsqueeze(2) * v.transpose(-1, -2).unsqueeze(1)  # (h, t, e, s): v[s, e'] reaches o[t, e] only for e' = e
    rq, rk, rv = shared(relevance, ("phte,htec->phtc", "phte,htesc->phsc", "phte,htes->phse"), z_q, z_k, z_v)
    return conserve(relevance, rq, rk, rv, dims=(-2, -1))
