"""The orders that rank heads from scores (the math is in pruning/scores.py and analysis/relevance.py):
Michel et al.'s gradient importance, Voita et al.'s LRP relevance, and the baselines they are compared with."""
from __future__ import annotations

import pandas as pd
from omegaconf import DictConfig

from ..analysis import relevance
from ..errors import UserError
from ..pruning import scores
from . import register_method
from .curve import CurveSettings


def _batches(session, cfg: DictConfig):
    imp = cfg.prune.importance
    return session.batches(imp.split, imp.max_tokens, imp.max_batches)


@register_method("michel", settings=CurveSettings)
def michel(session, cfg: DictConfig) -> pd.DataFrame:
    """Michel et al. 2019: E_t |∂L/∂ξ_h|, the loss's sensitivity to each head's gate, on importance.split."""
    table, _ = scores.michel(session.model, session.criterion, _batches(session, cfg), session.pad)
    return scores.normalize_by_layer(table) if cfg.prune.importance.normalize_by_layer else table


@register_method("lrp", settings=CurveSettings)
def lrp(session, cfg: DictConfig) -> pd.DataFrame:
    """Voita et al. 2019 §4: a head's share of the top-1 logits' relevance (layer-wise relevance propagation), on
    importance.split."""
    try:
        table, _ = relevance.head_relevance(session.model, _batches(session, cfg), session.pad)
    except relevance.UnsupportedModel as err:
        raise UserError(f"--method lrp: {err}") from None
    return scores.normalize_by_layer(table) if cfg.prune.importance.normalize_by_layer else table


@register_method("confidence", settings=CurveSettings, needs_head_maps=True)
def confidence(session, cfg: DictConfig) -> pd.DataFrame:
    """Voita et al. 2019: a head's mean maximum attention weight (EOS excluded), on importance.split."""
    return scores.confidence(session.model, _batches(session, cfg), session.pad, session.eos)


@register_method("magnitude", settings=CurveSettings)
def magnitude(session, cfg: DictConfig) -> pd.DataFrame:
    """Σ|W| + Σ|b| of each head's q/k/v rows (fairseq's L1 head criterion)."""
    return scores.magnitude(session.model)


@register_method("random", settings=CurveSettings)
def random(session, cfg: DictConfig) -> pd.DataFrame:
    """Uniform scores from a generator seeded with `seed`: the control every order must beat."""
    return scores.random(session.model, cfg.seed)
