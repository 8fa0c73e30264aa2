"""The naive twin shared by every op: explicit N x N scores, a boolean mask, softmax, then V.

Slow and memory-hungry on purpose (O(N^2)); the tests compare each fast op against it.
"""
from __future__ import annotations

import torch


def naive_masked_attn(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """Softmax attention restricted to ``allowed`` key positions.

    Args:
        q, k, v: (B, heads, N, d) (k and v may have a different token count M).
        allowed: bool (N, M); ``allowed[i, j]`` says query i may attend to key j. Every row needs a True.
    Returns:
        (B, heads, N, d_v)
    """
    if not bool(allowed.any(dim=-1).all()):
        raise ValueError("naive_masked_attn: every query needs at least one allowed key")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (q @ k.transpose(-2, -1)) * scale  # (B, heads, N, M)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return scores.softmax(dim=-1) @ v
