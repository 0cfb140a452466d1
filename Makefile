# One set-up path for users and CI. `make test` on a fresh clone does all set-up and runs the suite.
PYTHON ?= $(shell command -v python3.12 2>/dev/null || echo python3)
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup deviceless test test-all serve clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev]" --config-settings editable_mode=compat
	@touch $(STAMP)

setup: $(STAMP)

# XLA's CUDA compiler for deviceless AOT (kernels/h200_lowering.py compile_for_h200, experiments/hlo_census.py): the
# H200 machine's CUDA 13 plugin, kept out of the venv so that no other process tries to start CUDA
DEVICELESS := .deviceless/.installed
$(DEVICELESS): $(STAMP)
	$(PY) -m pip install -q --no-deps --upgrade --target .deviceless jax-cuda13-plugin==0.11.2 jax-cuda13-pjrt==0.11.2
	@touch $@

deviceless: $(DEVICELESS)

# CI: everything but the `slow` tier (full-size codec parity, the experiment harnesses end to end, in-model repeats
# of kernel-level checks); the slowest tests are listed at the end, to keep the suite inside CI's 15 minutes
test: $(STAMP) $(DEVICELESS)
	$(PY) -m pytest -q -n 2 --dist loadfile -m "not slow" --durations=15 tests

test-all: $(STAMP) $(DEVICELESS)
	$(PY) -m pytest -q -n 2 --dist loadfile tests

serve: $(STAMP)
	$(PY) -m serving.launch $(ARGS)

clean:
	rm -rf $(VENV) .deviceless .pytest_cache
