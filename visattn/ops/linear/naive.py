"""Naive twin of linear attention: the explicit N x N kernel matrix."""
from __future__ import annotations

import torch

from visattn.ops.linear.feature_maps import get_feature_map


def naive_linear_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    feature_map: str = "elu",
    causal: bool = False,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Naive twin of :func:`visattn.ops.linear_attn`: ``phi(q) phi(k)^T`` (B, heads, N, N) spelled out,
    lower-triangular when causal, then normalised by its row sums."""
    phi = get_feature_map(feature_map)
    weights = phi(q) @ phi(k).transpose(-2, -1)  # (B, h, N, N)
    if causal:
        weights = weights.tril()
    return (weights @ v) / weights.sum(dim=-1, keepdim=True).clamp_min(eps)
