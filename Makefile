# One set-up path for users and CI. `make test` on a fresh clone does all set-up and runs the suite.
PYTHON ?= $(shell command -v python3.12 2>/dev/null || echo python3)
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup test test-all serve clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev]" --config-settings editable_mode=compat
	@touch $(STAMP)

setup: $(STAMP)

# CI: everything but the `slow` tier (full-size codec parity, the experiment harnesses end to end, in-model repeats
# of kernel-level checks); the slowest tests are listed at the end, to keep the suite inside CI's 15 minutes
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile -m "not slow" --durations=15 tests

test-all: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile tests

serve: $(STAMP)
	$(PY) -m serving.launch $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
