"""The head interface shared by dense attention (HeadAttention) and MoA attention's experts: units under one
mask schema, recorded per unit, physically removable, gated (units.py)."""
from .attention import HeadAttention
from .units import HeadUnits

__all__ = ["HeadAttention", "HeadUnits"]
