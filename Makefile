# specdec: every target creates .venv and installs pinned dependencies on first use.
#   make test    the test suite (what CI runs)
#   make demo    the main job: fetch the default models and run a short speculative generation
#   make lint    ruff check + format check
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

# llama-cpp-python is compiled from source: portable x86-64 (AVX2) kernels rather than -march=native
# so the cached wheel works on any CI machine, and none of the examples, tools or servers we never use.
export CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF
export CMAKE_BUILD_PARALLEL_LEVEL ?= 2

TARGET ?= llamacpp:qwen2.5-coder-1.5b
DRAFT  ?= llamacpp:qwen2.5-coder-0.5b

.PHONY: venv test lint demo clean

venv: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip wheel
	$(BIN)/python -m pip install --quiet -r requirements.txt
	$(BIN)/python -m pip install --quiet --no-deps -e .
	touch $@

test: venv
	$(BIN)/python -m pytest -q

lint: venv
	$(BIN)/ruff check src tests
	$(BIN)/ruff format --check src tests

demo: venv
	$(BIN)/specdec models fetch qwen2.5-coder-0.5b qwen2.5-coder-1.5b
	$(BIN)/specdec generate --target $(TARGET) --draft $(DRAFT) -k 4 -t 0 --max-new-tokens 96 \
	  "Rewrite this function with type hints and a docstring: def area(w, h): return w * h"

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache src/*.egg-info
