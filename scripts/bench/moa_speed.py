"""MoA attention, forward + backward at T=64, B=32, d_model=512 (2048 tokens), side by side in one run:

* hprune's MoAAttention (no Python loop over experts, no host synchronisation);
* a per-expert loop written the way the released MoA code works (sort the (token, slot) pairs by expert, read
  the group sizes back to the host, one matmul per expert, index_add), on the same parameters; its output is
  checked against hprune's before timing;
* fairseq's dense MultiheadAttention, 8 heads of 64.

Printed: tokens/s ratio hprune / loop (goal >= 2 at both settings), and effective MAC throughput (tokens/s x
MACs per token, MACs counted by torch's FlopCounterMode) of hprune / dense (goal >= 0.8 at E=8, k=8).

Then the same table from a second process in which glibc keeps freed memory (MALLOC_MMAP_THRESHOLD_ and
MALLOC_TRIM_THRESHOLD_ set high). With the default allocator every transient above its mmap limit (32 MiB at
most) is mapped afresh and page-faulted in on each step; the loop's 32 MiB per-row matrices pay that, hprune's
streamed expert projections do not. The second table shows what is left when nobody pays it: both are then
bound by the same expert matmuls.
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

import common  # noqa: F401  (first: its logging set-up keeps fairseq's import-time INFO lines off the console)
import torch
from fairseq.modules.multihead_attention import MultiheadAttention

from hprune.flops import count_flops
from hprune_fairseq.moa import MoAAttention

T, B, D_MODEL, ROUNDS, REPS = 64, 32, 512, 5, 3
SETTINGS = [(8, 8, 128), (32, 8, 64)]  # (E, k, head_dim)
KEPT_MEMORY = "MALLOC_MMAP_THRESHOLD_"


class LoopMoA(torch.nn.Module):
    """The released code's computation (moa_layer/parallel_linear): a Python loop over experts."""

    def __init__(self, moa: MoAAttention):
        super().__init__()
        self.moa = moa

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.moa
        tgt_len, bsz, _ = x.shape
        tokens = x.transpose(0, 1).reshape(-1, m.embed_dim)
        weights, experts, _, _ = m.route(tokens, None)
        k = experts.size(1)
        flat = experts.reshape(-1)
        order = flat.argsort()
        sizes = torch.bincount(flat, minlength=m.num_heads).tolist()  # host sync, as expert_size.tolist()
        batch_index = order // k
        inputs = tokens[batch_index].split(sizes)
        queries = torch.cat([chunk @ w for chunk, w in zip(inputs, m.q_experts.unbind(0))])
        slot_queries = torch.zeros_like(queries).index_copy(0, order, queries)
        q = slot_queries.view(bsz, tgt_len * k, m.head_dim).unsqueeze(1) * m.scaling
        keys = m.k_proj(x).transpose(0, 1).unsqueeze(1)
        values = m.v_proj(x).transpose(0, 1).unsqueeze(1)
        context = torch.nn.functional.scaled_dot_product_attention(q, keys, values, scale=1.0)
        context = context.reshape(-1, m.head_dim)[order].split(sizes)
        outputs = torch.cat([chunk @ w for chunk, w in zip(context, m.o_experts.unbind(0))])
        outputs = outputs * weights.reshape(-1)[order].unsqueeze(1)
        summed = outputs.new_zeros(tokens.size(0), m.embed_dim).index_add(0, batch_index, outputs)
        return summed.view(bsz, tgt_len, m.embed_dim).transpose(0, 1)


def step(module, x) -> None:
    out = module(x)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(torch.ones_like(out))


def timed(module, x) -> float:
    started = time.perf_counter()
    for _ in range(REPS):
        step(module, x)
    return (time.perf_counter() - started) / REPS


def main() -> None:
    torch.manual_seed(1)
    x = torch.randn(T, B, D_MODEL, requires_grad=True)
    dense = MultiheadAttention(D_MODEL, 8, self_attention=True)
    dense_call = lambda inp: dense(inp, inp, inp, need_weights=False)  # noqa: E731
    dense_macs = count_flops(dense_call, x) / 2 / (T * B)
    print(f"{'setting':<16}{'hprune tok/s':>14}{'loop tok/s':>12}{'dense tok/s':>13}{'MACs/token':>12}"
          f"{'hprune/loop':>13}{'MAC thr. vs dense':>19}")
    for experts, top_k, head_dim in SETTINGS:
        moa = MoAAttention(D_MODEL, experts, top_k, head_dim, self_attention=True)
        torch.nn.init.normal_(moa.router.weight, std=0.1)  # a trained-looking router: uneven, distinct routes
        ours = lambda inp: moa(inp, inp, inp, need_weights=False)  # noqa: E731
        loop = LoopMoA(moa)
        torch.testing.assert_close(loop(x), ours(x)[0], rtol=1e-4, atol=1e-4)
        macs = count_flops(ours, x) / 2 / (T * B)
        times = {"hprune": [], "loop": [], "dense": []}
        for name, fn in (("hprune", ours), ("loop", loop), ("dense", dense_call)):
            step(fn, x)  # warm-up
        for _ in range(ROUNDS):
            for name, fn in (("hprune", ours), ("loop", loop), ("dense", dense_call)):
                times[name].append(timed(fn, x))
        speed = {name: T * B / statistics.median(values) for name, values in times.items()}
        label = f"{top_k}K{experts}E{head_dim}D"
        print(f"{label:<16}{speed['hprune']:>14,.0f}{speed['loop']:>12,.0f}{speed['dense']:>13,.0f}"
              f"{macs:>12,.0f}{speed['hprune'] / speed['loop']:>13.2f}"
              f"{speed['hprune'] * macs / (speed['dense'] * dense_macs):>19.2f}")
    print(f"(dense: fairseq MultiheadAttention, 8 heads of 64, {dense_macs:,.0f} MACs/token; goals: hprune/loop "
          ">= 2 at both settings, MAC throughput >= 0.8 of dense at 8K8E128D)")
    if KEPT_MEMORY not in os.environ:
        print(f"\nthe same, glibc keeping freed memory ({KEPT_MEMORY} and MALLOC_TRIM_THRESHOLD_ = 16 GiB):",
              flush=True)
        kept = {KEPT_MEMORY: str(16 << 30), "MALLOC_TRIM_THRESHOLD_": str(16 << 30)}
        subprocess.run([sys.executable, __file__], env={**os.environ, **kept}, check=True)


if __name__ == "__main__":
    main()
