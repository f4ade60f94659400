#!/usr/bin/env bash
# Every pruning method on the demo model's recipe, over training seeds 1-3, all three attention types pooled:
# the comparison in the README (docs/outputs.md). On 2 CPU cores about 45 minutes after `make demo`.
#   seed 1 is outputs/demo (make demo); seeds 2 and 3 are trained into outputs/seeds/N
#   per seed, under outputs/study/<seed>/:
#     prune/      Michel's order and four others (random, confidence, magnitude, LRP), 0/25/50/75 %
#     fisher/1-3  Kwon et al.: MACs budget 0.5, no retraining, calibration sentences drawn with seeds 1, 2, 3
#                 (seed=N: runs that differ in the seed alone, which the report aggregates as seeds)
#     dsp/0, /1   DSP keeping 18 of 36 heads, and its control keeping all 36 (the same 400 updates)
#     voita/0, /1 Voita's gates on all types (decoder not frozen), head budget 18, and the λ = 0 control
#   then `hprune report outputs/study` (outputs/study/report/); and, per seed under outputs/study_demo/<seed>/, what
#   `make demo` prints as its headline figures (the λ = 0 control of the demo's gates, 400 updates at lr 0.005, and
#   BLEU without any encoder self-attention head), whose spread over the seeds is scripts/demo_expected.json's
#   ranges (written by scripts/doc_figures.py).
# Steps that finished are skipped (their metrics.json is there); LAUNCHER=slurm submits each step instead.
source "$(dirname "$0")/reproduce_common.sh"
ALL="prune.types=[enc-self,dec-self,dec-enc]"

NO_ENC_SELF=outputs/study_demo/no_enc_self.json  # the demo model's shape: every encoder self-attention head removed
mkdir -p outputs/study_demo
echo '{"enc-self": [[0,0,0,0],[0,0,0,0],[0,0,0,0]], "dec-self": [[1,1,1,1],[1,1,1,1],[1,1,1,1]],
 "dec-enc": [[1,1,1,1],[1,1,1,1],[1,1,1,1]]}' > "$NO_ENC_SELF"

done_already() { [[ -f "$1/metrics.json" || -f "$1/0/metrics.json" && -f "$1/1/metrics.json" ]]; }

for seed in 2 3; do
  done_already "outputs/seeds/$seed" || step train "outputs/seeds/$seed" "seed=$seed"
done
for seed in 1 2 3; do
  model=$([[ $seed == 1 ]] && echo outputs/demo || echo "outputs/seeds/$seed")
  out="outputs/study/$seed"
  done_already "$out/prune" || step prune "$out/prune" "ckpt=$model" prune=michel prune.step_pct=25 \
    "prune.baselines=[random,confidence,magnitude,lrp]"
  for calibration in 1 2 3; do
    done_already "$out/fisher/$calibration" || step prune "$out/fisher/$calibration" "ckpt=$model" prune=fisher \
      prune.macs_budget=0.5 "seed=$calibration"  # the calibration draw: prune.calibration.seed is ${seed}
  done
  done_already "$out/dsp" || $HPRUNE prune -m "hydra.sweep.dir=$out/dsp" "ckpt=$model" prune=dsp \
    prune.head_budget=18,36 ${HPRUNE_ARGS:-}
  done_already "$out/voita" || $HPRUNE prune -m "hydra.sweep.dir=$out/voita" "ckpt=$model" prune=voita "$ALL" \
    prune.freeze_decoder=false "prune.head_budget=18,null" prune.l0_lambda=0 prune.optim.lr=0.01 ${HPRUNE_ARGS:-}
  demo="outputs/study_demo/$seed"  # the demo's own settings (Makefile), on this seed's model
  done_already "$demo/control" || step prune "$demo/control" "ckpt=$model" prune=voita prune.l0_lambda=0 \
    prune.optim.max_update=400 prune.optim.lr=0.005
  done_already "$demo/no_enc_self" || step eval "$demo/no_enc_self" "ckpt=$model" "mask=$NO_ENC_SELF"
done
$HPRUNE report outputs/study "hydra.run.dir=outputs/study/report" ${HPRUNE_ARGS:-}
