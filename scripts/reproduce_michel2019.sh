#!/usr/bin/env bash
# Michel et al. (2019), "Are Sixteen Heads Really Better than One?", on WMT14 EN-FR (configs/experiment/michel2019.yaml),
# from the model the paper pruned: fairseq's published WMT14 EN-FR Transformer big (Ott et al. 2018).
#   1. download and unpack the model (about 2 GB; sha256 recorded at the first download, checked after)
#   2. BLEU of the published model on newstest2013, its test data encoded with the model's own codes
#   3. head importance on newstest2009-2012, heads pruned in 10 % steps, BLEU after each step; random and
#      magnitude orders on the same model for comparison; the pruned model exported and timed
# Usage: scripts/reproduce_michel2019.sh [OUT_DIR]   (LAUNCHER=slurm etc.: see scripts/reproduce_common.sh)
source "$(dirname "$0")/reproduce_common.sh"
OUT=${1:-outputs/michel2019}
X=experiment=michel2019

cpu_step "data fetch" "$OUT/fetch" $X
step eval "$OUT/eval" $X
step prune "$OUT/prune" $X "prune.baselines=[random,magnitude]" "prune.ablations=[one_head]" prune.export=true
