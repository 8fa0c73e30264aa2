"""Softmax attention, the O(N^2) baseline, on PyTorch's fused ``scaled_dot_product_attention``."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from visattn.ops.checks import check_dropout, check_qkv
from visattn.ops.local.naive import naive_masked_attn


def softmax_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    dropout_p: float = 0.0,
    scale: float | None = None,
) -> torch.Tensor:
    """``softmax(q k^T * scale + mask) v`` over all N tokens.

    Args:
        q, k, v: (B, heads, N, d).
        attn_mask: optional bool (True = attend) or additive float mask broadcastable to (B, heads, N, N).
        is_causal: mask keys after each query (raster order).
    Returns:
        (B, heads, N, d)
    """
    check_qkv(q, k, v, "softmax_attn")
    check_dropout(dropout_p, "softmax_attn")
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale
    )


def naive_softmax_attn(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False, scale: float | None = None
) -> torch.Tensor:
    """Naive twin of :func:`softmax_attn` (explicit scores)."""
    n = q.shape[-2]
    allowed = torch.ones(n, n, dtype=torch.bool, device=q.device)
    if is_causal:
        allowed = allowed.tril()
    return naive_masked_attn(q, k, v, allowed, scale)
