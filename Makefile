# Two commands do all set-up on a fresh machine: `make train` and `make test`.
PYTHON ?= python3
TORCH_VERSION ?= 2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
CONFIG ?= configs/cartpole.yaml

.PHONY: train test test-fast test-long bench bench-multimodal bench-sb3 bench-pong bench-pong-learning install clean docs

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# On an Ascend host (its NPUs appear as /dev/davinci*): torch_npu needs the CPU build of torch, which for x86 PyPI
# does not serve (its torch wheel is the CUDA build); PyTorch's CPU index does. Elsewhere the registry's wheel.
TORCH_INDEX ?= $(if $(wildcard /dev/davinci*),--index-url https://download.pytorch.org/whl/cpu,)

# torch first and pinned: with no torch installed, a plain "torch" requirement pulls a multi-GB CUDA build.
# `make train` installs the core only (what training the default config imports: pyproject's dependencies);
# `make test` adds the test extra (the optional sinks, envs and tools the suite exercises) on top of it.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet torch==$(TORCH_VERSION) $(TORCH_INDEX)
	$(BIN)/python -m pip install --quiet -e .
	touch $@

$(TEST_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $@

install: $(STAMP)

train: $(STAMP)
	$(BIN)/python -m cluster.train --config $(CONFIG)

# Two pytest workers (pytest-xdist), each with its own local Ray: most Ray-mode tests spend part of their time
# waiting on deadlines and start-up, so two of them keep 2 cores busy (README, Tests). `make test` leaves the `long`
# tests to `make test-long`. `make test PYTEST_WORKERS=0` runs it serially in one process.
PYTEST_WORKERS ?= 2
# pytest exits 5 when it collected nothing: that is a failure here, said out loud.
test: $(TEST_STAMP)
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadgroup; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; fi; exit $$rc

test-fast: $(TEST_STAMP)
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadgroup -m "not slow"

# The `long` tests, which `make test` leaves out to keep the dev loop near its 8-minute goal: the learning runs
# trained to a threshold, the larger layouts of what `make test` runs once, and the end-to-end runs through other
# tools (`ray job submit`, Tune). CI (`.ci/run`) runs this after `make test`, so every test runs before a change lands.
test-long: $(TEST_STAMP)
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadgroup -m long; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test-long: pytest collected no tests" >&2; fi; exit $$rc

# The throughput benchmarks, one after the other (about 8 minutes; ratios are measured within each script's own run).
bench: $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[multimodal]'
	$(BIN)/python bench/cartpole.py
	$(BIN)/python bench/feed.py
	$(BIN)/python bench/replay_throughput.py
	$(BIN)/python bench/control_plane.py
	$(BIN)/python bench/rollout_scaling.py
	$(BIN)/python bench/layouts.py

# The multimodal learning benches (about 12 minutes: each trains a full model and an ablation).
bench-multimodal: $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[multimodal,minigrid]'
	$(BIN)/python bench/multirate.py
	$(BIN)/python bench/minigrid_fetch.py

bench-sb3: $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[sb3]'
	$(BIN)/python bench/vs_sb3.py

# Atari Pong against SB3 and Sample Factory (bench/pong.py; about 12 minutes). Its own environments, so the project's
# .venv stays as `make test` expects: .venv-bench (ours with the atari and sb3 extras) and .venv-bench-sf (Sample
# Factory 2.1, which pins gymnasium < 1.0, below what ours imports; ale-py for its Atari envs).
BENCH_VENV := .venv-bench
SF_VENV := .venv-bench-sf
$(BENCH_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/python -m pip install --quiet torch==$(TORCH_VERSION) $(TORCH_INDEX)
	$(BENCH_VENV)/bin/python -m pip install --quiet -e '.[atari,sb3]'
	touch $@

$(SF_VENV)/.installed:
	$(PYTHON) -m venv $(SF_VENV)
	$(SF_VENV)/bin/python -m pip install --quiet torch==$(TORCH_VERSION) $(TORCH_INDEX)
	$(SF_VENV)/bin/python -m pip install --quiet 'sample-factory==2.1.1' 'ale-py>=0.9'
	touch $@

bench-pong: $(BENCH_VENV)/.installed $(SF_VENV)/.installed
	$(BENCH_VENV)/bin/python bench/pong.py

# The learning check: 1M env steps of ours and SB3, seeds 0-1, return against env steps; the four processes side by
# side (--jobs 4: no time compared), SB3 on one torch thread, its cheapest per env step (about 2 hours on 2 cores).
bench-pong-learning: $(BENCH_VENV)/.installed
	$(BENCH_VENV)/bin/python bench/pong.py --no-stages --systems inprocess sb3 --steps 1000000 --rounds 2 \
		--jobs 4 --sb3-threads 1 --max-seconds 10800 --curves

clean:
	rm -rf $(VENV) $(BENCH_VENV) $(SF_VENV) runs .pytest_cache

# Regenerate the configuration reference (docs/configuration.md) from the schema (a test fails when it is stale).
docs: $(STAMP)
	$(BIN)/python -m cluster.config --update-reference docs/configuration.md
