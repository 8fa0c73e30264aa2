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


def separable_grid_mask(rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """The (H*W, H*W) mask, row-major tokens, of a window that is a product of one window per axis:
    query (r, c) may see key (r', c') when ``rows[r, r']`` and ``cols[c, c']``.

    Args:
        rows: bool (H, H); cols: bool (W, W).
    """
    H, W = rows.shape[0], cols.shape[0]
    return (rows[:, None, :, None] & cols[None, :, None, :]).reshape(H * W, H * W)


def with_prefix_tokens(window: torch.Tensor, num_prefix_tokens: int, prefix_visible: bool = False) -> torch.Tensor:
    """The (N, N) mask, N = P + H*W with the P prefix tokens first, of a local op whose patches see
    ``window``: prefix queries see every token, patch queries their window, and the prefix keys if
    ``prefix_visible`` (Longformer's global tokens).

    Args:
        window: bool (H*W, H*W) over row-major patch tokens, e.g. :func:`separable_grid_mask`.
    """
    p = num_prefix_tokens
    n = p + window.shape[0]
    allowed = torch.ones(n, n, dtype=torch.bool, device=window.device)
    allowed[p:, :p] = prefix_visible
    allowed[p:, p:] = window
    return allowed
