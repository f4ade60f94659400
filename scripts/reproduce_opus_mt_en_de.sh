#!/usr/bin/env bash
# Pruning a Hugging Face Marian model, Helsinki-NLP/opus-mt-en-de (OPUS-MT; Transformer base, sentencepiece),
# end to end. The Hub snapshot (in the Hugging Face cache) is imported once into a fairseq model
# (docs/your-model.md); transformers is not needed for that, only `pip install 'hprune[hf]'` (huggingface_hub,
# safetensors).
#   1. fetch the Hub repository's config, weights, source.spm/target.spm, vocab.json (HF_TOKEN, HF_ENDPOINT and
#      HF_HUB_OFFLINE apply)
#   2. BLEU on newstest2014 and newstest2019 (splits test, test1), text encoded with the model's sentencepiece
#   3. Michel's curve (importance on newstest2010-2012, no fine-tuning), random order for comparison, export
#   4. head roles of the encoder self-attention (without gold parses: positional, rare-token, confidence)
#   5. Voita's gates on the encoder self-attention, continued training on newstest2010-2012 (a small corpus:
#      read the λ = 0 control), and one report over all of it
# Usage: scripts/reproduce_opus_mt_en_de.sh [OUT_DIR]   (LAUNCHER=slurm etc.: see scripts/reproduce_common.sh)
source "$(dirname "$0")/reproduce_common.sh"
OUT=${1:-outputs/opus_mt_en_de}
REPO=Helsinki-NLP/opus-mt-en-de
M=("ckpt=$REPO" "data.test_sets=[wmt14/full,wmt19]"
   "data.valid_sets=[wmt13]" "data.train_sets=[wmt10,wmt11,wmt12]")

cpu_step "data fetch" "$OUT/fetch" "hf=$REPO"
step eval "$OUT/eval" "${M[@]}"
step prune "$OUT/michel" "${M[@]}" prune=michel prune.importance.split=train "prune.baselines=[random]" \
  prune.export=true
step analyze "$OUT/analyze" "${M[@]}" split=test
sweep prune "$OUT/voita" "${M[@]}" prune=voita "prune.types=[enc-self]" prune.l0_lambda=0,0.01,0.05,0.1
step report "$OUT/report" "runs=[$OUT]"
