"""Causal linear attention as an RNN: one token at a time, carrying the state (S, z)."""
from __future__ import annotations

import torch

from visattn.ops.checks import check_same_float_tensors
from visattn.ops.linear.feature_maps import get_feature_map


def _check_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor] | None
) -> None:
    op = "linear_attn_step"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.ndim != 3:
            raise ValueError(f"{op}: {name} must be (B, heads, d), got shape {tuple(t.shape)}")
    if q.shape != k.shape or q.shape[:2] != v.shape[:2]:
        raise ValueError(
            f"{op}: q and k must be (B, heads, d) and v (B, heads, e) alike; got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)} (q and k must share head_dim)"
        )
    check_same_float_tensors(op, q=q, k=k, v=v)
    if state is not None:
        expected = ((*k.shape, v.shape[-1]), tuple(k.shape))
        if len(state) != 2 or tuple(state[0].shape) != expected[0] or tuple(state[1].shape) != expected[1]:
            got = [tuple(s.shape) for s in state] if isinstance(state, (tuple, list)) else state
            raise ValueError(f"{op}: state must be (S, z) of shapes {expected[0]} and {expected[1]}, got {got}")


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
    _check_step(q, k, v, state)
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
