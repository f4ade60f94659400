"""Scaling out (docs/scaling.md), measured on this machine.

1. Training tokens/s of two data-parallel workers (hprune starts them: distributed.world_size=2, gloo on the
   CPU, a thread each) / one worker with update_freq 2 (every core), the same batches an update; rounds
   alternate A B A B. Dropout is off, so they are the same computation: the largest weight difference from a
   one-thread single worker (the same summation order) is printed too. On 2 cores the ratio is a record.
2. What the verbs that run in one process on one device cost per 1,000 sentences: beam search (`hprune eval`'s
   translate), Michel's and LRP's scores over the importance split, and the Fisher pass of Kwon et al.'s
   method over its calibration sentences.
"""
from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from common import BIN, config, demo_checkpoint, run

from hprune.evaluation import Evaluator
from hprune.methods import get_method
from hprune.session import Session

ROUNDS = 2
TRAIN = ["data.params.n_train=4000", "data.params.n_valid=100", "data.params.n_test=100", "data.params.n_names=40",
         "optim.max_update=100", "optim.max_tokens=2048", "model.dropout=0", "device=cpu", "log_interval=50",
         "save_interval_updates=1000"]


def train(out: Path, *settings: str) -> dict:
    run([str(BIN / "hprune"), "train", f"hydra.run.dir={out}", *TRAIN, *settings])
    return json.loads((out / "metrics.json").read_text())


def largest_difference(a: Path, b: Path) -> float:
    one, two = (torch.load(r / "checkpoints" / "checkpoint_last.pt", weights_only=False)["model"] for r in (a, b))
    return max((one[k].double() - two[k].double()).abs().max().item() for k in one)


def training(tmp: str) -> None:
    speeds: dict = {"one": [], "two": []}
    for round_ in range(ROUNDS):  # each side as a user runs it: one worker on every core, or a worker a core
        for side, settings in (("one", ["optim.update_freq=2"]), ("two", ["distributed.world_size=2"])):
            metrics = train(Path(tmp) / f"{side}{round_}", *settings)
            speeds[side].append(metrics["train_tokens_per_s"])
    one, two = statistics.median(speeds["one"]), statistics.median(speeds["two"])
    os.environ["OMP_NUM_THREADS"] = "1"  # one thread, as each of the two workers: the sums are then the same
    alone = train(Path(tmp) / "one-thread", "optim.update_freq=2")["train_tokens_per_s"]
    del os.environ["OMP_NUM_THREADS"]
    diff = largest_difference(Path(tmp) / "one-thread", Path(tmp) / f"two{ROUNDS - 1}")
    print(f"  training tokens/s, 1 worker x update_freq 2: {one:,.0f} (rounds {speeds['one']}; {alone:,.0f} on one "
          f"thread); 2 workers of one thread: {two:,.0f} (rounds {speeds['two']})")
    print(f"2 workers / 1 worker with update_freq 2 = {two / one:.3f} (a record on {os.cpu_count()} cores); largest "
          f"weight difference after 100 updates (1 worker on one thread): {diff:.3g}")


def per_thousand(tmp: str) -> None:
    ckpt = demo_checkpoint(tmp)
    cfg = config("prune", [f"ckpt={ckpt}", "device=cpu"])
    session = Session.open(cfg)
    rows = []
    started = time.perf_counter()
    result, _ = Evaluator.of(session, cfg).translate()
    rows.append(("beam search (eval), test split", len(result.hypotheses), time.perf_counter() - started))
    sentences = len(session.source_tokens(cfg.prune.importance.split))
    for name in ("michel", "lrp"):
        started = time.perf_counter()
        get_method(name).score(session, config("prune", [f"ckpt={ckpt}", f"prune={name}"]))
        rows.append((f"{name} scores, {cfg.prune.importance.split} split", sentences,
                     time.perf_counter() - started))
    out = Path(tmp) / "fisher"
    run([str(BIN / "hprune"), "prune", "--method", "fisher", f"ckpt={ckpt}", f"hydra.run.dir={out}", "device=cpu",
         "prune.export=false"])
    fisher = json.loads((out / "metrics.json").read_text())
    calibration = config("prune", [f"ckpt={ckpt}", "prune=fisher"]).prune.calibration.sentences
    rows.append(("fisher: the Fisher pass, calibration sentences", calibration, fisher["seconds_fisher"]))
    print(f"  {'one process, one device (CPU, fp32)':<48} {'sentences':>9} {'seconds':>8} {'s / 1,000':>9}")
    for what, count, seconds in rows:
        print(f"  {what:<48} {count:9d} {seconds:8.2f} {1000 * seconds / count:9.2f}")


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        training(tmp)
        per_thousand(tmp)


if __name__ == "__main__":
    main()
