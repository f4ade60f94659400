"""fairseq command lines from hprune configs: one fairseq-train builder (new runs and continued training),
the fairseq-generate flags, and the model checks that would otherwise end in a fairseq traceback."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Dict, Iterable, List, Optional

from omegaconf import DictConfig, ListConfig

from ..attention_types import ATTENTION_TYPES, check_attention_types
from ..errors import UserError
from ..pruning.heads import kept_ids, read_mask
from ..rundir import LAST
from .compat import MOA_ARCHS, PLUGIN_DIR, check_precision, resolve_device


def flags(options: DictConfig | dict, skip: Iterable[str] = ()) -> List[str]:
    """{encoder_embed_dim: 64, share_all_embeddings: true} -> ['--encoder-embed-dim', '64', '--share-all-embeddings']"""
    argv: List[str] = []
    for key, value in options.items():
        if key in skip or value is None or value is False:
            continue
        argv.append("--" + key.replace("_", "-"))
        if isinstance(value, (list, ListConfig)):  # e.g. moa_types: [enc-self, dec-enc] -> enc-self,dec-enc
            value = ",".join(map(str, value))
        if value is not True:
            argv.append(str(value))
    return argv


def fairseq_train_argv(data_dir: Path, source_lang: str, target_lang: str, arch: str, options: List[str],
                       save_dir: Path, seed: int, device: str, precision: str, checkpoints: List[str]) -> List[str]:
    """The one fairseq-train command line: data, plugin and architecture, the caller's model/optim `options`,
    and the shared tail (single-process loading, simple logs, exact resumption, precision, device).
    `checkpoints`: which checkpoints to keep or restore from."""
    device = resolve_device(device)
    check_precision(device, precision, training=True)
    return [str(data_dir), "--task", "translation", "--source-lang", source_lang, "--target-lang", target_lang,
            "--user-dir", PLUGIN_DIR, "--arch", arch, *options, *checkpoints,
            "--save-dir", str(save_dir), "--seed", str(seed), "--num-workers", "0", "--log-format", "simple",
            "--keep-best-checkpoints", "0",
            # batches rebuilt each epoch from seed+epoch, as a resumed run rebuilds them: resuming is exact
            "--update-epoch-batch-itr", "True",
            *{"fp32": [], "fp16": ["--fp16"], "bf16": ["--bf16"]}[precision], *(["--cpu"] if device == "cpu" else [])]


def tensorboard_flags(cfg: DictConfig, save_dir: Path) -> List[str]:
    """With tensorboard=true, fairseq's TensorBoard logs (train / valid scalars) beside the checkpoints folder:
    <run dir>/tensorboard/."""
    return ["--tensorboard-logdir", str(Path(save_dir).parent / "tensorboard")] if cfg.get("tensorboard") else []


def train_argv(cfg: DictConfig, data_dir: Path, save_dir: Path) -> List[str]:
    """The fairseq-train command line that a `hprune train` config stands for."""
    check_model(cfg.model, cfg.optim)
    options = flags(cfg.model, skip=("arch",)) + flags(cfg.optim) + tensorboard_flags(cfg, save_dir)
    if cfg.get("head_mask"):  # only the mask's alive heads exist in the model (e.g. the from-scratch control)
        mask = read_mask(cfg.head_mask, head_layout(cfg.model), key="head_mask")
        options += ["--kept-heads", json.dumps(kept_ids(mask), separators=(",", ":"))]
    keep = ["--keep-last-epochs", str(cfg.average_last)] if cfg.get("average_last") else ["--no-epoch-checkpoints"]
    checkpoints = ["--log-interval", str(cfg.log_interval), *keep,
                   "--save-interval-updates", str(cfg.save_interval_updates), "--keep-interval-updates", "1"]
    return fairseq_train_argv(data_dir, cfg.data.src_lang, cfg.data.tgt_lang, cfg.model.arch, options, save_dir,
                              cfg.seed, cfg.device, cfg.precision, checkpoints)


def continue_training_argv(loaded, data_dir: Path, save_dir: Path, device: str, precision: str, seed: int,
                           options: List[str]) -> List[str]:
    """fairseq-train flags that continue training a loaded model's checkpoint (its architecture flags as recorded
    in the checkpoint, then the caller's criterion and optimizer `options`) with a fresh optimizer, schedule and
    data order. Once save_dir holds a checkpoint_last.pt, the flags resume from it instead."""
    from fairseq.models import ARCH_MODEL_REGISTRY

    ckpt, model_cfg, task_cfg = loaded.path, loaded.cfg.model, loaded.cfg.task

    arch_parser = argparse.ArgumentParser(add_help=False)
    ARCH_MODEL_REGISTRY[model_cfg.arch].add_args(arch_parser)
    arch_options = []
    for action in arch_parser._actions:
        value = getattr(model_cfg, action.dest, None)
        if not action.option_strings or value is None or value is False:
            continue
        arch_options += [action.option_strings[0]] if action.nargs == 0 else [action.option_strings[0], str(value)]
    checkpoints = ["--no-epoch-checkpoints"]
    if not (save_dir / LAST).exists():
        checkpoints += ["--restore-file", str(ckpt), "--reset-optimizer", "--reset-lr-scheduler",
                        "--reset-dataloader", "--reset-meters"]
    return fairseq_train_argv(data_dir, task_cfg.source_lang, task_cfg.target_lang, model_cfg.arch,
                              arch_options + options, save_dir, seed, device, precision, checkpoints)


def criterion_flags(loaded, criterion: str) -> List[str]:
    """`criterion` with the label smoothing the loaded model's checkpoint was trained with."""
    recorded = loaded.cfg.criterion
    smoothing = recorded.get("label_smoothing", 0.0) if recorded is not None else 0.0
    return ["--criterion", criterion, "--label-smoothing", str(smoothing)]


