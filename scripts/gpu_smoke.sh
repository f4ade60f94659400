#!/usr/bin/env bash
# GPU smoke check (< 5 minutes on one GPU): transformer_base dimensions on the synthetic task for 300 updates
# in bf16 and in fp16, evaluated with beam search, with training tokens/s printed next to stock fairseq-train's
# (same dimensions, data and flags, `--arch transformer`), then a Michel pruning curve with physical export;
# then a stock fairseq Transformer checkpoint evaluated by hprune in both precisions, then MoA (8 of 16 experts)
# trained and evaluated in both precisions, then an imported tiny Marian (OPUS-MT) model in fp32 and bf16, then
# the methods that came after the papers on the bf16 model: LRP relevance, DSP (exactly 24 heads) and Kwon et
# al.'s retraining-free pruning (the MACs reached, counted on the export). With two GPUs or more, the bf16 training
# once more on two of them (fairseq's data parallelism); with one, it says so. Last, the real-size section: the
# NLLB-200-distilled-600M configuration's importance, pruning with FFN neurons and CTranslate2 latency table on the
# GPU (a few minutes more).
#   usage: scripts/gpu_smoke.sh            (PY=path/to/python to use another interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT_DIR:-/tmp/hprune-gpu-smoke}
export HPRUNE_DATA_ROOT=${HPRUNE_DATA_ROOT:-$OUT/data-bin}
rm -rf "$OUT/runs"
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print('GPU:', torch.cuda.get_device_name(0), 'torch', torch.__version__)"

for precision in bf16 fp16; do
  run="$OUT/runs/$precision"
  # one GPU, as the stock fairseq-train it is compared with (fairseq-train.sh holds --distributed-world-size 1)
  "$PY" -m hprune_cli.main train experiment=gpu_smoke precision=$precision hydra.run.dir="$run" log_interval=100 \
      distributed.world_size=1
  "$PY" -m hprune_cli.main eval ckpt="$run" device=cuda precision=$precision hydra.run.dir="$run/eval"
  "$PY" -m hprune_cli.main prune --method michel ckpt="$run" device=cuda precision=$precision \
      prune.step_pct=25 prune.export=true hydra.run.dir="$run/prune" | tail -n 8
  # stock fairseq-train: the same command line with the stock architecture
  stock=$(sed -e "s#--user-dir [^ ]* ##" -e "s#--arch hprune_transformer#--arch transformer#" \
              -e "s#--criterion hprune#--criterion label_smoothed_cross_entropy#" \
              -e "s#--save-dir [^ ]*#--save-dir $run/stock --no-save --disable-validation#" "$run/fairseq-train.sh")
  eval "$(dirname "$PY")/$stock" > "$run/stock.log" 2>&1
  "$PY" - "$run" <<'PY'
import json, re, statistics, sys
from pathlib import Path
run = Path(sys.argv[1])
def inner_wps(text):
    return statistics.median([float(x) for x in re.findall(r"train_inner.*? wps=([\d.]+)", text)][1:] or [0])
ours = inner_wps((run / "train.log").read_text())
stock = inner_wps((run / "stock.log").read_text())
train, evaluation = json.loads((run / "metrics.json").read_text()), json.loads((run / "eval" / "metrics.json").read_text())
print(f"{run.name}: hprune {ours:,.0f} tok/s, stock fairseq {stock:,.0f} tok/s, ratio {ours / max(stock, 1):.3f}; "
      f"{train['num_updates']} updates, valid loss {train['best_valid_loss']:.3f}; BLEU {evaluation['bleu']:.2f}, "
      f"{evaluation['sentences_per_s']} sentences/s")
PY
done

# fairseq's data parallelism on two GPUs (NCCL, torch's DistributedDataParallel): the bf16 recipe again, tokens/s
# beside the one-GPU run's
gpus=$("$PY" -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -gt 1 ]; then
  run="$OUT/runs/ddp-bf16"
  "$PY" -m hprune_cli.main train experiment=gpu_smoke precision=bf16 hydra.run.dir="$run" log_interval=100 \
      distributed.world_size=2 | tail -n 1
  "$PY" - "$OUT/runs/bf16" "$run" <<'PY'
import json, sys
one, two = (json.load(open(f"{run}/metrics.json")) for run in sys.argv[1:])
print(f"2 GPUs: {two['train_tokens_per_s']:,.0f} tok/s ({two['workers']} workers, {two['max_tokens_per_update']:,} tokens an "
      f"update at most) vs 1 GPU {one['train_tokens_per_s']:,.0f} tok/s: x{two['train_tokens_per_s'] / one['train_tokens_per_s']:.2f}; "
      f"valid loss {two['best_valid_loss']:.3f} vs {one['best_valid_loss']:.3f}")
PY
else
  echo "one GPU visible: the 2-GPU data-parallel training was not run"
fi

# a stock fairseq Transformer (no plugin, `--arch transformer`, 50 updates) evaluated by hprune in both precisions
stock_run="$OUT/runs/stock-transformer"
stock=$(sed -e "s#--user-dir [^ ]* ##" -e "s#--arch hprune_transformer#--arch transformer#" \
            -e "s#--criterion hprune#--criterion label_smoothed_cross_entropy#" -e "s#--max-update [0-9]*#--max-update 50#" \
            -e "s#--save-dir [^ ]*#--save-dir $stock_run/checkpoints#" "$OUT/runs/bf16/fairseq-train.sh")
