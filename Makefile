# `make demo` runs the main job (a tiny NLAC run on the CPU, no downloads); `make test` runs the test-suite.
# Both create/refresh the virtual environment in $(VENV) first, so they work on a fresh clone.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

.PHONY: install demo test bench clean

$(STAMP): requirements.txt requirements-test.txt pyproject.toml $(wildcard requirements-envs.txt requirements-nodeps.txt)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -r requirements-test.txt $(if $(wildcard requirements-envs.txt),-r requirements-envs.txt)
	$(PIP) install -q --no-deps -r requirements-nodeps.txt
	$(PIP) install -q --no-deps -e .
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m nlac_jax.demo

test: $(STAMP)
	$(PY) -m pytest -q --durations=15

clean:
	rm -rf $(VENV) runs .pytest_cache
