#!/usr/bin/env bash
# Pruning fairseq's published WMT19 EN-RU model (Ng et al. 2019; Transformer big, Moses + fastBPE, separate
# dictionaries), end to end. The single model, not the ensemble: the ensemble's archive shipped EN-DE's
# bpecodes (fairseq#2928), which data=pretrained refuses in one line.
#   1. download and unpack wmt19.en-ru.single_model
#   2. BLEU on newstest2019 and newstest2018 (splits test, test1), data encoded with the model's own codes
#   3. Michel's curve (importance on newstest2014 + 2013, no fine-tuning), random order for comparison, export
#   4. head roles (positional, syntactic, rare-token, confidence) and Voita's gates on the encoder
#      self-attention, continued training on newstest2013-2014 (a small corpus: read the λ = 0 control)
#   5. one report over all of it
# Usage: scripts/reproduce_wmt19_en_ru.sh [OUT_DIR]   (LAUNCHER=slurm etc.: see scripts/reproduce_common.sh)
source "$(dirname "$0")/reproduce_common.sh"
OUT=${1:-outputs/wmt19_en_ru}
MODEL=wmt19.en-ru.single_model
M=("data=pretrained" "ckpt=\${paths.models_root}/$MODEL/model.pt")

cpu_step "data fetch" "$OUT/fetch" "published=$MODEL"
step eval "$OUT/eval" "${M[@]}"
step prune "$OUT/michel" "${M[@]}" prune=michel prune.importance.split=train "prune.baselines=[random]" \
  prune.export=true
step analyze "$OUT/analyze" "${M[@]}"
sweep prune "$OUT/voita" "${M[@]}" prune=voita "prune.types=[enc-self]" prune.l0_lambda=0,0.01,0.05,0.1
step report "$OUT/report" "runs=[$OUT]"
