"""The positive feature maps phi of linear attention, each with a fast in-place form and its derivative."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class FeatureMap:
    """A positive feature map phi. ``definition`` is the plain formula (the naive twin uses it);
    ``fast_into(x, out, scratch)`` writes the same values into the fp32 buffer ``out`` in cheap in-place
    passes (``scratch`` is a second buffer of the same shape); ``derivative_`` turns phi(x) into phi'(x)
    in place, so a backward pass that recomputes phi(x) needs nothing else."""

    definition: Callable[[torch.Tensor], torch.Tensor]
    fast_into: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    derivative_: Callable[[torch.Tensor], torch.Tensor]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.definition(x)


def _elu_plus_one(x: torch.Tensor) -> torch.Tensor:
    return F.elu(x) + 1.0


def _in_fp32(x: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
    """x itself if fp32, else x converted into ``buffer``."""
    return x if x.dtype == buffer.dtype else buffer.copy_(x)


def _elu_plus_one_into(x: torch.Tensor, out: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    # elu(x) + 1 = exp(min(x, 0)) + max(x, 0): exp and clamps vectorise, elu's expm1 does not
    x = _in_fp32(x, scratch)
    torch.clamp_max(x, 0.0, out=out).exp_()
    return out.add_(torch.clamp_min(x, 0.0, out=scratch))


def _relu_into(x: torch.Tensor, out: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    return torch.clamp_min(_in_fp32(x, scratch), 0.0, out=out)


def _relu_derivative_(phi_x: torch.Tensor) -> torch.Tensor:
    return phi_x.sign_()  # relu(x) >= 0: 1 where positive, 0 where not (relu's own gradient at 0 is 0)


FEATURE_MAPS: dict[str, FeatureMap] = {
    # elu(x) + 1 > 0, the paper's choice; its derivative is exp(x) = phi(x) for x <= 0 and 1 above: min(phi, 1)
    "elu": FeatureMap(_elu_plus_one, _elu_plus_one_into, lambda phi_x: phi_x.clamp_max_(1.0)),
    "relu": FeatureMap(F.relu, _relu_into, _relu_derivative_),
}


def get_feature_map(name: str) -> FeatureMap:
    try:
        return FEATURE_MAPS[name]
    except KeyError:
        raise ValueError(f"unknown feature_map {name!r}; valid: {sorted(FEATURE_MAPS)}") from None
