"""The README's import paths and module names resolve, and its commands start."""
from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()

_DOTTED = r"\bvisattn(?:\.[A-Za-z_]\w*)+"
# `visattn.a.b` (a module, or attributes of one) and `from visattn.a import b, c` as the README writes them.
DOTTED = sorted(set(re.findall(_DOTTED, README)))
FROM_IMPORTS = sorted(
    {(module, name.strip()) for module, names in re.findall(r"from (visattn[\w.]*) import ([\w, ]+)", README) for name in names.split(",")}
)
# Paths of the source tree the README names.
FILES = sorted(set(re.findall(r"`((?:visattn|tests|configs|scripts|docs)/[\w./-]*\w)`", README)))


def _resolve(dotted: str) -> object:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


def test_the_readme_names_import_paths():
    assert len(DOTTED) > 5 and FROM_IMPORTS and FILES


@pytest.mark.filterwarnings("error::DeprecationWarning")
@pytest.mark.parametrize("dotted", DOTTED)
def test_dotted_path_resolves(dotted):
    _resolve(dotted)


@pytest.mark.filterwarnings("error::DeprecationWarning")
@pytest.mark.parametrize("module, name", FROM_IMPORTS, ids=[f"{m}.{n}" for m, n in FROM_IMPORTS])
def test_from_import_resolves(module, name):
    assert hasattr(importlib.import_module(module), name)


@pytest.mark.parametrize("path", FILES)
def test_named_file_exists(path):
    assert (REPO / path).exists(), f"the README names {path}, which does not exist"


@pytest.mark.parametrize(
    "command",
    [[sys.executable, "train.py", "--help"], [sys.executable, "-m", "visattn.bench", "--help"]],
    ids=["train.py", "visattn-bench"],
)
def test_commands_print_their_help(command):
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "usage:" in result.stdout
