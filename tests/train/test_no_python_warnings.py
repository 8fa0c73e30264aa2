"""A tiny CPU run, started as a new user starts it, raises no Python warning: what a user should hear, the run
says itself in one line (`warning: ...`, `notice: ...`) with what to do; a library's warning about a call of
ours is fixed at the call, not left for the user to read."""
from __future__ import annotations

import re
import warnings

import pytest

from tests.train.test_gpu_ready import fresh_accelerate_state  # noqa: F401  (a fixture)
from tests.train.test_train import TINY, train

# The digits recipe as it stands; a GPU recipe's data loader workers (8, more than this machine's cores) and bf16
# autocast on the CPU, over the same digits.
RECIPES = {
    "digits": [],
    "imagefolder-recipe-on-cpu": ["--config", "configs/imagefolder.yaml", "--dataset", "digits", "--data-dir", ""],
}
# How Python prints a warning (warnings.formatwarning), as a data loader worker process would write it.
PRINTED_WARNING = re.compile(r"\b\w*Warning: ")


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_a_tiny_cpu_run_raises_no_python_warning(recipe, tmp_path, capfd, fresh_accelerate_state):
    args = [*RECIPES[recipe], *TINY, "--epochs", "1", "--warmup-epochs", "0", "--run-dir", str(tmp_path / "run")]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert train.main(args) == 0
    out, err = capfd.readouterr()
    assert "test accuracy:" in out, err[-3000:]
    raised = [f"{w.filename}:{w.lineno}: {w.category.__name__}: {w.message}" for w in caught]
    assert raised == []
    assert [line for line in (out + err).splitlines() if PRINTED_WARNING.search(line)] == []
