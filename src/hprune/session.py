"""An opened model: a checkpoint with its data, task, criterion and device, its masks and its batches.

Every verb that works on a model starts with `Session.open(cfg)` (the checkpoint reference resolved once by
checkpoint_ref.resolve, the data kind resolved once and the data prepared, the model loaded safely) and then
asks the session for the model, its masks (a mask held for a while, the previous one put back), its batches and
sentences, a physically pruned copy, and another checkpoint on the same data (reopen); `prepared` is the data set
beside it (raw text, test sets, subword files). What is done with it lives where it belongs: measuring it
(translate, score, losses, costs) in evaluation.py, fine-tuning and training flags in methods/training.py, its
latency in deploy/latency.py, the provenance keys of metrics.json in rundir.py, and the library's verbs in
api.py. The session reads only the opening settings of a verb's config (ckpt, data, paths, device, precision,
tensorboard); fairseq's objects are reached through the backend.
"""
from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Iterator, Optional

import torch
from omegaconf import DictConfig

from . import backend
from .checkpoint_ref import CheckpointRef, resolve
from .data.kinds import DataKind, get_kind
from .data.prepare import PreparedData, model_languages, prefixes, prepare
from .pruning.heads import Mask, ffn_layout, kept_ids, layout, mask_without, read_mask

log = logging.getLogger(__name__)


