#!/usr/bin/env bash
# The package as a user installs it: build the wheel, install it with its train and bench extras into a fresh
# virtual environment outside the clone, and start its commands there (the two console scripts, and an import of
# every module that builds and runs a model), so that a module, a dependency or an entry point the wheel lacks
# fails here and not for a user.
#   bash scripts/check_wheel.sh          (make check-wheel; CI runs it after the test suite)
# PYTHON (python3) builds the wheel and the environment; pip takes the dependencies as it is configured (torch from
# the machine's local package files where it has them). Prints the time of each step and of the whole check.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/visattn-wheel.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
START=$SECONDS
step() { echo "== $1 (at $((SECONDS - START)) s)"; }

# Built from a copy of what the package is made of, so that no build/ folder of an earlier build in the clone
# (setuptools packs what it finds there) can hide a missing file.
step "build the wheel"
mkdir "$WORK/src"
tar --exclude=__pycache__ -cf - pyproject.toml README.md visattn | tar -xf - -C "$WORK/src"
"$PYTHON" -m pip wheel --no-deps --quiet --wheel-dir "$WORK/dist" "$WORK/src"
WHEEL=$(ls "$WORK"/dist/visattn-*.whl)

step "install $(basename "$WHEEL") with its train and bench extras into a fresh virtual environment"
"$PYTHON" -m venv "$WORK/venv"
"$WORK/venv/bin/python" -m pip install --quiet "$WHEEL[train,bench]"

step "start its commands, outside the clone"
cd "$WORK"
venv/bin/visattn-bench --help >/dev/null
venv/bin/visattn-predict --help >/dev/null
venv/bin/python - <<'EOF'
import importlib
import pkgutil

import timm
import torch

import visattn

assert "site-packages" in visattn.__file__, f"visattn imported from {visattn.__file__}, not from the wheel"
modules = [info.name for info in pkgutil.walk_packages(visattn.__path__, "visattn.")]
assert len(modules) > 20, f"the wheel holds only {modules}"
for name in modules:
    importlib.import_module(name)
model = timm.create_model("visattn_vit_tiny_patch16", attn="axial", img_size=64, depth=2, num_classes=3,
                          dynamic_img_size=True)
logits = model(torch.randn(2, 3, 64, 48))
assert logits.shape == (2, 3), logits.shape
print(f"{len(modules)} modules imported; attention types {', '.join(visattn.list_attentions())}; "
      f"a 2-block model on a 4x3 grid: logits {tuple(logits.shape)}")
EOF
echo "wheel check passed in $((SECONDS - START)) s"