def check_model(model_cfg: DictConfig, optim_cfg: DictConfig) -> None:
    """One clear line for model and schedule settings fairseq would reject with a traceback, or silently misuse."""
    for key in ("encoder_layers", "decoder_layers", "encoder_embed_dim", "decoder_embed_dim",
                "encoder_attention_heads", "decoder_attention_heads", "encoder_ffn_embed_dim", "decoder_ffn_embed_dim"):
        value = model_cfg.get(key)
        if value is not None and (not isinstance(value, int) or value < 1):
            raise UserError(f"model.{key}={value} must be a positive whole number; e.g. model.{key}=3")
    for side in ("encoder", "decoder"):
        dim, heads = model_cfg.get(f"{side}_embed_dim"), model_cfg.get(f"{side}_attention_heads")
        if dim and heads and dim % heads:
            raise UserError(f"model.{side}_embed_dim={dim} is not divisible by model.{side}_attention_heads={heads} "
                            "(each head gets embed_dim / heads dimensions); change one of them")
    check_schedule(optim_cfg)
    moa_keys = sorted(key for key in model_cfg if str(key).startswith("moa_") and model_cfg[key] is not None)
    if model_cfg.arch not in MOA_ARCHS:
        if moa_keys:
            raise UserError(f"model.{moa_keys[0]} is a MoA option but model.arch={model_cfg.arch} is not a MoA "
                            f"model; use model=moa_tiny (or arch {' / '.join(MOA_ARCHS)}), or drop the option")
        return
    experts, top_k, head_dim = (model_cfg.get(key) for key in ("moa_experts", "moa_top_k", "moa_head_dim"))
    if experts is not None and top_k is not None and not 1 <= top_k <= experts:
        raise UserError(f"model.moa_top_k={top_k} must be between 1 and model.moa_experts={experts} "
                        "(each token uses k of the E experts)")
    if head_dim is not None and head_dim < 1:
        raise UserError(f"model.moa_head_dim={head_dim} must be a positive number of dimensions")
    check_attention_types(list(model_cfg.get("moa_types") or []), "model.moa_types")
    if optim_cfg.criterion != "hprune":
        raise UserError(f"optim.criterion={optim_cfg.criterion} would drop MoA's auxiliary losses; use "
                        "optim.criterion=hprune for MoA models")


