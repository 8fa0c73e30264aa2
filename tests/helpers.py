"""Comparison helpers shared by the tests."""
from __future__ import annotations

import torch


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


