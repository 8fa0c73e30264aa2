"""2D neighbourhood attention (Hassani et al. 2023, NATTEN semantics) on the tiled engine.

Each patch query attends to the k x k window of its grid neighbours. At the borders the window is
shifted inward rather than cut, so every query sees exactly k^2 keys: per axis the window is
``[s, s + k)`` with ``s = clamp(i - k // 2, 0, L - k)``. A kernel larger than an axis (k > L) is clamped
to that axis, i.e. the query sees the whole axis there (k_eff = L). Prefix tokens (class, registers)
attend to all tokens and are not in any patch's window.

With ``tile_aligned=True`` the neighbourhoods are strided by a tile (Generalized Neighborhood Attention's
strided neighbourhood, the stride one tile of ``aligned_tile`` cells): the queries of a tile share one
window of whole tiles, centred on their tile and shifted inward at the borders, the fewest that hold
each query's k x k neighbourhood: per axis of tile side t, ``2 r + 1`` tiles with ``r = ceil((k // 2) / t)``
(all of the axis's tiles where it has fewer). With the default tile, FlexAttention's 128-token block
(8 x 16 cells), every block the CUDA path keeps is then full, computed without a mask; on a grid that
the tile does not divide, the last tile of an axis is ragged and the blocks that hold it are partial.
The same function on every path and device: the tile is an option, not the device's.
"""
from __future__ import annotations

import torch

from visattn.ops.checks import check_dropout, check_positive_int, check_qkv
from visattn.ops.local import (
    ALIGNED_TILE,
    AxisPlan,
    check_grid_for_order,
    check_tile_alignment,
    naive_masked_attn,
    neighborhood_axis,
    separable_grid_mask,
    tile_neighborhood_axis,
    tiled_local_attn,
    tiles_holding,
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
    tile_aligned: bool = False,
    aligned_tile: int | tuple[int, int] = ALIGNED_TILE,
    dropout_p: float = 0.0,
    scale: float | None = None,
    backend: str | None = None,
    token_order: str = "raster",
) -> torch.Tensor:
    """Softmax attention of each patch query over its k x k grid neighbourhood (or, ``tile_aligned``, over
    its tile's window of whole tiles); of each prefix query over all tokens.

    Args:
        q, k, v: (B, heads, N, d), N = num_prefix_tokens + H * W, prefix tokens first, patches in raster order.
        grid: (H, W) of the patch tokens.
        kernel_size: odd window side k; clamped per axis to the grid side when larger.
        num_prefix_tokens: P >= 0 tokens before the patches.
        tile_size: queries are processed in tiles of tile_size x tile_size cells, each reading a
            (tile_size + k - 1)^2 key region; the result does not depend on it. Unused with tile_aligned.
        tile_aligned: neighbourhoods strided by a tile, each tile's window whole tiles (module docstring).
        aligned_tile: (rows, cols) of that tile, or one integer for a square one; default 8 x 16.
        dropout_p: dropout on the attention weights.
        scale: score scale, default d^-0.5.
        backend: the tiled engine's path, ``"chunked"``, ``"gathered"``, ``"dense"``, ``"flex"`` or ``"triton"`` (see
            :func:`visattn.ops.local.tiled_local_attn`); None: chosen.
        token_order: ``"raster"``, or ``"tile"``: q, k, v and the output (B, heads, S, d) in FlexAttention's
            tile order (:func:`visattn.ops.local.flex.flex_local_attn`), on the ``"flex"`` path.
    Returns:
        (B, heads, N, d), or (B, heads, S, d) in tile order
    """
    check_qkv(q, k, v, "neighborhood_attn")
    check_dropout(dropout_p, "neighborhood_attn")
    check_positive_int(kernel_size, "kernel_size", "neighborhood_attn", odd=True)
    check_positive_int(tile_size, "tile_size", "neighborhood_attn")
    tile = check_tile_alignment(tile_aligned, aligned_tile, "neighborhood_attn")
    H, W = check_grid_for_order(grid, q.shape[2], num_prefix_tokens, token_order, "neighborhood_attn")
    rows, cols = neighborhood_plans((H, W), kernel_size, tile_size, tile, q.device)
    return tiled_local_attn(
        q, k, v, rows, cols, num_prefix_tokens=num_prefix_tokens, dropout_p=dropout_p, scale=scale, backend=backend,
        token_order=token_order,
    )


def neighborhood_plans(
    grid: tuple[int, int], kernel_size: int, tile_size: int, aligned_tile: tuple[int, int] | None, device: torch.device
) -> tuple[AxisPlan, AxisPlan]:
    """The window plans of the rows and the columns: exact neighbourhoods in tiles of ``tile_size``, or, with
    an ``aligned_tile``, the tile-aligned ones."""
    if aligned_tile is None:
        return tuple(neighborhood_axis(length, kernel_size, tile_size, device) for length in grid)
    return tuple(
        tile_neighborhood_axis(length, tile, tiles_holding(kernel_size // 2, tile), device)
        for length, tile in zip(grid, aligned_tile)
    )


def neighborhood_mask(
    grid: tuple[int, int],
    kernel_size: int,
    device: torch.device | None = None,
    aligned_tile: tuple[int, int] | None = None,
) -> torch.Tensor:
    """(H*W, H*W) bool over the patches, row-major tokens: ``[i, j]`` says query i may see key j. The
    plain definition: the k x k neighbourhoods, or with an ``aligned_tile`` the tile-aligned windows."""
    H, W = grid

    def axis(length: int) -> torch.Tensor:  # (length, length): query position x key position
        k = min(kernel_size, length)
        pos = torch.arange(length, device=device)
        start = (pos - k // 2).clamp(0, length - k)
        return (start[:, None] <= pos[None, :]) & (pos[None, :] < start[:, None] + k)

    def tile_axis(length: int, tile: int) -> torch.Tensor:  # the windows of whole tiles, as the module says
        tile = min(tile, length)
        num_tiles, reach = -(-length // tile), -(-(kernel_size // 2) // tile)
        span = min(2 * reach + 1, num_tiles)
        pos = torch.arange(length, device=device)
        start = (pos // tile - reach).clamp(0, num_tiles - span) * tile
        return (start[:, None] <= pos[None, :]) & (pos[None, :] < start[:, None] + span * tile)

    if aligned_tile is None:
        return separable_grid_mask(axis(H), axis(W))
    return separable_grid_mask(tile_axis(H, aligned_tile[0]), tile_axis(W, aligned_tile[1]))


def naive_neighborhood_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grid: tuple[int, int],
    kernel_size: int,
    *,
    num_prefix_tokens: int = 0,
    tile_aligned: bool = False,
    aligned_tile: int | tuple[int, int] = ALIGNED_TILE,
    scale: float | None = None,
) -> torch.Tensor:
    """Naive twin of :func:`neighborhood_attn`: explicit N x N scores with the window mask (prefix rows
    see every token, patch rows their window only)."""
    tile = check_tile_alignment(tile_aligned, aligned_tile, "naive_neighborhood_attn")
    allowed = with_prefix_tokens(neighborhood_mask(grid, kernel_size, q.device, tile), num_prefix_tokens)
    return naive_masked_attn(q, k, v, allowed, scale)
