"""Naive twin of linear attention: the explicit N x N kernel matrix."""
from __future__ import annotations

import torch

from visattn.ops.linear.feature_maps import get_feature_map
from visattn.ops.rope import naive_apply_rope


def naive_linear_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    feature_map: str = "elu",
    causal: bool = False,
    eps: float = 1e-6,
    rope: torch.Tensor | None = None,
) -> torch.Tensor:
    """Naive twin of :func:`visattn.ops.linear_attn`: ``phi(q) phi(k)^T`` (B, heads, N, N) spelled out,
    lower-triangular when causal, then normalised by its row sums. With a ``rope`` table the numerator's
    weights are those of the rotated features, ``R phi(q) (R phi(k))^T``, and the row sums stay those of the
    unrotated ones."""
    phi = get_feature_map(feature_map)
    phi_q, phi_k = phi(q), phi(k)
    weights = phi_q @ phi_k.transpose(-2, -1)  # (B, h, N, N)
    if rope is None:
        numerator = weights
    else:
        numerator = naive_apply_rope(phi_q, rope) @ naive_apply_rope(phi_k, rope).transpose(-2, -1)
    if causal:
        weights, numerator = weights.tril(), numerator.tril()
    return (numerator @ v) / weights.sum(dim=-1, keepdim=True).clamp_min(eps)