class Session:
    def __init__(self, data: DictConfig, loaded: backend.Loaded, data_bin: Path, precision: str = "fp32",
                 tensorboard: bool = False, criterion=None, kind: Optional[DataKind] = None):
        self.data, self.loaded, self.data_bin = data, loaded, data_bin
        self.loaded.target_prefix = prefixes(data)[1]
        self.precision, self.tensorboard = precision, tensorboard
        self.kind = kind or get_kind(data)
        self.prepared = PreparedData(data, data_bin, self.kind)  # its raw text, test sets and subword files
        self._criterion = criterion
        self._mask: Optional[Mask] = None
        self._parked_params: Optional[int] = None  # the parameter count while the weights are parked

    @classmethod
    def open(cls, cfg: DictConfig, ckpt: str | Path | CheckpointRef | None = None) -> "Session":
        """cfg: a verb's config (ckpt, data, paths, device, precision; generation, where it translates, is checked
        here, before any work rather than at the first translation). ckpt: another reference than cfg.ckpt, or
        one resolved already (checkpoint_ref.resolve)."""
        if cfg.get("generation") is not None:
            backend.check_generation(cfg.generation)
        ref = ckpt if isinstance(ckpt, CheckpointRef) else resolve(
            cfg.ckpt if ckpt is None else ckpt, cfg.paths.models_root, cfg.paths.data_root)
        checkpoint = backend.read_checkpoint(ref.checkpoint)
        kind = get_kind(cfg.data)
        if not all(checkpoint.languages):
            checkpoint.set_languages(*model_languages(cfg.data, checkpoint, kind))
        data = kind.bound(cfg.data, checkpoint.path, checkpoint.languages)  # a model's own data: from its folder
        data_bin = prepare(data, cfg.paths.data_root, kind)
        loaded = backend.load_model(checkpoint, data_bin, cfg.device, cfg.precision)
        if cfg.get("generation") is not None and cfg.get("split") and cfg.get("loss_split"):
            backend.check_positions(loaded, cfg.split)  # the split BLEU is on: refused before any work
        session = cls(data, loaded, data_bin, cfg.precision, bool(cfg.get("tensorboard", False)), kind=kind)
        log.info("model %s (%s parameters) on %s, %s; data %s", session.checkpoint, f"{session.n_params():,}",
                 session.device, cfg.precision, data.name)
        return session

    def reopen(self, ckpt: Path) -> "Session":
        """Another checkpoint (exported, retrained, gated) on this session's data and device, measured with this
        session's criterion (what a gated checkpoint adds to its loss goes when its gates are folded)."""
        languages = (self.loaded.cfg.task.source_lang, self.loaded.cfg.task.target_lang)
        return Session(self.data, backend.load_model(ckpt, self.data_bin, self.device, self.precision, languages),
                       self.data_bin, self.precision, self.tensorboard, self.criterion, self.kind)

    # ---------------------------------------------------------------------------------------- the model
    @property
    def model(self) -> torch.nn.Module:
        return self.loaded.model

    @property
    def checkpoint(self) -> Path:
        return self.loaded.path

    @property
    def device(self) -> str:
        return self.loaded.device

    @property
    def prefixes(self) -> tuple[Optional[str], Optional[str]]:
        """The tokens a multilingual model's sources and targets start with (their languages'), or None."""
        return prefixes(self.data)

    @property
    def language_marks(self) -> frozenset:
        """The language tokens of a multilingual model's sentences, which are no word."""
        return frozenset(token for token in self.prefixes if token)

    @property
    def pad(self) -> int:
        return self.loaded.task.target_dictionary.pad()

    @property
    def eos(self) -> int:
        return self.loaded.task.target_dictionary.eos()

    @property
    def dictionaries(self) -> tuple:
        """The model's (source, target) fairseq dictionaries."""
        return self.loaded.task.source_dictionary, self.loaded.task.target_dictionary

    def source_count(self, token: int) -> int:
        """How often a source token occurred in the data its dictionary was built from."""
        return self.loaded.task.source_dictionary.count[token]

    @property
    def max_target_positions(self) -> int:
        return self.model.max_decoder_positions()

    @property
    def model_config(self) -> DictConfig:
        """The model's settings as its checkpoint records them (architecture, sizes, an MoA model's experts)."""
        return backend.model_config(self.loaded)

    @property
    def imported_from(self) -> Optional[str]:
        """The architecture a stock or imported checkpoint was converted from (None: an hprune model)."""
        return self.loaded.imported_from

    @property
    def criterion(self):
        """The training criterion recorded in the checkpoint (built at first use)."""
        if self._criterion is None:
            self._criterion = backend.build_criterion(self.loaded)
        return self._criterion

    def n_params(self) -> int:
        return self._parked_params or backend.count_parameters(self.model)

    def state(self) -> dict:
        """A CPU copy of the weights (restored with load_state)."""
        return {name: tensor.detach().cpu().clone() for name, tensor in self.model.state_dict().items()}

    def load_state(self, state: dict) -> None:
        self.model.load_state_dict(state)

    # ---------------------------------------------------------------------------------------- masks
    def read_mask(self, path: str | Path, key: str = "mask", soft: bool = False) -> Mask:
        return read_mask(path, layout(self.model), key, soft, optional=ffn_layout(self.model))

    def unpruned_mask(self) -> Mask:
        return mask_without(self.model, ())

    @property
    def mask(self) -> Optional[Mask]:
        """The mask the model runs under (None: every head present)."""
        return self._mask

    def set_mask(self, mask: Optional[Mask]) -> None:
        """The head mask the model runs under from now on (None: every head present)."""
        self.model.set_head_mask(mask)
        self._mask = mask

    @contextlib.contextmanager
    def masked(self, mask: Optional[Mask]):
        """Run under `mask` for a while; the previous mask is put back afterwards."""
        previous = self._mask
        self.set_mask(mask)
        try:
            yield
        finally:
            self.set_mask(previous)

    @contextlib.contextmanager
    def parked(self, folder: Path) -> Iterator[None]:
        """The model's weights out of memory for a while (fairseq-train building its own model, gradients and
        Adam's moments in this process: NLLB-1.3B's 5.5 GB less), written into `folder` and read back afterwards,
        the same values on the same device; the model must not run meanwhile (its parameter count still holds)."""
        self._parked_params = self.n_params()
        tensors = dict(self.model.named_parameters())
        tensors.update(self.model.named_buffers())
        path = folder / "parked-weights.pt"
        torch.save({name: t.detach().cpu() for name, t in tensors.items()}, path)
        for t in tensors.values():
            t.data = torch.empty(0, dtype=t.dtype, device=t.device)
        try:
            yield
        finally:
            saved = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            for name, t in tensors.items():
                t.data = saved[name].to(t.device, copy=True)
            del saved
            path.unlink()
            self._parked_params = None

    def fold_mechanisms(self, mask: Optional[Mask]) -> Optional[Mask]:
        """A checkpoint trained with a pruning mechanism (gates, a subset selector) as `hprune prune` reads it out:
        each gated head that `mask` keeps (default: the mechanism's own read-out) gets its deterministic value
        folded into the weights (its full output where that value is 0), every other gated head 0 (the plugin's
        model.fold_mechanisms). The mask of the heads kept is returned. A model without one: `mask` as given."""
        gated = [(attn_type, layer, h) for attn_type, layer, m in self.model.gated_modules() for h in m.head_ids]
        kept = self.model.fold_mechanisms(mask)
        if gated:
            log.info("gates folded into the weights: %d of %d gated heads kept",
                     sum(kept[attn_type][layer][h] for attn_type, layer, h in gated), len(gated))
        return kept

    # ---------------------------------------------------------------------------------------- data
    def batches(self, split: str, max_tokens: Optional[int], max_batches: Optional[int] = None,
                shuffle_seed: Optional[int] = None, max_sentences: Optional[int] = None) -> Iterator[dict]:
        return backend.batches(self.loaded, split, max_tokens, max_batches, shuffle_seed, max_sentences)

    def sampled_batches(self, split: str, sentences: int, batch_size: int, seed: int) -> list[dict]:
        return backend.sampled_batches(self.loaded, split, sentences, batch_size, seed)

    def sentence_pairs(self, split: str, limit: Optional[int] = None) -> list[tuple[list[str], list[str]]]:
        """The first `limit` (default: all) sentences of a split as (source, target) tokens, in sentence order."""
        return backend.split_symbols(self.loaded, split, limit)

    def source_tokens(self, split: str) -> list[list[str]]:
        """The source side of a split as the model's tokens (no eos), in sentence order."""
        return [source for source, _ in self.sentence_pairs(split)]

    # ---------------------------------------------------------------------------------------- changing
    def pruned_copy(self, mask: Mask) -> torch.nn.Module:
        """An fp32 CPU copy of the model with the heads `mask` drops physically removed."""
        return self.pruned_copy_keeping(kept_ids(mask))

    def pruned_copy_keeping(self, ids: dict) -> torch.nn.Module:
        """An fp32 CPU copy of the model with only the heads and neurons `ids` names ({type: [[ids] per layer]})."""
        return backend.pruned_model(self.loaded, ids)

    def write_pruned(self, mask: Mask, dest: Path, config_from: Optional[Path] = None,
                     reopen: bool = True) -> Optional["Session"]:
        """The checkpoint of the model with the heads `mask` drops physically removed, written to `dest` and
        reopened (reopen=False: not). config_from: see backend.export_pruned."""
        self.place_beside(Path(dest).parent)
        backend.export_pruned(self.loaded, kept_ids(mask), dest, config_from)
        return self.reopen(dest) if reopen else None

    def place_beside(self, folder: Path) -> None:
        """A model of its own vocabulary (data=pretrained) gets its folder's files beside a checkpoint written into
        `folder` (the kind's beside_checkpoint), so that verbs given that checkpoint need no data=."""
        if self.kind.beside_checkpoint is not None:
            self.kind.beside_checkpoint(self.data, Path(folder))
