"""Non-causal linear attention as plain batched matmuls: the formulation a compiler fuses, and the one
that runs where the blocked autograd of :mod:`visattn.ops.linear.blocked` is not wanted."""
from __future__ import annotations

import torch

from visattn.ops._checks import check_qkv
from visattn.ops.linear.feature_maps import get_feature_map


def with_ones_column(v: torch.Tensor) -> torch.Tensor:
    """(..., N, e) -> (..., N, e + 1): the last column, all ones, sums the normalizer beside the values."""
    return torch.cat([v, v.new_ones(*v.shape[:-1], 1)], dim=-1)


def divide_by_last_column(num_den: torch.Tensor, eps: float) -> torch.Tensor:
    """(..., e + 1) numerators and normalizer -> (..., e), the normalizer clamped to at least ``eps``."""
    return num_den[..., :-1] / num_den[..., -1:].clamp_min(eps)


def plain_linear_attn(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, feature_map: str = "elu", eps: float = 1e-6
) -> torch.Tensor:
    """``phi(q) (phi(k)^T [v, 1])``, normalised: q, k, v (B, heads, N, d) -> (B, heads, N, d) in v's dtype,
    computed in fp32. Autograd stores the feature maps (N d per tensor)."""
    check_qkv(q, k, v, "plain_linear_attn")
    phi = get_feature_map(feature_map)
    with torch.autocast(device_type=q.device.type, enabled=False):
        qf, kf, vf = phi(q.float()), phi(k.float()), v.float()
        kv_sum = kf.transpose(-2, -1) @ with_ones_column(vf)  # (B, h, d, e + 1)
        out = divide_by_last_column(qf @ kv_sum, eps)
    return out.to(v.dtype)
