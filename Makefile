# One-command set-up: every target creates .venv when missing and installs what it needs.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_VERSION := 2.13.0

.PHONY: demo test lint bench clean setup device-wheels device-cache

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

# A lent GPU machine has torch and numpy but no network: bench/device_check.sh (the GPU checks) runs
# there with what these two prepare here, each in a folder git ignores and the device tool carries.
# device-wheels: Python 3.12 x86-64 wheels, at this .venv's versions, of what the image lacks (pydantic) or
# holds at other versions (transformers and its hub); numpy is left to the image's torch.
device-wheels: $(STAMP)
	rm -rf .whl && mkdir .whl
	$(BIN)/pip freeze --exclude-editable > .whl/constraints.txt
	$(BIN)/pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-c .whl/constraints.txt -d .whl transformers pydantic pyyaml rich
	rm -f .whl/numpy-*.whl
	du -sh .whl

# device-cache: the spec-decode bench's trained models (it also runs the bench here, on the CPU).
device-cache: $(STAMP)
	$(BIN)/python bench/spec_decode.py --cache-dir .device-cache/spec
