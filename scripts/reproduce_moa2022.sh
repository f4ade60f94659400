#!/usr/bin/env bash
# Zhang et al. (2022), "Mixture of Attention Heads", on WMT14 EN-DE (configs/experiment/moa2022.yaml):
#   1. download and prepare WMT14 EN-DE (about 4.5M pairs)
#   2. train MoA 8K8E128D (run.sh) and the sparse 8K16E128D and 8K32E128D, one job each; the last 10 epoch
#      checkpoints of each are averaged
#   3. BLEU (beam 4, lenpen 0.6), parameters, MACs per token and expert load of each averaged model
#   4. Michel importance on the experts of the 8K32E128D model, experts pruned in 10 % steps
# Usage: scripts/reproduce_moa2022.sh [OUT_DIR]   (LAUNCHER=slurm etc.: see scripts/reproduce_common.sh)
source "$(dirname "$0")/reproduce_common.sh"
OUT=${1:-outputs/moa2022}
X=experiment=moa2022
MODELS=${MODELS:-moa_base,moa_8k16e128d,moa_8k32e128d}

cpu_step "data prepare" "$OUT/data" $X
sweep train "$OUT/train" $X "model=$MODELS"
n_models=$(tr ',' '\n' <<< "$MODELS" | wc -l)
ckpts=$(seq -s, -f "$OUT/train/%g" 0 $((n_models - 1)))
sweep eval "$OUT/eval" $X "ckpt=$ckpts"
step prune "$OUT/prune" $X "ckpt=$OUT/train/$((n_models - 1))" prune.export=true
