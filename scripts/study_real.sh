#!/usr/bin/env bash
# What head pruning finds on real language: the Greek New Testament -> English (data=greek_nt_en, a real human
# translation with manual word alignments), over training seeds 1-3 (docs/data.md; README "What it finds on real
# language", written by scripts/doc_figures.py from these runs). Not part of `make demo`.
#   outputs/real/seeds/<seed>          the model (experiment=greek_nt_en), trained to convergence (early stopping)
#   outputs/real/study/<seed>/
#     eval/        BLEU and chrF on the held-out chapters (test)
#     prune/       Michel's order against random, confidence and LRP, all heads pooled, 0/25/50/75 %
#     fisher/      Kwon et al.: half the attention MACs, no retraining
#     voita/0,1    Voita's gates on the encoder self-attention heads, λ = 1 and the λ = 0 control
#     dsp/0,1      DSP keeping 18 of the 36 heads, and its control keeping all 36
#     analyze/     roles (positional, rare-token; syntactic is not measured: the corpus has no parses), alignment
#                  heads against the manual alignments, eflomal's AER against the same alignments beside them
#   (the survival test, whether heads with a role outlive the others under Voita's gates, is computed from
#   analyze/head_roles.csv and voita/'s masks by scripts/doc_figures.py)
#   then `hprune report outputs/real/study` (outputs/real/study/report/).
# Steps that finished are skipped (their metrics.json is there): the study can be completed over several sittings.
# Time: 3 to 4 h a seed on one core (training 1.5 to 2 h of it), 10.5 h for the three; docs/data.md gives each step.
source "$(dirname "$0")/reproduce_common.sh"
SEEDS=${SEEDS:-"1 2 3"}
EXP=experiment=greek_nt_en
done_already() { [[ -f "$1/metrics.json" || -f "$1/0/metrics.json" && -f "$1/1/metrics.json" ]]; }

cpu_step data outputs/real/data "$EXP"
for seed in $SEEDS; do
  model="outputs/real/seeds/$seed"
  out="outputs/real/study/$seed"
  done_already "$model" || step train "$model" "$EXP" "seed=$seed"
  done_already "$out/eval" || step eval "$out/eval" "$EXP" "ckpt=$model"
  done_already "$out/analyze" || step analyze "$out/analyze" "$EXP" "ckpt=$model" split=test aligner_baseline=eflomal
  # seed=$seed: the random order's draw, another on each model (the other orders do not draw)
  done_already "$out/prune" || step prune "$out/prune" "$EXP" "ckpt=$model" prune=michel prune.step_pct=25 \
    "prune.baselines=[random,confidence,lrp]" "seed=$seed"
  done_already "$out/fisher" || step prune "$out/fisher" "$EXP" "ckpt=$model" prune=fisher prune.macs_budget=0.5
  done_already "$out/dsp" || sweep prune "$out/dsp" "$EXP" "ckpt=$model" prune=dsp prune.head_budget=18,36
  done_already "$out/voita" || sweep prune "$out/voita" "$EXP" "ckpt=$model" prune=voita prune.l0_lambda=1,0
done
$HPRUNE report outputs/real/study "hydra.run.dir=outputs/real/study/report" ${HPRUNE_ARGS:-}
