"""What each pruning method costs to reach about 50 % of the encoder self-attention heads pruned, on one model
(outputs/demo from `make demo` when present), as ratios to one evaluation pass (beam search over the test
split), all measured in this run.

  orders (michel, lrp): computing the scores on the importance split; any sparsity is then a mask away
  voita:  the gate training with a head budget of 6 of 12 (800 updates at lr 0.01; its budget controller lands
          within one head of the budget)
  fisher: calibration, Fisher, search, rearrangement and tuning (its `seconds`), with the MACs budget of the
          heads Voita kept (every enc-self head costs the same), so both keep as many heads
  dsp:    the subset-selection training (its defaults: 400 updates), K = the heads Voita kept
The three procedures run through the CLI, each its own process; their BLEU is that of the mask they reach.
Goal: fisher costs at most 1/10 of Voita's gate training, at BLEU within 1 point of it.
"""
from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

from common import BIN, config, demo_checkpoint, run

from hprune.evaluation import Evaluator
from hprune.methods import get_method
from hprune.session import Session

ROUNDS = 3
POOL = "prune.types=[enc-self]"


def procedure(tmp: str, ckpt: Path, name: str, *settings: str) -> dict:
    out = Path(tmp) / name
    run([str(BIN / "hprune"), "prune", "--method", name, f"ckpt={ckpt}", f"hydra.run.dir={out}", "device=cpu", POOL,
         *settings])
    return json.loads((out / "metrics.json").read_text())


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = demo_checkpoint(tmp)
        cfg = config("prune", [f"ckpt={ckpt}", "device=cpu", POOL])
        session = Session.open(cfg)
        evaluator, evaluation = Evaluator.of(session, cfg), []
        for _ in range(ROUNDS):
            started = time.perf_counter()
            evaluator.translate()
            evaluation.append(time.perf_counter() - started)
        one_pass = statistics.median(evaluation)
        rows = []
        for name in ("michel", "lrp"):
            started = time.perf_counter()
            get_method(name).score(session, cfg)
            rows.append((name, time.perf_counter() - started, None))
        voita = procedure(tmp, ckpt, "voita", "prune.head_budget=6", "prune.optim.lr=0.01")
        kept = voita["kept_enc_self"]
        rows.append(("voita", voita["seconds"], voita["bleu"]))
        for name, settings in (("fisher", [f"prune.macs_budget={kept / 12}", "prune.export=false"]),
                               ("dsp", [f"prune.head_budget={kept}"])):
            metrics = procedure(tmp, ckpt, name, *settings)
            assert metrics["kept_enc_self"] == kept, (name, metrics["kept_enc_self"], kept)
            rows.append((name, metrics["seconds"], metrics["bleu"]))
    print(f"  one evaluation pass (beam search, test split): {one_pass:.2f} s (median of {ROUNDS}: "
          f"{', '.join(f'{v:.2f}' for v in evaluation)})")
    print(f"  {'method':<8} {'seconds':>8} {'/ eval pass':>12} {f'BLEU, {kept} of 12 enc-self heads kept':>34}")
    for name, seconds, bleu in rows:
        print(f"  {name:<8} {seconds:8.2f} {seconds / one_pass:12.2f} {'' if bleu is None else f'{bleu:34.2f}'}")
    found = {name: (seconds, bleu) for name, seconds, bleu in rows}
    ratio = found["fisher"][0] / found["voita"][0]
    gap = found["fisher"][1] - found["voita"][1]
    print(f"fisher time / voita gate-training time = {ratio:.3f} (goal <= 0.1), BLEU fisher - voita = {gap:+.2f} "
          "(goal >= -1)")


if __name__ == "__main__":
    main()
