# The pipeline, one target per stage. Every target only calls `python -m pipeline <stage>`.
# Variables: MODEL (Hub id, local dir, tiny, tiny-moe), TARGET (cpu|cuda|trn2, detected),
# STEPS, SEQ_LEN, DRY_RUN=1, RUN (hf|native|nki, for export/verify), IN_CONTAINER=1 and IMAGE.
SHELL := /bin/bash
# glibc returns large buffers to the OS after every step on CPU otherwise (page-fault bound).
export MALLOC_MMAP_THRESHOLD_ ?= 4294967296
export MALLOC_TRIM_THRESHOLD_ ?= 4294967296
.DEFAULT_GOAL := help

VENV ?= .venv
PY := $(VENV)/bin/python
HAS_NEURON := $(wildcard /dev/neuron0)
MODEL ?= $(if $(HAS_NEURON),Qwen/Qwen3-4B-Instruct-2507,tiny)
RUN ?= native
TRAIN_FLAGS := --model $(MODEL) $(if $(TARGET),--target $(TARGET)) $(if $(STEPS),--steps $(STEPS)) \
               $(if $(SEQ_LEN),--seq-len $(SEQ_LEN)) $(if $(DRY_RUN),--dry-run) $(if $(FRESH),--fresh)
HOST_PIPE := $(PY) -m pipeline
# IN_CONTAINER=1: every stage runs inside the image (IMAGE, default the lock-derived tag) through
# `python -m pipeline image --run`; image, doctor and launch-* always run on the host.
PIPE := $(if $(IN_CONTAINER),$(HOST_PIPE) image $(if $(IMAGE),--image $(IMAGE)) --run,$(HOST_PIPE))
EMBEDDED_MODELS := tiny tiny-moe

.PHONY: help setup download data train-hf train-native train-nki export verify-checkpoint verify-kernels report \
        image doctor launch-slurm launch-eks pipeline test bench clean

help: ## list the targets
	@grep -hE '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-18s %s\n", $$1, $$2}'

setup: $(VENV)/.installed ## build .venv from requirements-dev.lock (re-runs only when the lock changes)
$(VENV)/.installed: requirements-dev.lock
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements-dev.lock
	touch $@

download: setup ## checkpoints/<name>/hf from the Hub, a local dir, or the embedded tiny/tiny-moe
	$(PIPE) download --model $(MODEL)

data: setup ## the training text (held-out corpus for the embedded defaults)
	$(PIPE) data --model $(MODEL)

train-hf: setup ## Transformers v5 Qwen3 (AutoModelForCausalLM) trained by torchtitan
	$(PIPE) train --path hf $(TRAIN_FLAGS)

train-native: setup ## torchtitan's own Qwen3 (dense and MoE), weights from the HF checkpoint
	$(PIPE) train --path native $(TRAIN_FLAGS)

train-nki: setup ## native Qwen3 with NKI kernels (RoPE, MoE) via torchtitan's override registry
	$(PIPE) train --path nki $(TRAIN_FLAGS)

export: setup ## HF safetensors of a run's last checkpoint: checkpoints/<name>/<RUN>/export
	$(PIPE) export --model $(MODEL) --run $(RUN) $(if $(FORCE),--force) $(if $(DTYPE),--dtype $(DTYPE)) \
	  $(if $(MAX_SHARD_SIZE),--max-shard-size $(MAX_SHARD_SIZE))

verify-checkpoint: setup ## reload an export: zero missing keys, tensors, step-1 loss → verify.json
	$(PIPE) verify $(if $(CHECKPOINT),--checkpoint $(CHECKPOINT) --reference $(REFERENCE),--model $(MODEL) --run $(RUN))

verify-kernels: setup ## every NKI override vs its reference (fwd+bwd), table of errors
	$(PIPE) verify-kernels $(if $(TARGET),--target $(TARGET))

report: setup ## loss curves and summary of every run of MODEL → checkpoints/<name>/report
	$(PIPE) report --model $(MODEL)

image: setup ## build the container image (Docker SDK), tag from the lock's hash
	$(HOST_PIPE) image $(if $(BASE_IMAGE),--base-image $(BASE_IMAGE))

doctor: setup ## what this host has vs what the pipeline needs
	$(HOST_PIPE) doctor

launch-slurm: setup ## render an sbatch script for NODES trn2 nodes
	$(HOST_PIPE) launch --scheduler slurm --nodes $(or $(NODES),2) --model $(MODEL)

launch-eks: setup ## render Kubernetes manifests for NODES trn2 nodes
	$(HOST_PIPE) launch --scheduler eks --nodes $(or $(NODES),2) --model $(MODEL)

pipeline: setup ## the whole pipeline on the embedded defaults (tiny and tiny-moe)
	set -e; for m in $(EMBEDDED_MODELS); do \
	  $(MAKE) --no-print-directory download data MODEL=$$m; \
	  for p in hf native nki; do \
	    $(MAKE) --no-print-directory train-$$p MODEL=$$m FRESH=1; \
	    $(MAKE) --no-print-directory export verify-checkpoint MODEL=$$m RUN=$$p FORCE=1 DTYPE=fp32; \
	  done; \
	  $(MAKE) --no-print-directory report MODEL=$$m; \
	done

test: setup ## the test suite (CPU only)
	$(PY) -m pytest -q tests

bench: setup ## measure overhead, time to first step, scaling, export/verify, memory → bench/results.json (BENCH_REPEATS, BENCH_ONLY)
	BENCH_REPEATS=$(BENCH_REPEATS) BENCH_ONLY=$(BENCH_ONLY) $(PY) bench/run.py

clean: ## remove every output under checkpoints/ (keeps the venv)
	find checkpoints -mindepth 1 -maxdepth 1 ! -name README.md -exec rm -rf {} +
