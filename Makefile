# Set-up is part of every target: a fresh clone needs only `make train` or `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: train test test-fast bench device-check docs check-wheel

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

# The documentation site's tools, on top of the package's environment.
$(VENV)/.installed-docs: $(VENV)/.installed pyproject.toml
	$(PY) -m pip install --quiet -e '.[test,docs]'
	touch $@

# Again: a finished run prints where its results are; an interrupted one resumes from its last checkpoint.
TRAIN_RUN_DIR := runs/digits-axial
train: $(VENV)/.installed
	$(VENV)/bin/accelerate launch -q --num_processes 1 --num_machines 1 --mixed_precision no --dynamo_backend no \
		train.py --attn axial --run-dir $(TRAIN_RUN_DIR) \
		$(if $(wildcard $(TRAIN_RUN_DIR)/checkpoints/step_*),$(if $(wildcard $(TRAIN_RUN_DIR)/summary.json),,--resume))

test: $(VENV)/.installed
	$(PY) -m pytest -q

# The edit-test loop: ops, layers, models and tiled inference; no training, no subprocess, no torch.compile.
test-fast: $(VENV)/.installed
	$(PY) -m pytest -q tests/ops tests/layers tests/models tests/tiled -m "not slow and not compile and not cuda"

bench: $(VENV)/.installed
	$(VENV)/bin/visattn-bench

# On a machine with an NVIDIA GPU: the cuda tests, the Triton kernels beside the paths they replace and the GPU
# benchmark rows, into $(DEVICE_CHECK_OUT); STAGES="infer_2048_previous train_1024_previous train_run" runs the rows on
# the paths before the kernels and a short bf16 training run instead, STAGES="profile_train_1024 profile_2048
# profile_224 max_tokens compile_1024" the kernel profiles, the largest grid each type trains at and compiled rows;
# MAX_TOKENS_ROWS (with max_tokens in STAGES) replaces that search's rows (see scripts/device_check.sh).
DEVICE_CHECK_OUT ?= device_check_out
device-check:
	OUT=$(DEVICE_CHECK_OUT) PYTHON=$(PYTHON) bash scripts/device_check.sh

# The wheel a release would publish, installed with its train and bench extras into a fresh virtual environment
# outside the clone, its commands started there (scripts/check_wheel.sh; minutes, most of them installing torch).
check-wheel:
	PYTHON=$(PYTHON) bash scripts/check_wheel.sh

# The documentation site into site/, warnings as errors (scripts/docs_hooks.py writes the pages' generated parts).
docs: $(VENV)/.installed-docs
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict
