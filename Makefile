# Set-up is part of every target: a fresh clone needs only `make train` or `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: train test bench

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

train: $(VENV)/.installed
	$(VENV)/bin/accelerate launch -q --num_processes 1 --num_machines 1 --mixed_precision no --dynamo_backend no \
		train.py --attn axial

test: $(VENV)/.installed
	$(PY) -m pytest -q

bench: $(VENV)/.installed
	$(VENV)/bin/visattn-bench
