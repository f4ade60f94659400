"""Mechanisms a pruning procedure trains inside the model, each registered once and describing itself: its
model flags (a dataclass, fairseq's way), how it is installed on a model being built, the loss it adds to the
translation loss and the values it logs, how its state loads from a checkpoint without it, and how it leaves
the model once its deterministic values are folded into the weights.

A mechanism puts a `gate` on the attention modules it acts on: an object that, called, gives this step's value
per unit present (noisy in training) and whose `deterministic()` gives the test-time values. The model folds
any gate the same way (HeadUnits.fold_gate), so export, loading and CTranslate2 ask the model for its mechanisms
instead of naming them. hprune's: Hard Concrete gates (gates.py, Voita et al.) and subset selection (subset.py,
DSP), found on their own (MECHANISMS, hprune's registry.Registry, imports every module of this package once,
before any plugin's). A mechanism kept outside hprune registers itself when its module is imported: name the
module in HPRUNE_PLUGINS (os.pathsep-separated module names or .py paths; hprune sets it for the methods it
imports, so fairseq's workers import them too), and the models built with it record it (`--plugin-modules`)."""
from __future__ import annotations

import dataclasses
from typing import Dict, Iterator, List, Optional, Tuple

from torch import Tensor

from hprune.registry import Registry, module_summary


class Mechanism:
    """Subclass, set `name` and `config` (a FairseqDataclass of the model flags that install it; the first field
    is the one that turns it on; a checkpoint's config loses them all once the mechanism is folded), and register
    an instance with register_mechanism."""

    name: str = ""
    config: Optional[type] = None

    # ------------------------------------------------------------------------------------------- building
    def flags(self) -> Tuple[str, ...]:
        """The model-config keys of its flags (its config's fields, fairseq's private `_name` aside)."""
        return tuple(f.name for f in dataclasses.fields(self.config) if not f.name.startswith("_")) if self.config else ()

    def wanted(self, args) -> bool:
        """Whether the model config asks for this mechanism (its first flag is set)."""
        return bool(self.flags()) and getattr(args, self.flags()[0], None) not in (None, False)

    def install(self, model, args) -> None:
        raise NotImplementedError

    def present(self, model) -> bool:
        raise NotImplementedError


    # ------------------------------------------------------------------------------------------- training
    def loss(self, model, training: bool) -> Tuple[Optional[Tensor], Dict[str, Tensor]]:
        """What it adds to the per-token training objective (or None) and the values it logs for this batch."""
        return None, {}

    logged: Tuple[Tuple[str, int], ...] = ()  # (logged key, digits): means over the update's batches

    def set_num_updates(self, model, num_updates: int) -> None:
        """fairseq's update count, set before every training batch (schedules run on it)."""

    def upgrade_state_dict(self, model, state_dict: dict, prefix: str) -> None:
        """A model with the mechanism loads a checkpoint without it: fill in its initial state."""

    # ------------------------------------------------------------------------------------------- leaving
    def remove(self, model) -> None:
        """Drop what it added to the model besides the gates (buffers, selectors), once they are folded."""


MECHANISMS: Registry[Mechanism] = Registry("pruning mechanism", package=__name__)


def register_mechanism(mechanism: Mechanism) -> Mechanism:
    return MECHANISMS.add(mechanism.name, mechanism, module_summary(type(mechanism)))


def present(model) -> List[Mechanism]:
    """The registered mechanisms installed on `model`."""
    return [m for m in MECHANISMS.values() if m.present(model)]


def gated_modules(model) -> Iterator[tuple]:
    """(type, layer, module) of every attention module with a gate, whatever mechanism put it there."""
    return ((attn_type, layer, m) for attn_type, layer, m in model.attention_modules() if m.gate is not None)


MECHANISMS.scan()  # hprune's own register themselves first, so their flags and logged values keep their order
