"""Opening a checkpoint safely against a data-bin's dictionaries (hprune's own, or any fairseq translation
Transformer, run as hprune's architecture), and writing a physically pruned copy."""
from __future__ import annotations

import contextlib
import copy
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from hprune_fairseq.mechanisms import MECHANISMS
from hprune_fairseq.safe_load import CorruptCheckpointError, UnsafeCheckpointError, load_checkpoint

from ..attention_types import FFN_TYPES
from ..errors import UserError
from .compat import HPRUNE_ARCHS, check_precision, freed_blocks_returned, resolve_device, upgrade_checkpoint
from .training import save_checkpoint_atomic

log = logging.getLogger(__name__)

# fairseq's translation Transformer family: the same parameters and state-dict keys as hprune_transformer, which
# runs them (dimensions as the checkpoint records them, wherever they differ from the arch's defaults)
FAIRSEQ_TRANSFORMERS = ("transformer", "transformer_tiny", "transformer_iwslt_de_en", "transformer_wmt_en_de",
                        "transformer_vaswani_wmt_en_de_big", "transformer_vaswani_wmt_en_fr_big",
                        "transformer_wmt_en_de_big", "transformer_wmt_en_de_big_t2t")
TRANSLATION_TASKS = ("translation",)
# criteria whose loss is the label-smoothed (or plain) cross-entropy that the `hprune` criterion computes
KNOWN_CRITERIA = ("cross_entropy", "label_smoothed_cross_entropy", "hprune", "hprune_distill")


def model_arch(model_cfg) -> Optional[str]:
    return getattr(model_cfg, "_name", None) or getattr(model_cfg, "arch", None)  # a Namespace for legacy models


def as_hprune_model(model_cfg, ckpt: Path) -> Optional[str]:
    """Make a checkpoint's model config an hprune one, in place: a fairseq Transformer becomes an
    hprune_transformer with the same recorded dimensions, and `imported_from` keeps its own arch. Returns the
    arch it came from (None for hprune's own); anything else is refused in one line."""
    arch = model_arch(model_cfg)
    if arch in HPRUNE_ARCHS:
        return getattr(model_cfg, "imported_from", None)
    if arch not in FAIRSEQ_TRANSFORMERS:
        raise UserError(f"{ckpt} holds a '{arch}' model, which hprune cannot run: it takes fairseq translation "
                        f"Transformers ({', '.join(FAIRSEQ_TRANSFORMERS)}) and its own models ({', '.join(HPRUNE_ARCHS)})")
    with open_dict(model_cfg) if isinstance(model_cfg, DictConfig) else contextlib.nullcontext():
        if hasattr(model_cfg, "_name"):  # fairseq >= 0.10 records both names
            model_cfg._name = "hprune_transformer"
        model_cfg.arch, model_cfg.imported_from = "hprune_transformer", arch
    return arch


@dataclass
class Loaded:
    model: torch.nn.Module
    task: object
    cfg: DictConfig  # the checkpoint's fairseq config
    path: Path
    device: str
    imported_from: Optional[str] = None  # the fairseq arch of a stock checkpoint, run as hprune_transformer
    # a multilingual model's target language token: every translation starts with it (the decoder is made to emit
    # it first, as transformers' forced_bos_token_id); the binarized targets start with it too
    target_prefix: Optional[str] = None

    def prefix_ids(self) -> list[int]:
        return [self.task.target_dictionary.index(self.target_prefix)] if self.target_prefix else []