def check_schedule(optim_cfg: DictConfig, setting: str = "optim") -> None:
    """fairseq reads max_update=0 (and max_epoch=0) as "no limit": a run that was meant to be short would
    train forever, so a limit must be a positive number, or null for none."""
    for key, other in (("max_update", "max_epoch"), ("max_epoch", "max_update")):
        value = optim_cfg.get(key)
        if value is not None and (not isinstance(value, int) or value < 1):
            raise UserError(f"{setting}.{key}={value} is not a positive number of {key[4:]}s (fairseq would read 0 as "
                            f"'no limit' and train forever); give e.g. {setting}.{key}=100, or {setting}.{key}=null "
                            f"to leave the limit to {setting}.{other}")
    if optim_cfg.get("max_update") is None and optim_cfg.get("max_epoch") is None:
        raise UserError(f"{setting}.max_update and {setting}.max_epoch are both null, so training would never stop; "
                        f"set one, e.g. {setting}.max_update=1000")


def head_layout(model_cfg) -> Dict[str, List[int]]:
    """{type: [heads per layer]} of an unpruned model config (the head-mask layout; experts on MoA layers)."""
    moa_types: List[str] = []
    if getattr(model_cfg, "arch", None) in MOA_ARCHS:
        if getattr(model_cfg, "moa_experts", None) is None:
            raise UserError("a MoA model config must set moa_experts (see configs/model/moa_tiny.yaml)")
        moa_types = list(getattr(model_cfg, "moa_types", None) or ATTENTION_TYPES)
        if isinstance(getattr(model_cfg, "moa_types", None), str):  # a checkpoint's config: comma-separated
            moa_types = model_cfg.moa_types.split(",")
    layout = {"enc-self": [model_cfg.encoder_attention_heads] * model_cfg.encoder_layers,
              "dec-self": [model_cfg.decoder_attention_heads] * model_cfg.decoder_layers,
              "dec-enc": [model_cfg.decoder_attention_heads] * model_cfg.decoder_layers}
    for attn_type in layout:
        if attn_type in moa_types:
            layout[attn_type] = [model_cfg.moa_experts] * len(layout[attn_type])
    return layout


def generation_argv(gen: DictConfig, split: str, seed: int) -> List[str]:
    """The fairseq-generate flags for a `generation/` config (shared by `hprune eval` and the comparison tests).

    `--required-batch-size-multiple 1`: with fairseq-fixed 0.12.3.1's compiled batch_by_size, a final batch
    that is not a multiple of it is silently dropped (100 test sentences -> 96 translated at the default 8).
    `--num-workers 0`: batches are read in this process (from memory-mapped data, so nothing is lost), which
    also lets a sweep job run inside a joblib worker, where a data-loader process cannot start.
    """
    check_generation(gen)
    argv = ["--gen-subset", split, "--beam", str(gen.beam), "--lenpen", str(gen.lenpen),
            "--max-len-a", str(gen.max_len_a), "--max-len-b", str(gen.max_len_b), "--min-len", str(gen.min_len),
            "--seed", str(seed), "--required-batch-size-multiple", "1", "--num-workers", "0"]
    if gen.batch_size:
        argv += ["--batch-size", str(gen.batch_size)]
    if gen.max_tokens:
        argv += ["--max-tokens", str(gen.max_tokens)]
    return argv


def check_generation(gen: DictConfig) -> None:
    """Beam-search settings fairseq would answer with a traceback."""
    for key, least in (("beam", 1), ("batch_size", 1), ("max_tokens", 1), ("min_len", 0), ("max_len_b", 1)):
        value: Optional[int] = gen.get(key)
        if value is not None and (not isinstance(value, int) or value < least):
            raise UserError(f"generation.{key}={value} must be a whole number >= {least}; e.g. generation.{key}="
                            f"{dict(beam=5, batch_size=128, max_tokens=4096, min_len=1, max_len_b=10)[key]}")
    if gen.get("max_len_a") is not None and gen.max_len_a < 0:
        raise UserError(f"generation.max_len_a={gen.max_len_a} must be >= 0 (max length = a * source length + b)")
