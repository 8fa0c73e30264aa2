"""Naive twin of axial attention: two explicit N x N masked softmax attentions."""
from __future__ import annotations

import torch

from visattn.ops.checks import check_grid, check_qkv
from visattn.ops.local.naive import naive_masked_attn


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


def naive_axial_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grid: tuple[int, int],
    num_prefix_tokens: int = 0,
    scale: float | None = None,
) -> torch.Tensor:
    """Naive twin of :func:`visattn.ops.axial_attn`."""
    check_qkv(q, k, v, "naive_axial_attn")
    check_grid(grid, q.shape[2], num_prefix_tokens, "naive_axial_attn")
    p = num_prefix_tokens
    same_row, same_col = axial_masks(grid, p, q.device)
    hop1 = naive_masked_attn(q, k, v, same_row, scale)  # prefix rows: full attention over v
    v_rows = torch.cat([v[:, :, :p], hop1[:, :, p:]], dim=2)  # prefix tokens keep their v
    hop2 = naive_masked_attn(q, k, v_rows, same_col, scale)
    return torch.cat([hop1[:, :, :p], hop2[:, :, p:]], dim=2)
