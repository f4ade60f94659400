#!/usr/bin/env bash
# Voita et al. (2019), "Specialized Heads Do the Heavy Lifting, the Rest Can Be Pruned", on WMT EN-RU
# (configs/experiment/voita2019.yaml):
#   1. download and prepare WMT EN-RU, keeping a random 2.5M pairs
#   2. train a Transformer base to convergence
#   3. BLEU on newstest2017 (and newstest2018/2019: eval split=test1 / test2)
#   4. head roles of the encoder self-attention (confidence, positional, syntactic, rare-token)
#   5. L0-gated training of the 48 encoder heads, decoder frozen, one job per λ; each job also trains the
#      surviving configuration from scratch (the paper's control) and exports the pruned model
# Usage: scripts/reproduce_voita2019.sh [OUT_DIR]   (LAUNCHER=slurm etc.: see scripts/reproduce_common.sh)
source "$(dirname "$0")/reproduce_common.sh"
OUT=${1:-outputs/voita2019}
X=experiment=voita2019
LAMBDAS=${LAMBDAS:-0.01,0.02,0.05,0.1,0.2,0.5}

cpu_step "data prepare" "$OUT/data" $X
step train "$OUT/train" $X
step eval "$OUT/eval" $X "ckpt=$OUT/train"
step analyze "$OUT/analyze" $X "ckpt=$OUT/train"
sweep prune "$OUT/prune" $X "ckpt=$OUT/train" "prune.l0_lambda=$LAMBDAS" prune.from_scratch=true prune.export=true
