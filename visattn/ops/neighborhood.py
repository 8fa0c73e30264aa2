"""2D neighbourhood attention (Hassani et al. 2023, NATTEN semantics) on the tiled engine.

Each query attends to the k x k window of its grid neighbours. At the borders the window is shifted
inward rather than cut, so every query sees exactly k^2 keys: per axis the window is
``[s, s + k)`` with ``s = clamp(i - k // 2, 0, L - k)``. A kernel larger than an axis (k > L) is clamped
to that axis, i.e. the query sees the whole axis there (k_eff = L).
"""
from __future__ import annotations

import torch

from visattn.ops.checks import check_dropout, check_positive_int, check_qkv_grid
from visattn.ops.local.engine import local_attn_on_grid
from visattn.ops.local.naive import naive_grid_attn, separable_grid_mask
from visattn.ops.local.plans import neighborhood_axis


def neighborhood_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kernel_size: int,
    tile_size: int = 8,
    dropout_p: float = 0.0,
    scale: float | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Softmax attention of each query over its k x k grid neighbourhood.

    Args:
        q, k, v: (B, heads, H, W, d).
        kernel_size: odd window side k; clamped per axis to the grid side when larger.
        tile_size: queries are processed in tiles of tile_size x tile_size cells, each reading a
            (tile_size + k - 1)^2 key region; the result does not depend on it.
        dropout_p: dropout on the attention weights.
        scale: score scale, default d^-0.5.
        backend: the tiled engine's path, ``"chunked"``, ``"gathered"`` or ``"dense"`` (see
            :func:`visattn.ops.local.tiled_local_attn`); None: chosen.
    Returns:
        (B, heads, H, W, d)
    """
    check_qkv_grid(q, k, v, "neighborhood_attn")
    check_dropout(dropout_p, "neighborhood_attn")
    check_positive_int(kernel_size, "kernel_size", "neighborhood_attn", odd=True)
    check_positive_int(tile_size, "tile_size", "neighborhood_attn")
    H, W = q.shape[2:4]
    rows = neighborhood_axis(H, kernel_size, tile_size, q.device)
    cols = neighborhood_axis(W, kernel_size, tile_size, q.device)
    return local_attn_on_grid(q, k, v, rows, cols, dropout_p=dropout_p, scale=scale, backend=backend)


def neighborhood_mask(grid: tuple[int, int], kernel_size: int, device: torch.device | None = None) -> torch.Tensor:
    """(H*W, H*W) bool, row-major tokens: ``[i, j]`` says query i may see key j. The plain definition."""
    H, W = grid

    def axis(length: int) -> torch.Tensor:  # (length, length): query position x key position
        k = min(kernel_size, length)
        pos = torch.arange(length, device=device)
        start = (pos - k // 2).clamp(0, length - k)
        return (start[:, None] <= pos[None, :]) & (pos[None, :] < start[:, None] + k)

    return separable_grid_mask(axis(H), axis(W))


def naive_neighborhood_attn(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel_size: int, scale: float | None = None
) -> torch.Tensor:
    """Naive twin of :func:`neighborhood_attn`: explicit N x N scores with the window mask."""
    H, W = q.shape[2:4]
    return naive_grid_attn(q, k, v, neighborhood_mask((H, W), kernel_size, q.device), scale)
