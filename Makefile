# Quick start: `make run` (train the default experiment), `make test` (run the tests).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# When JAX runs on the CPU, train.cli.train fakes placement.cpu_devices (8) host devices for its
# mesh (sharding/host.py); the tests always run on 8 fake CPU devices (tests/conftest.py).

.PHONY: run test notebook clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PY) -m pip install --quiet -e ".[test]"
	touch $@

run: $(VENV)/.installed
	$(PY) -m train.cli.train --config=configs/default.py $(ARGS)

# The suite in TEST_WORKERS processes (pytest-xdist), each test file whole in one of them (its
# module fixtures built once); TEST_WORKERS=0 runs it in this one.
TEST_WORKERS ?= 2
test: $(VENV)/.installed-test
	$(PY) -m pytest -q $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile) $(PYTEST_ARGS)

# JupyterLab on the quickstart notebook (the notebook extra: JupyterLab and a kernel).
$(VENV)/.installed-notebook: $(VENV)/.installed
	$(PY) -m pip install --quiet -e ".[notebook]"
	touch $@

notebook: $(VENV)/.installed-notebook
	$(VENV)/bin/jupyter lab notebooks/quickstart.ipynb

clean:
	rm -rf $(VENV) runs
