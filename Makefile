# The two commands of the README: `make demo` (set up, build the small local model, run
# async GRPO on the CPU default) and `make test` (set up, lint, type-check, run every tier).
VENV ?= .venv
BIN := $(VENV)/bin
MODEL ?= runs/small-model
CONFIG ?= examples/cpu_default.toml
LONGTAIL_MODEL ?= runs/longtail-model
CALCULATOR_MODEL ?= runs/calculator-model

.PHONY: setup verifiers demo demo-longtail demo-tools test test-fast lint unit integration bench clean

setup:
	@scripts/setup-venv.sh

# verifiers in a virtualenv of its own (.venv-verifiers), for examples/agent_verifiers.toml:
# its pins cannot share .venv (docs/agents.md, verifiers).
verifiers:
	@scripts/setup-verifiers.sh

$(MODEL)/config.json: | setup
	$(BIN)/async-rl make-model --size small --out $(MODEL)

demo: setup $(MODEL)/config.json
	$(BIN)/async-rl train $(CONFIG) --overwrite

$(LONGTAIL_MODEL)/config.json: | setup
	$(BIN)/async-rl make-model --task longtail --out $(LONGTAIL_MODEL)

# The long-tail reasoning workload (completions of 20 to 300 tokens).
demo-longtail: setup $(LONGTAIL_MODEL)/config.json
	$(BIN)/async-rl train examples/cpu_longtail.toml --overwrite

$(CALCULATOR_MODEL)/config.json: | setup
	$(BIN)/async-rl make-model --task calculator --out $(CALCULATOR_MODEL)

# Multi-turn tool use: the calculator task, the tool answering each <call>.
demo-tools: setup $(CALCULATOR_MODEL)/config.json
	$(BIN)/async-rl train examples/cpu_tools.toml --overwrite

lint: setup
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/lint-imports

# The unit tier (no Ray) in two pytest-xdist processes: it is mostly imports and short
# waits. `make test-fast` is the same command.
unit test-fast: setup
	$(BIN)/python -m pytest tests/unit -q -n 2

integration: setup
	$(BIN)/python -m pytest tests/integration -q -n 2 --dist loadscope --no-loadscope-reorder

# The test models build in the background while ruff, lint-imports and the unit tier
# (two xdist processes) run (the learnable model's warm start is about two minutes): a
# test that needs a model meanwhile waits on the model cache's lock instead of building
# it.
# Then the Ray tiers in two xdist processes, a test module to each at a time (its module
# fixtures run once), the longest modules first (tests/integration/conftest.py): one
# run leaves a core idle about 45% of the time while it starts Ray and vLLM, and two
# side by side took 22 min against 26 in one. mypy runs beside them at the lowest
# priority, in the cores' idle moments (about 10% of the tiers' time): single-threaded
# and without a cache in a fresh clone it takes about 90 CPU-seconds, which beside the
# unit tier lengthened it by about 45 s. It has no clock to miss; the unit tier, whose
# timeouts are real, stays at normal priority. A type error stops the tiers.
# .venv-verifiers first (once; a minute or so on a cold pip cache): the unit tier plays the
# verifiers example through its real process, and fails here without it (elsewhere those
# tests skip).
test: setup verifiers
	$(BIN)/python tests/models.py & models=$$!; \
	  { $(BIN)/ruff check . && $(BIN)/lint-imports \
	    && ASYNC_RL_VERIFIERS_REQUIRED=1 $(BIN)/python -m pytest tests/unit -q -n 2 \
	      --durations=5; } \
	    || { kill $$models; exit 1; }; \
	  wait $$models
	$(BIN)/python -m pytest tests/integration tests/gpu -q -n 2 --dist loadscope \
	  --no-loadscope-reorder --durations=10 & tiers=$$!; \
	  nice -n 19 $(BIN)/mypy || { kill $$tiers; wait $$tiers; exit 1; }; \
	  wait $$tiers

# The benchmarks that need neither a model nor Ray (bench/README.md lists every one, each
# run as python -m bench.FOLDER.SCRIPT from here).
bench: setup
	$(BIN)/python -m bench.data.balance
	$(BIN)/python -m bench.data.replay_queue

clean:
	rm -rf runs .pytest_cache .mypy_cache .ruff_cache
