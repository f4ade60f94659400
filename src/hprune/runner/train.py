"""`hprune train`: train an hprune_transformer with fairseq; resumable, checkpoints in the run dir."""
from __future__ import annotations

import shlex
import time

from omegaconf import DictConfig

from ..data.prepare import bin_dir, prepare
from ..files import git_sha, run_dir, write_atomic, write_json
from . import hydra_app


def run(cfg: DictConfig) -> dict:
    from .. import backend  # imports fairseq, which fills Hydra's config store: only once composed

    out = run_dir()
    save_dir = out / "checkpoints"
    argv = backend.train_argv(cfg, bin_dir(cfg.data, cfg.paths.data_root), save_dir)  # checks the settings first
    prepare(cfg.data, cfg.paths.data_root)
    write_atomic(out / "fairseq-train.sh", shlex.join(["fairseq-train", *argv]) + "\n")
    started = time.perf_counter()
    backend.train(argv)
    summary = backend.checkpoint_summary(save_dir / "checkpoint_last.pt")
    metrics = {
        "verb": "train", "data": cfg.data.name, "arch": cfg.model.arch, **summary, **backend.train_speed(),
        "device": backend.resolve_device(cfg.device), "precision": cfg.precision, "seed": cfg.seed,
        "git_sha": git_sha(), "checkpoint": str(save_dir / "checkpoint_best.pt"),
        "seconds": round(time.perf_counter() - started, 1),
        "heads": {"enc-self": [cfg.model.encoder_attention_heads] * cfg.model.encoder_layers,
                  "dec-self": [cfg.model.decoder_attention_heads] * cfg.model.decoder_layers,
                  "dec-enc": [cfg.model.decoder_attention_heads] * cfg.model.decoder_layers},
    }
    write_json(out / "metrics.json", metrics)
    print(f"trained {metrics['num_updates']} updates, best valid loss {metrics['best_valid_loss']:.3f}, "
          f"{metrics['n_params']:,} parameters -> {metrics['checkpoint']}")
    return metrics


main = hydra_app("train")(run)
