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

# Every benchmark with the command docs/benchmarks.md records (about 40 minutes on 2 cores).
BENCH_CACHE ?= /tmp/tether-bench-cache
bench: $(STAMP)
	$(BIN)/pip install -q -e ".[dev,bench]"
	$(BIN)/python bench/grpo_step.py --rounds 2 --threads 1
	$(BIN)/python bench/engine_throughput.py --threads 2
	$(BIN)/python bench/engine_throughput.py --threads 2 --dtype bfloat16
	$(BIN)/python bench/long_prompt_prefill.py --threads 2
	$(BIN)/python bench/spec_decode.py --cache-dir $(BENCH_CACHE)/spec
	$(BIN)/python bench/async_rl.py --sft-steps 400 --rl-steps 150 --sft-cache $(BENCH_CACHE) \
		--variants sync,sync_1t,s1,s1_noboot,s2,s2_cut,s4_ppo_behav,s4 --repeats 3
	$(BIN)/python bench/trl_reward.py --sft-steps 800 --rl-steps 200 --sft-cache $(BENCH_CACHE) \
		--variants sync_1t,s1,s2

clean:
	rm -rf $(VENV) runs .pytest_cache
