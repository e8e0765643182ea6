# Quick start: `make run` (train the default experiment), `make test` (run the tests).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# A fake 8-device CPU mesh; harmless on accelerators (it only affects the host platform).
export XLA_FLAGS ?= --xla_force_host_platform_device_count=8

.PHONY: run test clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PY) -m pip install --quiet -e ".[test]"
	touch $@

run: $(VENV)/.installed
	$(PY) -m train.main --config=configs/default.py $(ARGS)

test: $(VENV)/.installed-test
	$(PY) -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) runs
