"""Michel head importance over N batches vs N training steps on the same batches (transformer_base size).

Importance is one forward and one backward per batch that asks autograd only for the head outputs' gradients;
a training step is forward, backward to every weight, and an Adam update. Alternating rounds, medians.
Goal: importance / training <= 1.3.
"""
from __future__ import annotations

import statistics
import time

import torch
from common import base_checkpoint, config, prepared_data

from hprune import backend
from hprune.pruning import scores

BATCHES, MAX_TOKENS, ROUNDS = 4, 512, 3


def main() -> None:
    torch.manual_seed(1)
    cfg = config("prune", ["device=cpu", "ckpt=unused"])
    loaded = backend.load_model(base_checkpoint(), prepared_data(cfg))
    model, criterion = loaded.model, backend.build_criterion(loaded)
    batches = list(backend.batches(loaded, "valid", MAX_TOKENS, BATCHES))
    pad = loaded.task.target_dictionary.pad()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-5)

    def train_steps() -> None:
        model.train()
        for sample in batches:
            loss, sample_size, _ = criterion(model, sample)
            optimizer.zero_grad(set_to_none=True)
            (loss / sample_size).backward()
            optimizer.step()
        model.eval()

    def importance() -> None:
        scores.michel(model, criterion, batches, pad)

    timings: dict[str, list[float]] = {"training steps": [], "importance": []}
    importance(), train_steps()  # warm-up
    for _ in range(ROUNDS):
        for name, fn in (("training steps", train_steps), ("importance", importance)):
            started = time.perf_counter()
            fn()
            timings[name].append(time.perf_counter() - started)
    tokens = sum(int(s["ntokens"]) for s in batches)
    for name, values in timings.items():
        print(f"  {name:<15} {statistics.median(values):6.2f} s for {len(batches)} batches ({tokens} target tokens)"
              f"   (runs: {', '.join(f'{v:.2f}' for v in values)})")
    ratio = statistics.median(timings["importance"]) / statistics.median(timings["training steps"])
    print(f"importance time / training-step time = {ratio:.3f}  (goal <= 1.3) "
          f"[transformer_base, {backend.count_parameters(model):,} parameters]")


if __name__ == "__main__":
    main()
