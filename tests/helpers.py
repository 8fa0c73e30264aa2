"""Helpers shared by the tests: comparisons, the repository's scripts as modules, a tiny training recipe."""
from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from visattn.ops.backends import BACKENDS
from visattn.ops.triton_support import triton_runs_on

REPO = Path(__file__).resolve().parents[1]

# A test that runs a Triton kernel on CPU tensors: the interpreter runs it there, which tests/conftest.py turns
# on only where torch sees no GPU; with a GPU the kernels take CUDA tensors alone and such a test skips.
TRITON_ON_CPU = pytest.mark.skipif(
    not triton_runs_on(torch.device("cpu")),
    reason="Triton kernels take CPU tensors only interpreted (TRITON_INTERPRET=1, set where torch sees no GPU)",
)

# The devices a kernel test runs on: the CPU interpreted, and a GPU compiled (skipped without one).
TRITON_DEVICES = [pytest.param("cpu", marks=TRITON_ON_CPU), pytest.param("cuda", marks=pytest.mark.cuda)]


def cpu_paths(op: str) -> list:
    """``BACKENDS[op]`` as test parameters for CPU tensors: the ``"triton"`` path marked :data:`TRITON_ON_CPU`."""
    return [pytest.param(name, marks=TRITON_ON_CPU) if name == "triton" else name for name in BACKENDS[op]]

# train.py flags for a run of seconds: 96 train / 50 validation / 50 test digits at 16x16, patch 4 (a 4x4
# grid), 6 steps of 16 per epoch.
TINY = [
    "--max-train-samples", "96", "--max-eval-samples", "50", "--img-size", "16", "--patch-size", "4",
    "--embed-dim", "16", "--depth", "2", "--num-heads", "2", "--batch-size", "16", "--epochs", "1",
    "--warmup-epochs", "0",
]


def load_script(name: str) -> ModuleType:
    """``scripts/<name>.py`` as the module ``name``, registered in ``sys.modules`` (where its dataclasses look
    their module up)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def rms_rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """RMS of the error relative to the RMS of the expected value."""
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).pow(2).mean().sqrt() / expected.pow(2).mean().sqrt().clamp_min(1e-12)).item()


def assert_rms_close(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str = "") -> None:
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    err = rms_rel_err(actual, expected)
    assert err <= tol, f"{what}: RMS-relative error {err:.3g} > {tol:.1g}"


def grads_of(fn, *inputs: torch.Tensor, seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Output of ``fn(*inputs)`` and the gradients of the inputs under a fixed random cotangent."""
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.dtype)
    out.backward(cotangent)
    return out.detach(), [t.grad for t in leaves]


def stopped_copy(whole: Path, copy: Path, checkpoint: str, removed: tuple[str, ...]) -> dict:
    """``whole`` copied to ``copy`` as if stopped just after ``checkpoint``: later checkpoints and the ``removed``
    files gone. Returns that checkpoint's trainer state."""
    shutil.copytree(whole, copy)
    for path in (copy / "checkpoints").iterdir():
        if path.name != checkpoint:
            shutil.rmtree(path)
    for name in removed:
        (copy / name).unlink()
    return json.loads((copy / "checkpoints" / checkpoint / "trainer_state.json").read_text())
