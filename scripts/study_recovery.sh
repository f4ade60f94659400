#!/usr/bin/env bash
# What recovery wins back on real language (issue 53; README "What recovery wins back", written by
# scripts/doc_figures.py from these runs): on the Greek New Testament model of seed 1 (scripts/study_real.sh's),
# Kwon et al.'s heads and FFN neurons at latency budgets 0.8, 0.6 and 0.5 (per_stack, CTranslate2 int8), each
# pruned model recovered with the three losses for the same number of updates.
#   outputs/real/recovery/<seed>/fisher_<budget>/          the pruned model (no retraining), its latency measured
#   outputs/real/recovery/<seed>/fisher_<budget>/<loss>/   recovered with ce, word or sequence (hprune recover)
# Steps that finished are skipped (their metrics.json is there); a recovery killed midway resumes.
source "$(dirname "$0")/reproduce_common.sh"
SEED=${SEED:-1}
UPDATES=${UPDATES:-300}
EXP=experiment=greek_nt_en
model="outputs/real/seeds/$SEED"
out="outputs/real/recovery/$SEED"

cpu_step data outputs/real/data "$EXP"
[[ -f "$model/metrics.json" ]] || step train "$model" "$EXP" "seed=$SEED"
for budget in 0.8 0.6 0.5; do
  run="$out/fisher_$budget"
  [[ -f "$run/metrics.json" ]] || step prune "$run" "$EXP" "ckpt=$model" prune=fisher "prune.units=[heads,neurons]" \
    prune.layout=per_stack "prune.latency_budget=$budget" latency.compute_type=int8
  for loss in ce word sequence; do
    [[ -f "$run/$loss/metrics.json" ]] || step recover "$run/$loss" "$EXP" "ckpt=$model" "mask=$run" \
      "recovery.loss=$loss" "recovery.updates=$UPDATES"
  done
done
$HPRUNE report "$out" "hydra.run.dir=$out/report" ${HPRUNE_ARGS:-}
