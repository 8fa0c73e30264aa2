"""2D neighbourhood attention (Hassani et al. 2023, NATTEN semantics) on the tiled engine.

Each patch query attends to the k x k window of its grid neighbours. At the borders the window is
shifted inward rather than cut, so every query sees exactly k^2 keys: per axis the window is
``[s, s + k)`` with ``s = clamp(i - k // 2, 0, L - k)``. A kernel larger than an axis (k > L) is clamped
to that axis, i.e. the query sees the whole axis there (k_eff = L). Prefix tokens (class, registers)
attend to all tokens and are not in any patch's window.
"""
from __future__ import annotations

import torch

from visattn.ops.checks import check_dropout, check_grid, check_positive_int, check_qkv
from visattn.ops.local import (
    naive_masked_attn,
    neighborhood_axis,
    separable_grid_mask,
    tiled_local_attn,
    with_prefix_tokens,
)


def neighborhood_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grid: tuple[int, int],
    kernel_size: int,
    *,
    num_prefix_tokens: int = 0,
    tile_size: int = 8,
    dropout_p: float = 0.0,
    scale: float | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Softmax attention of each patch query over its k x k grid neighbourhood; of each prefix query
    over all tokens.

    Args:
        q, k, v: (B, heads, N, d), N = num_prefix_tokens + H * W, prefix tokens first, patches in raster order.
        grid: (H, W) of the patch tokens.
        kernel_size: odd window side k; clamped per axis to the grid side when larger.
        num_prefix_tokens: P >= 0 tokens before the patches.
        tile_size: queries are processed in tiles of tile_size x tile_size cells, each reading a
            (tile_size + k - 1)^2 key region; the result does not depend on it.
        dropout_p: dropout on the attention weights.
        scale: score scale, default d^-0.5.
        backend: the tiled engine's path, ``"chunked"``, ``"gathered"``, ``"dense"``, ``"flex"`` or ``"triton"`` (see
            :func:`visattn.ops.local.tiled_local_attn`); None: chosen.
    Returns:
        (B, heads, N, d)
    """
    check_qkv(q, k, v, "neighborhood_attn")
    check_dropout(dropout_p, "neighborhood_attn")
    check_positive_int(kernel_size, "kernel_size", "neighborhood_attn", odd=True)
    check_positive_int(tile_size, "tile_size", "neighborhood_attn")
    H, W = check_grid(grid, q.shape[2], num_prefix_tokens, "neighborhood_attn")
    rows = neighborhood_axis(H, kernel_size, tile_size, q.device)
    cols = neighborhood_axis(W, kernel_size, tile_size, q.device)
    return tiled_local_attn(
        q, k, v, rows, cols, num_prefix_tokens=num_prefix_tokens, dropout_p=dropout_p, scale=scale, backend=backend
    )


def neighborhood_mask(grid: tuple[int, int], kernel_size: int, device: torch.device | None = None) -> torch.Tensor:
    """(H*W, H*W) bool over the patches, row-major tokens: ``[i, j]`` says query i may see key j. The
    plain definition."""
    H, W = grid

    def axis(length: int) -> torch.Tensor:  # (length, length): query position x key position
        k = min(kernel_size, length)
        pos = torch.arange(length, device=device)
        start = (pos - k // 2).clamp(0, length - k)
        return (start[:, None] <= pos[None, :]) & (pos[None, :] < start[:, None] + k)

    return separable_grid_mask(axis(H), axis(W))


def naive_neighborhood_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grid: tuple[int, int],
    kernel_size: int,
    *,
    num_prefix_tokens: int = 0,
    scale: float | None = None,
) -> torch.Tensor:
    """Naive twin of :func:`neighborhood_attn`: explicit N x N scores with the window mask (prefix rows
    see every token, patch rows their window only)."""
    allowed = with_prefix_tokens(neighborhood_mask(grid, kernel_size, q.device), num_prefix_tokens)
    return naive_masked_attn(q, k, v, allowed, scale)
