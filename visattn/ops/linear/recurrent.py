"""Causal linear attention as an RNN: one token at a time, carrying the state (S, z)."""
from __future__ import annotations

import torch

from visattn.ops.linear.feature_maps import get_feature_map


def linear_attn_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: tuple[torch.Tensor, torch.Tensor] | None = None,
    feature_map: str = "elu",
    eps: float = 1e-6,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """One step of causal linear attention as an RNN.

    Args:
        q, k, v: (B, heads, d), the current token.
        state: ``(S, z)`` with S (B, heads, d, d) = sum phi(k_j) v_j^T and z (B, heads, d) = sum phi(k_j),
            fp32, or None at the first token.
    Returns:
        the output (B, heads, d) and the new state.
    """
    phi = get_feature_map(feature_map)
    with torch.autocast(device_type=q.device.type, enabled=False):
        qf, kf, vf = phi(q.float()), phi(k.float()), v.float()
        if state is None:
            state = (qf.new_zeros(*kf.shape, vf.shape[-1]), qf.new_zeros(kf.shape))
        s, z = state
        s = s + kf.unsqueeze(-1) * vf.unsqueeze(-2)
        z = z + kf
        num = (qf.unsqueeze(-2) @ s).squeeze(-2)  # (B, h, d)
        den = (qf * z).sum(dim=-1, keepdim=True)
        out = num / den.clamp_min(eps)
    return out.to(v.dtype), (s, z)
