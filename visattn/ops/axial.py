"""Axial attention (Ho et al. 2019): row attention, then column attention, over the patch grid.

One set of q, k, v covers the whole grid in two hops:

1. rows: each patch query attends to the keys of its own row plus the prefix keys, with values v; the
   result v' replaces v for the patch tokens (the prefix tokens keep their v);
2. columns: each patch query attends to the keys of its own column plus the prefix keys, with values
   v' (the row-mixed values).

Every patch output thus aggregates over the whole grid. Prefix (class/register) queries attend to all
N tokens with ordinary softmax over k and v. Cost per head: O(N (H + W) d + P N d), never N x N.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange

from visattn.ops._checks import check_grid, check_qkv
from visattn.ops._reference import masked_attention_reference


def _prepend_prefix(seqs: torch.Tensor, prefix: torch.Tensor) -> torch.Tensor:
    """Put the prefix tokens in front of every row (or column) sequence.

    Args:
        seqs: (B, S, heads, L, d), S rows (or columns) of L tokens each.
        prefix: (B, heads, P, d).
    Returns:
        (B * S, heads, P + L, d). The prefix is broadcast with expand; the concatenation is the only copy.
    """
    b, s = seqs.shape[:2]
    prefix = prefix.unsqueeze(1).expand(b, s, *prefix.shape[1:])  # (B, S, heads, P, d)
    return torch.cat([prefix, seqs], dim=3).flatten(0, 1)


def axial(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grid: tuple[int, int],
    num_prefix_tokens: int = 0,
    dropout_p: float = 0.0,
    scale: float | None = None,
) -> torch.Tensor:
    """Row-then-column softmax attention over the patch grid, prefix keys visible in both hops.

    Args:
        q, k, v: (B, heads, N, d), N = num_prefix_tokens + H * W, prefix tokens first, patches in
            raster order (row by row).
        grid: (H, W), the patch grid.
        num_prefix_tokens: P, the class/register tokens before the patches.
        dropout_p: attention dropout, applied in every softmax (rows, columns, prefix queries).
        scale: score scale; ``d ** -0.5`` if None.
    Returns:
        (B, heads, N, d)
    """
    check_qkv(q, k, v, "axial")
    h, w = check_grid(grid, q.shape[2], num_prefix_tokens, "axial")
    p = num_prefix_tokens
    q_pat, k_pat, v_pat = q[:, :, p:], k[:, :, p:], v[:, :, p:]  # (B, heads, H * W, d)
    k_pre, v_pre = k[:, :, :p], v[:, :, :p]  # (B, heads, P, d)
    rows = "b heads (y x) d -> b y heads x d"
    cols = "b heads (y x) d -> b x heads y d"

    # hop 1, rows: B * H sequences of P + W keys; values v
    v_mixed = F.scaled_dot_product_attention(
        rearrange(q_pat, "b heads (y x) d -> (b y) heads x d", y=h),
        _prepend_prefix(rearrange(k_pat, rows, y=h), k_pre),
        _prepend_prefix(rearrange(v_pat, rows, y=h), v_pre),
        dropout_p=dropout_p,
        scale=scale,
    )  # (B * H, heads, W, d)

    # hop 2, columns: B * W sequences of P + H keys; values from hop 1 (prefix tokens keep v)
    out = F.scaled_dot_product_attention(
        rearrange(q_pat, "b heads (y x) d -> (b x) heads y d", y=h),
        _prepend_prefix(rearrange(k_pat, cols, y=h), k_pre),
        _prepend_prefix(rearrange(v_mixed, "(b y) heads x d -> b x heads y d", y=h), v_pre),
        dropout_p=dropout_p,
        scale=scale,
    )  # (B * W, heads, H, d)
    out = rearrange(out, "(b x) heads y d -> b heads (y x) d", x=w)

    if p == 0:
        return out
    out_pre = F.scaled_dot_product_attention(
        q[:, :, :p], k, v, dropout_p=dropout_p, scale=scale
    )  # (B, heads, P, d): prefix queries see every token
    return torch.cat([out_pre, out], dim=2)


def axial_masks(
    grid: tuple[int, int], num_prefix_tokens: int, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (N, N) bool masks of the two hops: same row (hop 1) and same column (hop 2).

    Prefix keys are visible to every query and prefix queries see every key.
    """
    h, w = grid
    p = num_prefix_tokens
    idx = torch.arange(p + h * w, device=device)
    is_prefix = idx < p
    row = torch.where(is_prefix, -1, (idx - p) // w)
    col = torch.where(is_prefix, -1, (idx - p) % w)
    seen_by_all = is_prefix[None, :] | is_prefix[:, None]
    same_row = (row[:, None] == row[None, :]) | seen_by_all
    same_col = (col[:, None] == col[None, :]) | seen_by_all
    return same_row, same_col


def axial_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grid: tuple[int, int],
    num_prefix_tokens: int = 0,
    scale: float | None = None,
) -> torch.Tensor:
    """Naive twin of :func:`axial`: two explicit N x N masked softmax attentions."""
    check_qkv(q, k, v, "axial_reference")
    check_grid(grid, q.shape[2], num_prefix_tokens, "axial_reference")
    p = num_prefix_tokens
    same_row, same_col = axial_masks(grid, p, q.device)
    hop1 = masked_attention_reference(q, k, v, same_row, scale)  # prefix rows: full attention over v
    v_rows = torch.cat([v[:, :, :p], hop1[:, :, p:]], dim=2)  # prefix tokens keep their v
    hop2 = masked_attention_reference(q, k, v_rows, same_col, scale)
    return torch.cat([hop1[:, :, :p], hop2[:, :, p:]], dim=2)
