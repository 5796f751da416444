# Two commands: `make serve` (serve the default model) and `make test` (the whole suite).
# Both start from a fresh machine: a virtual environment, pinned dependencies (CPU torch unless
# an NVIDIA GPU is present), tritonserver + the Python backend from the nvidia-pytriton wheel,
# and the default model. Stamp files in .work/stamps make the second run skip finished steps.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
WORK := .work
STAMPS := $(WORK)/stamps
# passing tests' tmp_path folders are removed at the end (a clean venv with torch is GBs a run)
PYTEST_ARGS ?= -q -ra --timeout=900 --durations=25 -o tmp_path_retention_policy=failed

export TRITON_HTTP_PORT ?= 8000
export TRITON_GRPC_PORT ?= 8001
export TRITON_METRICS_PORT ?= 8002
# the OpenAI-compatible server `make serve` starts beside tritonserver (specguide.openai_api)
export OPENAI_PORT ?= 9000
# The repository `make serve` serves; `make serve MODEL_REPOSITORY=DIR` serves your own copy
# (docs/own-model.md), and `draft-head` trains the head of the model its config.pbtxt names.
export MODEL_REPOSITORY ?= model_repository

.PHONY: all setup serve test test-unit test-integration model draft-head clean

all: setup

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade "pip>=24"

$(STAMPS)/torch: scripts/install_torch.sh | $(PY)
	scripts/install_torch.sh $(PY)
	@mkdir -p $(STAMPS) && touch $@

$(STAMPS)/deps: requirements.txt requirements-test.txt requirements-nodeps.txt backend_src/pyproject.toml $(STAMPS)/torch
	$(PIP) install -r requirements.txt -r requirements-test.txt
	$(PIP) install --no-deps -r requirements-nodeps.txt
	$(PIP) install -e backend_src
	@mkdir -p $(STAMPS) && touch $@

$(STAMPS)/tritonserver: scripts/tritonserver.py $(STAMPS)/deps
	$(PY) scripts/tritonserver.py setup
	@mkdir -p $(STAMPS) && touch $@

# Cheap when the converted model is already in the cache; converts the GGUF once otherwise.
model: $(STAMPS)/deps
	$(PY) -m specguide.models.default_model

setup: $(STAMPS)/tritonserver model

# The trained draft head of the "hybrid"/"head" drafters, for the model MODEL_REPOSITORY serves:
# trained once into the model cache by the project's own script and recipe (deterministic from its
# seed; ~7 min on 2 Zen 4 cores for the default model, ~15 on an AVX2-only Zen 3). `make test` makes it up front, so the suite
# runs what `make serve` serves; `make serve` does not wait for it: the server trains a missing head
# in the background (config.pbtxt's draft_head_training). DRAFT_HEAD=skip goes without it.
DRAFT_HEAD ?= train
draft-head: setup
ifeq ($(DRAFT_HEAD),skip)
	@echo "draft head skipped; train it later with: $(PY) scripts/train_draft_head.py --model-repository $(MODEL_REPOSITORY)"
else
	$(PY) scripts/train_draft_head.py --if-missing --model-repository $(MODEL_REPOSITORY)
endif

# tritonserver (under the supervisor) and, beside it, the OpenAI-compatible server on 127.0.0.1:$(OPENAI_PORT),
# which talks to it over gRPC; it stops with the recipe
serve: setup
	$(PY) -m specguide.openai_api --port $(OPENAI_PORT) & api=$$!; trap 'kill $$api 2>/dev/null' EXIT INT TERM; \
	$(PY) scripts/tritonserver.py serve

test: setup draft-head
	$(PY) -m pytest $(PYTEST_ARGS) tests

test-unit: setup
	$(PY) -m pytest $(PYTEST_ARGS) tests --ignore=tests/integration

test-integration: setup
	$(PY) -m pytest $(PYTEST_ARGS) tests/integration

clean:
	rm -rf $(WORK)
