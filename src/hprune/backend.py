"""The only module that talks to fairseq: binarize, train, load a checkpoint safely, translate.

Everything is done in-process through fairseq's own entry points (the pattern of fairseq's tests), so what
runs here is what `fairseq-preprocess`, `fairseq-train` and `fairseq-generate` run.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import gc
import json
import logging
import math
import os
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, Iterator, List, Optional, Sequence

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf

from .errors import UserError
from .pruning.heads import kept_ids, read_mask

try:
    import fairseq  # noqa: F401
except ImportError as err:  # raised inside a verb, so the user sees one line
    raise UserError(f"fairseq is not importable ({err}); run `make install` "
                    "(it installs fairseq-fixed==0.12.3.1 with --no-deps)") from None
from fairseq import options
from hydra.core.config_store import ConfigStore

import hprune_fairseq  # registers the model and the safe-loading allow-list
from hprune_fairseq.safe_load import CorruptCheckpointError, UnsafeCheckpointError, load_checkpoint

log = logging.getLogger(__name__)
# fairseq's iterators always ask for pinned memory; on a CPU-only machine torch warns at every batch iterator
warnings.filterwarnings("ignore", message="'pin_memory' argument is set as true but no accelerator")
PLUGIN_DIR = str(Path(hprune_fairseq.__file__).parent)  # for `--user-dir`
HPRUNE_ARCHS = ("hprune_transformer", "hprune_transformer_big", "hprune_moa", "hprune_moa_big")
MOA_ARCHS = ("hprune_moa", "hprune_moa_big")


# fairseq registers its config groups (lr_scheduler/fixed, ...) in Hydra's ConfigStore once, when imported. A
# joblib worker runs several sweep jobs, and before each Hydra puts back the launching process's ConfigStore,
# which never saw fairseq: the entries are merged back from this snapshot before fairseq composes a config.
_FAIRSEQ_CONFIG_STORE = copy.deepcopy(ConfigStore.instance().repo)


def _merge_missing(repo: dict, saved: dict) -> None:
    for key, value in saved.items():
        if key not in repo:
            repo[key] = copy.deepcopy(value)
        elif isinstance(value, dict) and isinstance(repo[key], dict):
            _merge_missing(repo[key], value)


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("device=cuda but no CUDA device is visible; use device=auto or device=cpu")
    if device not in ("cpu", "cuda"):
        raise UserError(f"device={device} is not one of auto, cpu, cuda")
    return device


def _check_precision(device: str, precision: str, training: bool) -> None:
    if precision not in ("fp32", "fp16", "bf16"):
        raise UserError(f"precision={precision} is not one of fp32, fp16, bf16")
    if device != "cuda" and (precision == "fp16" or (training and precision == "bf16")):
        # fairseq trains in bf16 only on CUDA (elsewhere it assumes a TPU); fp16 kernels need CUDA
        what = "training" if training and precision == "bf16" else "it"
        raise UserError(f"precision={precision} needs a CUDA device for {what}; use precision=fp32 on the CPU")


def _flags(options: DictConfig | dict, skip: Iterable[str] = ()) -> List[str]:
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


def _to_omegaconf(args) -> DictConfig:
    """fairseq's convert_namespace_to_omegaconf, run inside a Hydra app.

    fairseq composes its own config with Hydra's 1.1-era API, which refuses to run once an app has set
    version_base >= 1.2, and clears the global Hydra state; both are put back afterwards.
    """
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.singleton import Singleton
    from hydra.version import VersionBase
    from packaging.version import Version

    _merge_missing(ConfigStore.instance().repo, _FAIRSEQ_CONFIG_STORE)
    versions = VersionBase.instance()
    base, saved = versions.getbase(), Singleton._instances.get(GlobalHydra)
    versions.setbase(Version("1.1"))
    try:
        with warnings.catch_warnings():  # fairseq's own use of deprecated Hydra APIs is not the user's concern
            warnings.simplefilter("ignore", UserWarning)
            return convert_namespace_to_omegaconf(args)
    finally:
        versions.version_base = base
        if saved is not None:
            Singleton._instances[GlobalHydra] = saved


@contextlib.contextmanager
def _frozen_heap():
    """Hide every object allocated so far (fairseq's modules, the model) from the garbage collector while a
    hot loop runs. fairseq is imported late, inside the Hydra job, and its millions of young objects otherwise
    make full collections run, and rescan them, during beam search: 25-30% slower, measured. (No collection
    first: it costs 0.4 s a call, and garbage frozen here is collected after the unfreeze.)"""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


# --------------------------------------------------------------------------------------------- binarize
def binarize(text_dir: Path, dest_dir: Path, src: str, tgt: str, workers: int = 1, joined: bool = True,
             test_splits: Sequence[str] = ("test",)) -> None:
    """fairseq-preprocess of `text_dir/{train,valid,test...}.{src,tgt}`; a joined dictionary (for shared
    embeddings) unless joined=False. Several test sets become splits test, test1, test2 (fairseq's naming)."""
    from fairseq_cli import preprocess

    argv = ["--source-lang", src, "--target-lang", tgt, "--destdir", str(dest_dir),
            "--workers", str(workers), "--thresholdsrc", "0", "--thresholdtgt", "0",
            "--trainpref", str(text_dir / "train"), "--validpref", str(text_dir / "valid")]
    if joined:
        argv.append("--joined-dictionary")
    if test_splits:
        argv += ["--testpref", ",".join(str(text_dir / split) for split in test_splits)]
    args = options.get_preprocessing_parser().parse_args(argv)
    handlers = list(preprocess.logger.handlers)
    try:
        preprocess.main(args)
    finally:  # preprocess adds a log-file handler per call
        for handler in preprocess.logger.handlers[len(handlers):]:
            preprocess.logger.removeHandler(handler)
            handler.close()


# --------------------------------------------------------------------------------------------- train
def train_argv(cfg: DictConfig, data_dir: Path, save_dir: Path) -> List[str]:
    """The fairseq-train command line that a run config stands for."""
    device = resolve_device(cfg.device)
    check_model(cfg.model, cfg.optim)
    argv = [str(data_dir), "--task", "translation", "--source-lang", cfg.data.src_lang,
            "--target-lang", cfg.data.tgt_lang, "--user-dir", PLUGIN_DIR, "--arch", cfg.model.arch]
    argv += _flags(cfg.model, skip=("arch",)) + _flags(cfg.optim)
    if cfg.get("head_mask"):  # only the mask's alive heads exist in the model (e.g. the from-scratch control)
        mask = read_mask(cfg.head_mask, head_layout(cfg.model), key="head_mask")
        argv += ["--kept-heads", json.dumps(kept_ids(mask), separators=(",", ":"))]
    argv += ["--save-dir", str(save_dir), "--seed", str(cfg.seed), "--num-workers", "0",
             "--log-format", "simple", "--log-interval", str(cfg.log_interval),
             *(["--keep-last-epochs", str(cfg.average_last)] if cfg.get("average_last") else ["--no-epoch-checkpoints"]),
             "--save-interval-updates", str(cfg.save_interval_updates),
             "--keep-interval-updates", "1", "--keep-best-checkpoints", "0",
             # batches rebuilt each epoch from seed+epoch, as a resumed run rebuilds them: resuming is exact
             "--update-epoch-batch-itr", "True"]
    _check_precision(device, cfg.precision, training=True)
    argv += {"fp32": [], "fp16": ["--fp16"], "bf16": ["--bf16"]}[cfg.precision]
    if device == "cpu":
        argv.append("--cpu")
    return argv


def check_model(model_cfg: DictConfig, optim_cfg: DictConfig) -> None:
    """One clear line for model settings fairseq would reject with a traceback, or silently misuse."""
    for side in ("encoder", "decoder"):
        dim, heads = model_cfg.get(f"{side}_embed_dim"), model_cfg.get(f"{side}_attention_heads")
        if dim and heads and dim % heads:
            raise UserError(f"model.{side}_embed_dim={dim} is not divisible by model.{side}_attention_heads={heads} "
                            "(each head gets embed_dim / heads dimensions); change one of them")
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
    types = list(model_cfg.get("moa_types") or [])
    unknown = sorted(set(types) - {"enc-self", "dec-self", "dec-enc"})
    if unknown or not types:
        raise UserError(f"model.moa_types={types}: needs one or more of enc-self, dec-self, dec-enc"
                        + (f" ({', '.join(unknown)} unknown)" if unknown else "") + "; e.g. model.moa_types=[enc-self]")
    if optim_cfg.criterion != "hprune":
        raise UserError(f"optim.criterion={optim_cfg.criterion} would drop MoA's auxiliary losses; use "
                        "optim.criterion=hprune for MoA models")


def head_layout(model_cfg) -> Dict[str, List[int]]:
    """{type: [heads per layer]} of an unpruned model config (the head-mask layout; experts on MoA layers)."""
    moa_types = []
    if getattr(model_cfg, "arch", None) in MOA_ARCHS:
        if getattr(model_cfg, "moa_experts", None) is None:
            raise UserError("a MoA model config must set moa_experts (see configs/model/moa_tiny.yaml)")
        moa_types = getattr(model_cfg, "moa_types", None) or ["enc-self", "dec-self", "dec-enc"]
        if isinstance(moa_types, str):  # a checkpoint's fairseq config holds the flag's comma-separated form
            moa_types = moa_types.split(",")
    layout = {"enc-self": [model_cfg.encoder_attention_heads] * model_cfg.encoder_layers,
              "dec-self": [model_cfg.decoder_attention_heads] * model_cfg.decoder_layers,
              "dec-enc": [model_cfg.decoder_attention_heads] * model_cfg.decoder_layers}
    for kind in layout:
        if kind in moa_types:
            layout[kind] = [model_cfg.moa_experts] * len(layout[kind])
    return layout


def continue_training_argv(ckpt: Path, model_cfg, task_cfg, data_dir: Path, save_dir: Path, device: str,
                           precision: str, seed: int) -> List[str]:
    """fairseq-train flags that continue training the model of `ckpt` (its architecture flags as recorded in
    the checkpoint) with a fresh optimizer, schedule and data order; criterion and optimizer flags are the
    caller's. Once save_dir holds a checkpoint_last.pt, the flags resume from it instead."""
    import argparse

    from fairseq.models import ARCH_MODEL_REGISTRY

    device = resolve_device(device)
    _check_precision(device, precision, training=True)
    arch_parser = argparse.ArgumentParser(add_help=False)
    ARCH_MODEL_REGISTRY[model_cfg.arch].add_args(arch_parser)
    argv = [str(data_dir), "--task", "translation", "--source-lang", task_cfg.source_lang,
            "--target-lang", task_cfg.target_lang, "--user-dir", PLUGIN_DIR, "--arch", model_cfg.arch]
    for action in arch_parser._actions:
        value = getattr(model_cfg, action.dest, None)
        if not action.option_strings or value is None or value is False:
            continue
        argv += [action.option_strings[0]] if action.nargs == 0 else [action.option_strings[0], str(value)]
    argv += ["--save-dir", str(save_dir), "--seed", str(seed), "--num-workers", "0", "--log-format", "simple",
             "--no-epoch-checkpoints", "--keep-best-checkpoints", "0", "--update-epoch-batch-itr", "True"]
    if not (save_dir / "checkpoint_last.pt").exists():
        argv += ["--restore-file", str(ckpt), "--reset-optimizer", "--reset-lr-scheduler", "--reset-dataloader",
                 "--reset-meters"]
    argv += {"fp32": [], "fp16": ["--fp16"], "bf16": ["--bf16"]}[precision]
    return argv + (["--cpu"] if device == "cpu" else [])


def train(argv: Sequence[str], script: Optional[Path] = None) -> None:
    """Run fairseq-train in this process. It resumes from `checkpoint_last.pt` in the save dir if there is one.
    `script`: also write the equivalent command line there (fairseq-train.sh in a run dir)."""
    import shlex

    from fairseq import checkpoint_utils, distributed_utils
    from fairseq_cli import train as fairseq_train

    if script is not None:
        from .files import write_atomic
        write_atomic(script, shlex.join(["fairseq-train", *argv]) + "\n")

    args = options.parse_args_and_arch(options.get_training_parser(), input_args=list(argv))
    save_dir = Path(args.save_dir)
    _repair_resume_point(save_dir)
    # fairseq keeps the best validation loss on the function object: a second training in this process (the
    # from-scratch control after gated training) would otherwise never write its checkpoint_best.pt
    vars(checkpoint_utils.save_checkpoint).pop("best", None)
    cfg = _to_omegaconf(args)
    with _frozen_heap():
        distributed_utils.call_main(cfg, fairseq_train.main)


def _repair_resume_point(save_dir: Path) -> None:
    """Make sure a killed run resumes: drop half-written files and a truncated `checkpoint_last.pt`.

    fairseq writes each checkpoint to a temporary name and renames it, but then *copies* it to
    `checkpoint_last.pt`; a kill during that copy leaves a truncated file. We then fall back on the
    newest readable interval checkpoint, which is the same state.
    """
    for partial in save_dir.glob("*.tmp"):
        partial.unlink()
    last = save_dir / "checkpoint_last.pt"
    if not last.exists():
        return
    try:
        load_checkpoint(last)
        return
    except CorruptCheckpointError:
        log.warning("%s is truncated; resuming from the newest interval checkpoint instead", last)
    candidates = sorted(save_dir.glob("checkpoint_*_*.pt"), key=lambda p: p.stat().st_mtime, reverse=True)
    for candidate in candidates:
        try:
            load_checkpoint(candidate)
        except CorruptCheckpointError:
            continue
        shutil.copyfile(candidate, last.with_suffix(".pt.tmp"))
        os.replace(last.with_suffix(".pt.tmp"), last)
        return
    last.unlink()  # nothing readable: start over rather than crash


# --------------------------------------------------------------------------------------------- load
@dataclass
class Loaded:
    model: torch.nn.Module
    task: object
    cfg: DictConfig  # the checkpoint's fairseq config
    path: Path
    device: str


def load_model(ckpt: Path, data_dir: Path, device: str = "cpu", precision: str = "fp32") -> Loaded:
    """Load an hprune checkpoint for inference against the dictionaries in data_dir, refusing anything unsafe."""
    from fairseq import checkpoint_utils, tasks

    if not ckpt.is_file():
        raise UserError(f"checkpoint {ckpt} does not exist; pass ckpt=<run dir or .pt file> of a finished train run")
    try:
        state = load_checkpoint(ckpt)
    except (UnsafeCheckpointError, CorruptCheckpointError) as err:
        raise UserError(str(err)) from None
    if state.get("cfg") is not None:  # as fairseq's load_checkpoint_to_cpu does after torch.load
        state["cfg"] = OmegaConf.create(state["cfg"], flags={"allow_objects": True})
    cfg = checkpoint_utils._upgrade_state_dict(state)["cfg"]  # also turns a legacy `args` into a config
    arch = getattr(cfg.model, "_name", None) or getattr(cfg.model, "arch", None)  # a Namespace for legacy models
    if arch not in HPRUNE_ARCHS:
        raise UserError(f"{ckpt} holds a '{arch}' model, not an hprune model ({', '.join(HPRUNE_ARCHS)}); "
                        "train one with `hprune train`")
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
    vocab = state["model"]["encoder.embed_tokens.weight"].shape[0]
    if vocab != len(task.source_dictionary):
        raise UserError(f"{ckpt} was trained with a {vocab}-word vocabulary but {data_dir} has "
                        f"{len(task.source_dictionary)} words; evaluate it on the data it was trained on")
    model = task.build_model(cfg.model)
    try:
        model.load_state_dict(state["model"], strict=True, model_cfg=cfg.model)
    except RuntimeError as err:
        detail = str(err).splitlines()[1].strip() if len(str(err).splitlines()) > 1 else str(err)
        raise UserError(f"{ckpt} does not match its declared architecture ({detail}); "
                        "retrain it or pass the right checkpoint") from None
    device = resolve_device(device)
    _check_precision(device, precision, training=False)
    model.eval()
    if precision == "fp16":
        model.half()
    elif precision == "bf16":
        model.to(torch.bfloat16)
    model.to(device)
    return Loaded(model, task, cfg, ckpt, device)


# --------------------------------------------------------------------------------------------- generate
@dataclass
class Translations:
    hypotheses: List[str]  # by sentence id, post-processed as fairseq-generate's D- lines
    sentences: int
    tokens: int
    seconds: float  # spent in beam search only, as fairseq-generate's own timer


def generation_argv(gen: DictConfig, split: str, seed: int) -> List[str]:
    """The fairseq-generate flags for a `generation/` config (shared by `hprune eval` and the comparison tests).

    `--required-batch-size-multiple 1`: with fairseq-fixed 0.12.3.1's compiled batch_by_size, a final batch
    that is not a multiple of it is silently dropped (100 test sentences -> 96 translated at the default 8).
    `--num-workers 0`: batches are read in this process (from memory-mapped data, so nothing is lost), which
    also lets a sweep job run inside a joblib worker, where a data-loader process cannot start.
    """
    argv = ["--gen-subset", split, "--beam", str(gen.beam), "--lenpen", str(gen.lenpen),
            "--max-len-a", str(gen.max_len_a), "--max-len-b", str(gen.max_len_b), "--min-len", str(gen.min_len),
            "--seed", str(seed), "--required-batch-size-multiple", "1", "--num-workers", "0"]
    if gen.batch_size:
        argv += ["--batch-size", str(gen.batch_size)]
    if gen.max_tokens:
        argv += ["--max-tokens", str(gen.max_tokens)]
    return argv


@functools.lru_cache(maxsize=8)
def _generation_cfg(argv: tuple) -> DictConfig:
    """fairseq-generate's config for a command line; cached, as building it costs about a second and pruning
    runs translate dozens of times with the same settings."""
    return _to_omegaconf(options.parse_args_and_arch(options.get_generation_parser(), list(argv)))


def translate(loaded: Loaded, gen: DictConfig, split: str, seed: int,
              post_process: Optional[str] = None, tokenizer: Optional[str] = None) -> Translations:
    """Beam search over a split exactly as fairseq-generate does it (same batching, generator and post-processing)."""
    from fairseq import utils
    from fairseq.logging.meters import StopwatchMeter
    from fairseq_cli.generate import get_symbols_to_strip_from_output

    argv = [loaded.cfg.task.data, "--user-dir", PLUGIN_DIR, "--path", str(loaded.path)]
    argv += generation_argv(gen, split, seed)
    if post_process:
        argv += ["--post-process", post_process]
    if tokenizer:
        argv += ["--tokenizer", tokenizer]
    if tokenizer == "moses":  # Moses takes its languages from the task's -s/-t, which must then be given
        argv += ["--source-lang", loaded.task.cfg.source_lang, "--target-lang", loaded.task.cfg.target_lang]
    if loaded.device == "cpu":
        argv.append("--cpu")
    cfg = _generation_cfg(tuple(argv))
    task, model = loaded.task, loaded.model
    _load_split(loaded, split)
    dataset = task.dataset(split)
    model.prepare_for_inference_(cfg)
    itr = task.get_batch_iterator(
        dataset=dataset, max_tokens=cfg.dataset.max_tokens, max_sentences=cfg.dataset.batch_size,
        max_positions=utils.resolve_max_positions(task.max_positions(), model.max_positions()),
        ignore_invalid_inputs=cfg.dataset.skip_invalid_size_inputs_valid_test,
        required_batch_size_multiple=cfg.dataset.required_batch_size_multiple, seed=cfg.common.seed,
        num_workers=cfg.dataset.num_workers, data_buffer_size=cfg.dataset.data_buffer_size,
    ).next_epoch_itr(shuffle=False)
    generator = task.build_generator([model], cfg.generation)
    tokenizer_, bpe = task.build_tokenizer(cfg.tokenizer), task.build_bpe(cfg.bpe)

    def decode(text: str) -> str:
        text = bpe.decode(text) if bpe is not None else text
        return tokenizer_.decode(text) if tokenizer_ is not None else text

    timer = StopwatchMeter()
    hypotheses: dict[int, str] = {}
    with _frozen_heap():
        for sample in itr:
            sample = utils.move_to_cuda(sample) if loaded.device == "cuda" else sample
            if "net_input" not in sample:
                continue
            timer.start()
            hypos = task.inference_step(generator, [model], sample)
            timer.stop(sum(len(h[0]["tokens"]) for h in hypos))
            for i, sample_id in enumerate(sample["id"].tolist()):
                best = hypos[i][0]
                _, text, _ = utils.post_process_prediction(
                    hypo_tokens=best["tokens"].int().cpu(), src_str="", alignment=best["alignment"], align_dict=None,
                    tgt_dict=task.target_dictionary, remove_bpe=cfg.common_eval.post_process,
                    extra_symbols_to_ignore=get_symbols_to_strip_from_output(generator))
                hypotheses[sample_id] = decode(text)
    missing = len(dataset) - len(hypotheses)
    if missing:
        raise RuntimeError(f"{missing} of {len(dataset)} {split} sentences were not translated")
    return Translations([hypotheses[i] for i in range(len(dataset))], len(hypotheses), timer.n, timer.sum)


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def checkpoint_summary(ckpt: Path) -> dict:
    """Updates, epoch, best validation loss and parameter count recorded in a checkpoint."""
    state = load_checkpoint(ckpt)
    storages = {t.untyped_storage().data_ptr(): t.numel() for t in state["model"].values()}  # tied weights once
    extra = state.get("extra_state") or {}
    return {"num_updates": state["optimizer_history"][-1]["num_updates"],
            "epoch": (extra.get("train_iterator") or {}).get("epoch"),
            "best_valid_loss": extra.get("best"),
            "valid_loss": extra.get("val_loss"),
            "n_params": sum(storages.values())}


def train_speed() -> dict:
    """fairseq's whole-run meters (the root aggregator is never reset): target tokens/s and updates/s,
    validation and checkpointing pauses included."""
    from fairseq.logging import metrics

    values = metrics.get_smoothed_values("default")
    return {"train_tokens_per_s": round(float(values.get("wps", 0.0)), 1),
            "train_updates_per_s": round(float(values.get("ups", 0.0)), 3)}


# --------------------------------------------------------------------------------------------- batches, loss
def batches(loaded: Loaded, split: str, max_tokens: Optional[int], max_batches: Optional[int] = None,
            shuffle_seed: Optional[int] = None, max_sentences: Optional[int] = None) -> Iterator[dict]:
    """Teacher-forcing batches of a split, on the model's device, in a fixed order (or shuffled with a seed)."""
    from fairseq import utils

    task = loaded.task
    _load_split(loaded, split)
    itr = task.get_batch_iterator(
        dataset=task.dataset(split), max_tokens=max_tokens, max_sentences=max_sentences, required_batch_size_multiple=1,
        max_positions=utils.resolve_max_positions(task.max_positions(), loaded.model.max_positions()),
        ignore_invalid_inputs=True, seed=shuffle_seed or 1, num_workers=0,
    ).next_epoch_itr(shuffle=shuffle_seed is not None)
    for i, sample in enumerate(itr):
        if max_batches is not None and i >= max_batches:
            break
        if "net_input" in sample:
            yield utils.move_to_cuda(sample) if loaded.device == "cuda" else sample


def _load_split(loaded: Loaded, split: str) -> None:
    """Check a split exists and is not empty, and read its binarized data once per loaded model (pruning runs
    translate and score it dozens of times)."""
    if split in loaded.task.datasets:
        return
    src, tgt = loaded.cfg.task.source_lang, loaded.cfg.task.target_lang
    source_bin = Path(loaded.cfg.task.data) / f"{split}.{src}-{tgt}.{src}.bin"
    if not source_bin.exists():
        raise UserError(f"{source_bin} is missing; run `hprune data prepare` for this data set, or pick a split "
                        "it has (train, valid, test)")
    if source_bin.stat().st_size == 0:  # fairseq cannot even open an empty split
        raise UserError(f"the {split} split in {loaded.cfg.task.data} is empty; pick another split")
    loaded.task.load_dataset(split, task_cfg=loaded.cfg.task)


def build_criterion(loaded: Loaded):
    """The training criterion recorded in the checkpoint (label-smoothed cross-entropy for hprune models)."""
    return loaded.task.build_criterion(loaded.cfg.criterion)


@torch.no_grad()
def split_loss(loaded: Loaded, criterion, split: str, max_tokens: int) -> dict:
    """The criterion's loss and the NLL per target token on a split, in bits, as fairseq's validation reports."""
    loaded.model.eval()
    loss = nll = sample_size = ntokens = 0.0
    for sample in batches(loaded, split, max_tokens):
        value, size, logging = criterion(loaded.model, sample)
        loss, nll = loss + float(value), nll + float(logging["nll_loss"])
        sample_size, ntokens = sample_size + size, ntokens + logging["ntokens"]
    return {"loss": loss / sample_size / math.log(2), "nll_loss": nll / ntokens / math.log(2)}


def finetune(loaded: Loaded, criterion, updates: int, lr: float, max_tokens: int, seed: int) -> None:
    """A few Adam updates on the train split with the model's current head mask held fixed (masked heads get
    zero gradient, so they stay removed)."""
    model = loaded.model
    vars(model).pop("train", None)  # fairseq's make_generation_fast_ locks train(); it only dropped attn outputs
    model._is_generation_fast = False
    model.train()
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr, betas=(0.9, 0.98))
    done, epoch = 0, 0
    while done < updates:
        epoch += 1
        for sample in batches(loaded, "train", max_tokens, shuffle_seed=seed + epoch):
            loss, sample_size, _ = criterion(model, sample)
            optimizer.zero_grad(set_to_none=True)
            (loss / sample_size).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            done += 1
            if done == updates:
                break
    model.eval()


# --------------------------------------------------------------------------------------------- physical pruning
AVERAGED = "checkpoint_averaged.pt"


def average_checkpoints(save_dir: Path, last: int) -> Path:
    """Average the parameters of the last `last` epoch checkpoints (checkpoint<epoch>.pt) into
    checkpoint_averaged.pt, as fairseq's scripts/average_checkpoints.py --num-epoch-checkpoints does.
    Fewer epochs than asked for are averaged as they are (and said so)."""
    epochs = sorted((int(p.stem[len("checkpoint"):]), p) for p in save_dir.glob("checkpoint[0-9]*.pt")
                    if p.stem[len("checkpoint"):].isdigit())
    chosen = [p for _, p in epochs[-last:]]
    if not chosen:
        raise UserError(f"no epoch checkpoints in {save_dir} to average; train for at least one epoch")
    if len(chosen) < last:
        log.warning("averaging %d epoch checkpoints, not %d: training ran %d epochs", len(chosen), last, len(chosen))
    total: Dict[str, torch.Tensor] = {}
    for path in chosen:
        for name, tensor in load_checkpoint(path)["model"].items():
            value = tensor.double() if tensor.is_floating_point() else tensor
            total[name] = total[name] + value if name in total and tensor.is_floating_point() else value
    state = load_checkpoint(chosen[-1])
    state["model"] = {name: (value / len(chosen)).to(state["model"][name].dtype) if value.is_floating_point()
                      else value for name, value in total.items()}
    state["last_optimizer_state"] = None
    state.setdefault("extra_state", {})["averaged_checkpoints"] = [p.name for p in chosen]
    dest = save_dir / AVERAGED
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    torch.save(state, tmp)
    os.replace(tmp, dest)
    return dest


def export_pruned(loaded: Loaded, kept: dict, dest: Path, config_from: Optional[Path] = None) -> torch.nn.Module:
    """Write a checkpoint of loaded.model with only the `kept` heads ({type: [[head ids] per layer]}), in fp32.

    The kept ids go into the checkpoint's model config (`kept_heads`), from which the plugin rebuilds the
    pruned shapes before loading the weights; the optimizer state (shaped for the full model) is dropped.
    The other settings come from loaded.path's checkpoint, or from `config_from`'s (e.g. the ungated model a
    gated run started from). Returns the pruned model (on the CPU).
    """
    model = copy.deepcopy(loaded.model).float().cpu()
    model.set_head_mask(None)
    model.keep_heads(kept)
    state = load_checkpoint(config_from or loaded.path)
    state["model"] = model.state_dict()
    model_cfg = state["cfg"]["model"] if state.get("cfg") is not None else state["args"]
    setattr(model_cfg, "kept_heads", json.dumps(kept, separators=(",", ":")))
    state["last_optimizer_state"] = None
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    torch.save(state, tmp)
    os.replace(tmp, dest)
    return model
