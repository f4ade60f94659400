# hprune: `make help` lists the targets.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.DEFAULT_GOAL := help

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*## "} {printf "  %-10s %s\n", $$1, $$2}'

install: $(STAMP) ## create .venv and install hprune, torch and fairseq (once; re-run when setup.cfg changes)

$(STAMP): setup.cfg pyproject.toml
	test -x $(PY) || python3.11 -m venv $(VENV) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip "setuptools>=64" wheel
	# torch first, pinned: nothing else may bring another build of it
	$(PIP) install -q torch==2.13.0 numpy cython
	# fairseq-fixed declares torchaudio (another torch); its real needs are in setup.cfg
	$(PIP) install -q --no-deps --no-build-isolation fairseq-fixed==0.12.3.1
	$(PIP) install -q --no-build-isolation -e '.[test,deploy,align]'
	$(PY) -c "import torch, fairseq, hprune_fairseq; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $@

demo: install ## the study on the synthetic task: train to convergence, Michel's order against random, confidence and LRP on all heads pooled, Kwon et al.'s retraining-free pruning to half the attention MACs (heads, then heads and FFN neurons; their latency in CTranslate2; the deeper cut recovered by distillation), a Voita λ sweep with its λ = 0 control, head roles, a λ sweep of the encoder-decoder heads (do alignment heads outlive the rest?), `hprune report`, a summary (about 16 min on 2 cores after the install)
	rm -rf outputs/demo
	$(VENV)/bin/hprune train hydra.run.dir=outputs/demo
	$(VENV)/bin/hprune eval ckpt=outputs/demo hydra.run.dir=outputs/demo/eval
	# Michel et al.: the three attention types pooled, against three other orders; every type removed whole
	# (latency.measure: the chosen mask's latency in CTranslate2, for the report's accuracy-latency frontier)
	$(VENV)/bin/hprune prune --method michel ckpt=outputs/demo prune.step_pct=25 \
		"prune.baselines=[random,confidence,lrp]" "prune.ablations=[types]" latency.measure=true \
		hydra.run.dir=outputs/demo/prune
	# Kwon et al.: the heads that fit in half the attention MACs, without retraining; then their whole framework,
	# heads and FFN neurons under one budget, half the MACs of both
	$(VENV)/bin/hprune prune --method fisher ckpt=outputs/demo prune.macs_budget=0.5 latency.measure=true \
		hydra.run.dir=outputs/demo/fisher
	$(VENV)/bin/hprune prune --method fisher ckpt=outputs/demo prune.macs_budget=0.5 "prune.units=[heads,neurons]" \
		latency.measure=true hydra.run.dir=outputs/demo/fisher_ffn
	# what that deep cut costs, won back: the pruned model trained on for 100 updates towards the unpruned model's
	# distribution (word-level distillation); the report's frontier joins it to its pruned point
	$(VENV)/bin/hprune recover ckpt=outputs/demo mask=outputs/demo/fisher_ffn recovery.loss=word \
		recovery.updates=100 hydra.run.dir=outputs/demo/fisher_ffn_recovered
	# Voita et al.: gates on the encoder self-attention; λ = 0 is the control (the same extra training, no penalty)
	$(VENV)/bin/hprune prune --method voita -m ckpt=outputs/demo prune.l0_lambda=0,1,4 \
		prune.optim.max_update=400 prune.optim.lr=0.005 hydra.sweep.dir=outputs/demo/voita
	# Voita et al.'s finding tested where this model has heads with a role: gates on the encoder-decoder heads,
	# whose alignment heads are the role; do they stay open at higher λ (the summary's permutation test)?
	# lr 0.01: 400 updates move a gate's log α by up to 4, past the ~2.4 it needs to close
	$(VENV)/bin/hprune prune --method voita -m ckpt=outputs/demo "prune.types=[dec-enc]" prune.freeze_decoder=false \
		prune.l0_lambda=1,2,4,8 prune.optim.max_update=400 prune.optim.lr=0.01 hydra.sweep.dir=outputs/demo/voita_dec_enc
	# head roles of the start model (all three attention types, alignment heads against the generator's gold
	# alignments), which survived the strongest λ, and the attention maps of two sentences (drawn in the report)
	$(VENV)/bin/hprune analyze ckpt=outputs/demo mask=outputs/demo/voita/2/head_mask.json dump=2 \
		hydra.run.dir=outputs/demo/analyze
	$(VENV)/bin/hprune report outputs/demo hydra.run.dir=outputs/demo/report > /dev/null
	$(PY) scripts/demo_summary.py outputs/demo

test: install ## run the test suite (without tests marked slow), on two workers (a test file stays on one)
	$(PY) -m pytest -m "not slow" -n 2 --dist loadfile $(PYTEST_ARGS)

test-full: install ## run every test, slow ones included
	$(PY) -m pytest $(PYTEST_ARGS)

docs-check: demo ## the demo run afresh, then the figures README.md and docs/ quote checked against it and outputs/study (scripts/doc_figures.py)
	$(PY) scripts/doc_figures.py --check

bench: install ## benchmarks: ratios measured side by side (scripts/bench/)
	@for script in $(filter-out %/common.py,$(wildcard scripts/bench/*.py)); do \
		echo "== $$script"; $(PY) $$script || exit 1; done

lint: install ## static checks
	$(VENV)/bin/ruff check cli src tests scripts

clean: ## remove the venv, build files and run outputs (not the data cache)
	rm -rf $(VENV) build dist *.egg-info src/*.egg-info outputs multirun .pytest_cache

.PHONY: help install demo test test-full docs-check bench lint clean
