"""What the routers of a MoA model do, on teacher-forced batches of a split: per layer, the share of routed
(token, slot) pairs each expert receives, its spread (min, max, coefficient of variation; an even load has
CV 0 and every share 1/E) and the mean router entropy (nats; log E is a uniform router)."""
from __future__ import annotations

from typing import Iterable

import pandas as pd
import torch

from ..pruning.heads import moa_layers


@torch.no_grad()
def expert_load(model, batches: Iterable[dict]) -> pd.DataFrame:
    """Rows (type, layer, expert, share, entropy): entropy is the layer's mean router entropy."""
    layers = moa_layers(model)
    if not layers:
        return pd.DataFrame(columns=["type", "layer", "expert", "share", "entropy"])
    model.eval()
    for _, _, module in layers:
        module.record_routing, module.routing = True, None
    try:
        for sample in batches:
            model(**sample["net_input"])
        rows = []
        for attn_type, layer, module in layers:
            stats = module.routing
            slots = stats["slots"].cpu()
            shares = slots / slots.sum().clamp(min=1)
            entropy = float(stats["entropy"] / stats["tokens"].clamp(min=1))
            rows += [(attn_type, layer, expert, float(share), entropy) for expert, share in enumerate(shares)
                     if expert in module.head_ids]
    finally:
        for _, _, module in layers:
            module.record_routing, module.routing = False, None
    return pd.DataFrame(rows, columns=["type", "layer", "expert", "share", "entropy"])


def load_summary(load: pd.DataFrame) -> dict:
    """Columns for metrics.json: over all MoA layers, the smallest and largest expert share, the mean over layers
    of the share's coefficient of variation, and the mean router entropy."""
    if load.empty:
        return {}
    per_layer = load.groupby(["type", "layer"])
    cv = per_layer["share"].agg(lambda s: float(s.std(ddof=0) / s.mean()) if s.mean() > 0 else 0.0)
    return {"expert_share_min": round(float(load["share"].min()), 4),
            "expert_share_max": round(float(load["share"].max()), 4),
            "expert_load_cv": round(float(cv.mean()), 4),
            "router_entropy": round(float(per_layer["entropy"].first().mean()), 4)}
