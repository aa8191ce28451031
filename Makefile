# One-command set-up: every target creates .venv when missing and installs what it needs.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_VERSION := 2.13.0

.PHONY: demo test lint bench clean setup

setup: $(STAMP)

# torch is installed first and pinned: with no torch present, an unpinned requirement would pull a
# multi-GB CUDA build. torch==2.13.0 resolves to the CPU wheel on these machines.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "torch==$(TORCH_VERSION)"
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/tether demo

test: $(STAMP)
	$(BIN)/ruff check src tests bench examples
	$(BIN)/pytest -n 2 -q tests

bench: $(STAMP)
	$(BIN)/pip install -q -e ".[dev,bench]"
	$(BIN)/python bench/grpo_step.py

clean:
	rm -rf $(VENV) runs .pytest_cache
