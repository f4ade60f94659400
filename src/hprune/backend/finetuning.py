"""A few optimizer steps in this process with a head mask held fixed (fine-tuning between pruning steps)."""
from __future__ import annotations

import torch

from ..console import progress
from .compat import undo_generation_fast
from .generation import batches
from .loading import Loaded


def finetune(loaded: Loaded, criterion, updates: int, lr: float, max_tokens: int, seed: int) -> None:
    """A few Adam updates on the train split with the model's current head mask held fixed (masked heads get
    zero gradient, so they stay removed). `seed` fixes the batch order and the dropout noise (drawn from a
    generator of its own, so the caller's random state is left as it was): the same call on the same weights
    gives the same weights, so a pruned curve and its control differ by the pruning only."""
    model = loaded.model
    undo_generation_fast(model)  # a beam search before locked train()
    model.train()
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr, betas=(0.9, 0.98))
    done, epoch = 0, 0
    devices = [torch.cuda.current_device()] if loaded.device == "cuda" else []
    with torch.random.fork_rng(devices=devices), progress("fine-tune", updates, "upd", leave=False) as bar:
        torch.manual_seed(seed)
        while done < updates:
            epoch += 1
            for sample in batches(loaded, "train", max_tokens, shuffle_seed=seed + epoch):
                loss, sample_size, _ = criterion(model, sample)
                optimizer.zero_grad(set_to_none=True)
                (loss / sample_size).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                done += 1
                bar.advance(1)
                if done == updates:
                    break
    model.eval()