eval "$(dirname "$PY")/$stock" > "$OUT/runs/stock-transformer.log" 2>&1
for precision in bf16 fp16; do
  "$PY" -m hprune_cli.main eval ckpt="$stock_run/checkpoints/checkpoint_last.pt" device=cuda precision=$precision \
      hydra.run.dir="$stock_run/eval-$precision" | head -n 1
  "$PY" -c "import json, sys; m = json.load(open(sys.argv[1])); print('stock transformer, $precision:', m['imported_from'], 'BLEU', m['bleu'])" \
      "$stock_run/eval-$precision/metrics.json"
done

# MoA: sparse routing (8 of 16 experts of 128) trained and evaluated in bf16 and fp16
for precision in bf16 fp16; do
  run="$OUT/runs/moa-$precision"
  "$PY" -m hprune_cli.main train experiment=gpu_smoke model=moa_8k16e128d precision=$precision \
      optim.max_update=150 hydra.run.dir="$run" log_interval=50 | tail -n 1
  "$PY" -m hprune_cli.main eval ckpt="$run" device=cuda precision=$precision hydra.run.dir="$run/eval" | tail -n 2
done

# an imported Marian model (tiny and random, OPUS-MT's settings; tests/hf_models.py) evaluated in fp32 and bf16
hf="$OUT/runs/marian"
toy=$(ls -d "$HPRUNE_DATA_ROOT"/toy-*/raw | head -n 1)
marian=$("$PY" tests/hf_models.py marian "$hf" "$toy/train.src" "$toy/train.tgt" 2>/dev/null | tail -n 1)
for precision in fp32 bf16; do
  "$PY" -m hprune_cli.main eval ckpt="$marian" paths.models_root="$hf/models" data=pretrained \
      data.max_pieces_per_word=null "data.test_sets=[{src:$toy/test.src,tgt:$toy/test.tgt}]" generation.beam=4 \
      device=cuda precision=$precision hydra.run.dir="$hf/eval-$precision" | tail -n 2
done
"$PY" - "$hf" <<'PY'
import sys
from pathlib import Path
runs = Path(sys.argv[1])
fp32, bf16 = ((runs / f"eval-{p}" / "hypotheses.test.txt").read_text().splitlines() for p in ("fp32", "bf16"))
print(f"imported Marian: bf16 translations identical to fp32 for {sum(a == b for a, b in zip(fp32, bf16))}/{len(fp32)}")
PY

# LRP, DSP and Kwon et al.'s search on the bf16 transformer_base-sized model, in bf16 on the GPU
run="$OUT/runs/bf16"
"$PY" -m hprune_cli.main prune --method lrp ckpt="$run" device=cuda precision=bf16 prune.step_pct=50 \
    prune.importance.max_batches=4 hydra.run.dir="$run/lrp" | tail -n 3
"$PY" -m hprune_cli.main prune --method dsp ckpt="$run" device=cuda precision=bf16 prune.head_budget=72 \
    prune.optim.max_update=100 prune.cooldown=60 hydra.run.dir="$run/dsp" | tail -n 1
"$PY" -m hprune_cli.main prune --method fisher ckpt="$run" device=cuda precision=bf16 prune.macs_budget=0.5 \
    hydra.run.dir="$run/fisher" | tail -n 2
"$PY" - "$run" <<'PY'
import json, sys
from pathlib import Path
run = Path(sys.argv[1])
dsp, fisher = (json.loads((run / name / "metrics.json").read_text()) for name in ("dsp", "fisher"))
counted = fisher["attention_macs_per_token_pruned"] / fisher["attention_macs_per_token_unpruned"]
print(f"dsp: {dsp['kept_heads']} of {dsp['heads_pool']} heads kept (asked 72), BLEU {dsp['bleu']:.2f} in {dsp['seconds']:.0f} s; "
      f"fisher: {fisher['kept_heads']} heads, {100 * counted:.1f} % of the attention MACs counted (budget 50 %), "
      f"BLEU {fisher['bleu']:.2f} in {fisher['seconds']:.1f} s")
PY

# the fisher mask's model handed to CTranslate2 in float16 and translated on the GPU, against the same model on the CPU
"$PY" -m hprune_cli.main export ckpt="$run" mask="$run/fisher/head_mask.json" quantization=float16 device=cuda \
    hydra.run.dir="$run/ct2" | tail -n 1
"$PY" - "$run" "$HPRUNE_DATA_ROOT" <<'PY'
import sys, time
from pathlib import Path
import ctranslate2
run, root = Path(sys.argv[1]), Path(sys.argv[2])
test = (next(root.glob("toy-*")) / "pieces" / "test.src").read_text().splitlines()[:256]
tokens = [line.split() for line in test]
outputs = {}
for device, compute in (("cuda", "float16"), ("cpu", "float32")):
    translator = ctranslate2.Translator(str(run / "ct2" / "ctranslate2"), device=device, compute_type=compute)
    started = time.perf_counter()
    outputs[device] = [" ".join(r.hypotheses[0]) for r in translator.translate_batch(tokens, beam_size=4)]
    print(f"CTranslate2 {device} {compute}: {len(tokens) / (time.perf_counter() - started):.0f} sentences/s")
same = sum(a == b for a, b in zip(outputs["cuda"], outputs["cpu"]))
print(f"CTranslate2 float16 on the GPU: {same}/{len(tokens)} translations identical to float32 on the CPU")
PY

# real size (issue 52): the NLLB-200-distilled-600M configuration with random weights (scripts/bench/real_sizes.py)
# on the GPU: the import, Michel's importance, Kwon et al.'s pruning with FFN neurons, the CTranslate2 latency table
# on cuda with its predictions checked on four masks it did not time. It prints a line per verb (seconds, the host's
# peak memory, counted teraFLOPs), the table's predicted and measured latencies, and the table of all of them.
"$PY" scripts/bench/real_sizes.py nllb-200-distilled-600M --verbs import,michel,fisher,latency --device cuda \
    --again --out "$OUT/real_sizes"