@dataclass
class Checkpoint:
    """A checkpoint read safely and upgraded, before any model is built: its weights, its fairseq config (the
    model config already an hprune one) and the arch it was imported from."""
    path: Path
    state: dict
    cfg: DictConfig
    imported_from: Optional[str] = None

    @property
    def languages(self) -> tuple[Optional[str], Optional[str]]:
        return self.cfg.task.get("source_lang"), self.cfg.task.get("target_lang")

    @property
    def trained_on(self) -> Optional[Path]:
        """The data-bin the checkpoint was trained on, as recorded (it may not exist on this machine)."""
        return Path(self.cfg.task.data) if self.cfg.task.get("data") else None

    @property
    def vocabulary_sizes(self) -> tuple[Optional[int], Optional[int]]:
        """Rows of the source and target embeddings."""
        weights = self.state["model"]
        return tuple(weights[key].shape[0] if key in weights else None
                     for key in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight"))

    def set_languages(self, source: str, target: str) -> None:
        """Fill in languages the checkpoint does not record (fairseq-train without -s/-t); recorded ones stay."""
        with open_dict(self.cfg.task):
            self.cfg.task.source_lang = self.cfg.task.get("source_lang") or source
            self.cfg.task.target_lang = self.cfg.task.get("target_lang") or target


def read_checkpoint(ckpt: Path) -> Checkpoint:
    """Open a checkpoint file with the weights-only unpickler, upgrade it as fairseq would, and make its model
    config an hprune one (a stock fairseq Transformer is imported; anything else is refused in one line)."""
    if not ckpt.is_file():
        raise UserError(f"checkpoint {ckpt} does not exist; pass ckpt=<run dir or .pt file> of a finished train run")
    try:
        state = load_checkpoint(ckpt)
    except (UnsafeCheckpointError, CorruptCheckpointError) as err:
        raise UserError(str(err)) from None
    if state.get("cfg") is not None:  # as fairseq's load_checkpoint_to_cpu does after torch.load
        state["cfg"] = OmegaConf.create(state["cfg"], flags={"allow_objects": True})
    cfg = upgrade_checkpoint(state)  # also turns a legacy `args` into a config
    imported_from = as_hprune_model(cfg.model, ckpt)
    task = cfg.task.get("_name") if cfg.get("task") is not None else None
    if task not in TRANSLATION_TASKS:
        raise UserError(f"{ckpt} was trained for fairseq's '{task}' task, not translation; hprune takes models of the "
                        f"'translation' task ({', '.join(FAIRSEQ_TRANSFORMERS)} and its own)")
    return Checkpoint(ckpt, state, cfg, imported_from)


def _check_vocabulary(checkpoint: Checkpoint, task, data_dir: Path) -> None:
    """The embeddings' rows must be the dictionaries' sizes, on both sides."""
    weights, (src, tgt) = checkpoint.state["model"], checkpoint.languages
    sides = [("encoder.embed_tokens.weight", src, task.source_dictionary),
             ("decoder.embed_tokens.weight", tgt, task.target_dictionary)]
    for key, lang, dictionary in sides:
        if key in weights and weights[key].shape[0] != len(dictionary):
            raise UserError(f"{checkpoint.path} embeds {weights[key].shape[0]} {lang} words but {data_dir}/dict.{lang}.txt "
                            f"has {len(dictionary)}: the dictionaries are not this model's; use the data it was trained "
                            "on, or for a published model the dict.*.txt files that came with it (data=pretrained)")


def load_model(ckpt: Path | Checkpoint, data_dir: Path, device: str = "cpu", precision: str = "fp32",
               languages: tuple[Optional[str], Optional[str]] = (None, None)) -> Loaded:
    """Load a checkpoint (hprune's, or a fairseq Transformer's as an hprune_transformer; a path, or one already
    read) for inference against the dictionaries in data_dir, refusing anything unsafe. `languages`: those of a
    checkpoint that records none (the model's, when another checkpoint of it is reopened)."""
    from fairseq import tasks

    checkpoint = ckpt if isinstance(ckpt, Checkpoint) else read_checkpoint(ckpt)
    if not all(checkpoint.languages):
        if not all(languages):
            raise UserError(f"{checkpoint.path} records no languages (fairseq-train without -s/-t); pass "
                            "data.src_lang=.. data.tgt_lang=..")
        checkpoint.set_languages(*languages)
    state, cfg, ckpt = checkpoint.state, checkpoint.cfg, checkpoint.path
    if not (data_dir / f"dict.{cfg.task.source_lang}.txt").exists():
        raise UserError(f"{data_dir} has no dict.{cfg.task.source_lang}.txt: the checkpoint was trained on "
                        f"{cfg.task.source_lang}-{cfg.task.target_lang} data; pass the matching data=...")
    trained_dict = Path(cfg.task.data) / f"dict.{cfg.task.source_lang}.txt"
    eval_dict = data_dir / f"dict.{cfg.task.source_lang}.txt"
    if trained_dict.exists() and trained_dict.read_bytes() != eval_dict.read_bytes():
        raise UserError(f"{ckpt} was trained on {trained_dict.parent}, whose vocabulary differs from {data_dir}'s; "
                        "evaluate it with the data settings it was trained with")
    cfg.task.data = str(data_dir)
    task = tasks.setup_task(cfg.task)
    _check_vocabulary(checkpoint, task, data_dir)
    freed_blocks_returned(max(getattr(cfg.model, "encoder_embed_dim", 0) or 0, getattr(cfg.model, "decoder_embed_dim", 0) or 0))
    model = task.build_model(cfg.model)
    try:
        model.load_state_dict(state["model"], strict=True, model_cfg=cfg.model)
    except RuntimeError as err:
        detail = str(err).splitlines()[1].strip() if len(str(err).splitlines()) > 1 else str(err)
        raise UserError(f"{ckpt} does not match its declared architecture ({detail}); "
                        "retrain it or pass the right checkpoint") from None
    device = resolve_device(device)
    check_precision(device, precision, training=False)
    model.eval()
    if precision == "fp16":
        model.half()
    elif precision == "bf16":
        model.to(torch.bfloat16)
    model.to(device)
    return Loaded(model, task, cfg, ckpt, device, checkpoint.imported_from)


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def build_criterion(loaded: Loaded):
    """The checkpoint's training loss as the `hprune` criterion, which every measurement and training step of
    hprune reads (its loss, `nll_loss` and sample size): label-smoothed cross-entropy with the smoothing the
    checkpoint records. fairseq's default `cross_entropy` records none, and smoothing 0 is exactly that loss;
    what the model carries adds its own terms (MoA's auxiliary losses, a pruning mechanism's penalty)."""
    recorded = loaded.cfg.get("criterion")
    name = recorded.get("_name") if recorded is not None else None
    if name not in KNOWN_CRITERIA:
        log.info("criterion %s: measured with its translation loss (cross-entropy, label smoothing %s)", name,
                 recorded.get("label_smoothing", 0.0) if recorded is not None else 0.0)
    settings = {"_name": "hprune", "label_smoothing": 0.0, "sentence_avg": False}
    for key in ("label_smoothing", "sentence_avg", "ignore_prefix_size", "report_accuracy"):
        if recorded is not None and recorded.get(key) is not None:
            settings[key] = recorded[key]
    return loaded.task.build_criterion(OmegaConf.create(settings))


def model_config(loaded: Loaded) -> DictConfig:
    """The model settings the opened checkpoint records (fairseq's model config: architecture, activation, MoA)."""
    return loaded.cfg.model


def pruned_model(loaded: Loaded, kept: dict) -> torch.nn.Module:
    """An fp32 CPU copy of loaded.model with only the `kept` heads ({type: [[head ids] per layer]}), and the
    `kept` neurons in the FFN types it names."""
    model = copy.deepcopy(loaded.model).float().cpu()
    model.set_head_mask(None)
    model.keep_heads(kept)
    model.keep_neurons(kept)
    model.eval()  # (not `return model.eval()`: after a beam search fairseq's replacement train() returns None)
    return model


def export_pruned(loaded: Loaded, kept: dict, dest: Path, config_from: Optional[Path] = None) -> torch.nn.Module:
    """Write a checkpoint of loaded.model with only the `kept` heads ({type: [[head ids] per layer]}) and neurons
    (under FFN types), in fp32.

    The kept ids go into the checkpoint's model config (`kept_heads`, `kept_neurons`), from which the plugin rebuilds the
    pruned shapes before loading the weights; the optimizer state (shaped for the full model) is dropped.
    The other settings come from loaded.path's checkpoint, or from `config_from`'s (e.g. the ungated model a
    gated run started from). Returns the pruned model (on the CPU).
    """
    model = pruned_model(loaded, kept)
    state = load_checkpoint(config_from or loaded.path)
    state["model"] = model.state_dict()
    model_cfg = state["cfg"]["model"] if state.get("cfg") is not None else state["args"]
    as_hprune_model(model_cfg, config_from or loaded.path)  # a stock Transformer's export is an hprune model
    for mechanism in MECHANISMS.values():  # a gated checkpoint's export has them folded in: its config installs none
        switch = mechanism.flags()[0]
        if getattr(model_cfg, switch, None) not in (None, False):
            setattr(model_cfg, switch, None)
    # the languages recorded even where the original was trained without -s/-t: the export says what it translates
    task_cfg = state["cfg"]["task"] if state.get("cfg") is not None else state["args"]
    for key in ("source_lang", "target_lang"):
        if isinstance(task_cfg, dict):  # a saved config is a plain container, a legacy one a Namespace
            task_cfg[key] = loaded.cfg.task[key]
        else:
            setattr(task_cfg, key, loaded.cfg.task[key])
    heads = {attn_type: rows for attn_type, rows in kept.items() if attn_type not in FFN_TYPES}
    setattr(model_cfg, "kept_heads", json.dumps(heads, separators=(",", ":")))
    every = all(block.fc2.in_features == block.fc2.total_neurons for _, _, block in model.ffn_layers())
    # (from the pruned model: a checkpoint pruned before keeps the neurons it lost)
    setattr(model_cfg, "kept_neurons", None if every else json.dumps(model.neuron_ids(), separators=(",", ":")))
    state["last_optimizer_state"] = None
    save_checkpoint_atomic(state, dest)
    return model
