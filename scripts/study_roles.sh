#!/usr/bin/env bash
# Head roles and Voita et al.'s survival finding over training seeds 1-3 of the demo recipe (issue 31): the
# figures of README "What the demo finds" and docs/outputs.md. On 2 CPU cores about 8 minutes a seed.
#   seed 1 is outputs/demo (make demo); seeds 2 and 3 are trained into outputs/seeds/N (as study_methods.sh)
#   per seed, under outputs/roles/<seed>/:
#     analyze/         hprune analyze: the roles of every head of the three attention types
#     voita_dec_enc/   Voita's gates on the encoder-decoder heads, λ = 1, 2, 4, 8 (as make demo)
#   then scripts/study_roles.py: role counts, the best alignment head, and the permutation test per seed and
#   over the three seeds together.
# Steps that finished are skipped (their metrics.json is there); LAUNCHER=slurm submits each step instead.
source "$(dirname "$0")/reproduce_common.sh"

for seed in 2 3; do
  [[ -f "outputs/seeds/$seed/metrics.json" ]] || step train "outputs/seeds/$seed" "seed=$seed"
done
for seed in 1 2 3; do
  model=$([[ $seed == 1 ]] && echo outputs/demo || echo "outputs/seeds/$seed")
  out="outputs/roles/$seed"
  [[ -f "$out/analyze/metrics.json" ]] || step analyze "$out/analyze" "ckpt=$model" lrp=false
  [[ -f "$out/voita_dec_enc/3/metrics.json" ]] || $HPRUNE prune -m "hydra.sweep.dir=$out/voita_dec_enc" \
    "ckpt=$model" prune=voita "prune.types=[dec-enc]" prune.freeze_decoder=false prune.l0_lambda=1,2,4,8 \
    prune.optim.max_update=400 prune.optim.lr=0.01 ${HPRUNE_ARGS:-}
done
"${PYTHON:-python}" "$(dirname "$0")/study_roles.py" outputs/roles
