"""`hprune train`: train an hprune_transformer with fairseq; resumable, checkpoints in the run dir."""
from __future__ import annotations

import time

from omegaconf import DictConfig, open_dict

from ..data.prepare import bin_dir, bind, prepare
from ..errors import UserError
from ..launch import is_rank_zero
from ..pruning.heads import read_mask
from ..rundir import BEST, LAST, RunDir, run_dir
from . import hydra_app


def heads_per_layer(cfg: DictConfig) -> dict:
    """{type: [heads per layer]} of the trained model: all of them, or those cfg.head_mask keeps."""
    from .. import backend

    layout = backend.head_layout(cfg.model)
    if not cfg.head_mask:
        return layout
    return {attn_type: [sum(row) for row in rows] for attn_type, rows in read_mask(cfg.head_mask, layout, "head_mask").items()}


def train(cfg: DictConfig) -> dict:
    from .. import backend  # imports fairseq, which fills Hydra's config store: only once composed

    if cfg.data.kind == "pretrained":
        raise UserError("data=pretrained holds a published model's test data, encoded with its codes, not training "
                        "data; train on data=toy, a WMT preset, or data=databin data.path=<your data-bin>")
    with open_dict(cfg):
        cfg.data = bind(cfg.data)  # a data-bin's languages, read from its files
    out = run_dir()
    save_dir = RunDir(out).checkpoints
    argv = backend.train_argv(cfg, bin_dir(cfg.data, cfg.paths.data_root), save_dir)  # checks the settings first
    prepare(cfg.data, cfg.paths.data_root)
    started = time.perf_counter()
    workers = backend.train(argv, script=out / "fairseq-train.sh", distributed=cfg.distributed)
    if not is_rank_zero():  # one worker of many: rank 0 writes the results
        return {}
    summary = backend.checkpoint_summary(RunDir(out).checkpoint(LAST))
    averaged = backend.average_checkpoints(save_dir, int(cfg.average_last)) if cfg.average_last else None
    metrics = {
        "arch": cfg.model.arch, **summary, **workers, "device": backend.resolve_device(cfg.device),
        "checkpoint": str(averaged or RunDir(out).checkpoint(BEST)),
        "seconds": round(time.perf_counter() - started, 1),
        "heads": heads_per_layer(cfg), "head_mask": cfg.head_mask,
    }
    print(f"trained {metrics['num_updates']} updates, best valid loss {metrics['best_valid_loss']:.3f}, "
          f"{metrics['n_params']:,} parameters -> {metrics['checkpoint']}")
    return metrics


main = hydra_app("train")(train)
