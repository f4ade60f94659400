#!/usr/bin/env bash
# Michel et al. (2019), "Are Sixteen Heads Really Better than One?", on WMT14 EN-FR (configs/experiment/michel2019.yaml):
#   1. download and prepare WMT14 EN-FR (about 40M pairs; see the README for disk space and time)
#   2. train a Transformer big (fp16, 3584 tokens x 16 per update: plan days on one GPU)
#   3. BLEU of the trained model on newstest2013
#   4. head importance on newstest2012, heads pruned in 10 % steps, BLEU after each step; random and
#      magnitude orders on the same model for comparison; the pruned model exported and timed
# Usage: scripts/reproduce_michel2019.sh [OUT_DIR]   (LAUNCHER=slurm etc.: see scripts/reproduce_common.sh)
source "$(dirname "$0")/reproduce_common.sh"
OUT=${1:-outputs/michel2019}
X=experiment=michel2019

cpu_step "data prepare" "$OUT/data" $X
step train "$OUT/train" $X
step eval "$OUT/eval" $X "ckpt=$OUT/train"
step prune "$OUT/prune" $X "ckpt=$OUT/train" "prune.baselines=[random,magnitude]" "prune.ablations=[one_head]" \
  prune.export=true
