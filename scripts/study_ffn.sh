#!/usr/bin/env bash
# Heads + FFN neurons against heads alone at the same latency (issue 43, docs/methods.md), on the demo model:
# per calibration draw 1-3 (the draw of the 2048 calibration sentences: seed=N),
#   outputs/study_ffn/<draw>/ffn    fisher, units [heads, neurons], half the MACs of heads and FFN, per_stack,
#                                   its latency in CTranslate2 measured (int8, 1 thread, beam 4)
#   outputs/study_ffn/<draw>/heads  fisher, heads alone, per_stack, under a latency budget equal to the latency
#                                   the first run measured (the latency table's prediction)
# then scripts/study_ffn_summary.py: BLEU of both per draw, mean ± sd, the paired bootstrap between them.
# Needs `make demo` (outputs/demo). About 15 minutes on 2 CPU cores; finished steps are skipped.
source "$(dirname "$0")/reproduce_common.sh"
set -euo pipefail
for draw in 1 2 3; do
  out="outputs/study_ffn/$draw"
  [[ -f "$out/ffn/metrics.json" ]] || step prune "$out/ffn" ckpt=outputs/demo prune=fisher "seed=$draw" \
    "prune.units=[heads,neurons]" prune.macs_budget=0.5 prune.layout=per_stack latency.measure=true
  budget=$(python3 -c "import json; print(min(1.0, json.load(open('$out/ffn/metrics.json'))['latency_pct_measured'] / 100))")  # (no faster: all)
  [[ -f "$out/heads/metrics.json" ]] || step prune "$out/heads" ckpt=outputs/demo prune=fisher "seed=$draw" \
    prune.layout=per_stack "prune.latency_budget=$budget"
done
${PY:-.venv/bin/python} "$(dirname "$0")/study_ffn_summary.py" outputs/study_ffn
