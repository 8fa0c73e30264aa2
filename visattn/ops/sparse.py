"""2D blocked local attention with a halo (HaloNet, Vaswani et al. 2021) on the tiled engine.

The sliding window of sparse transformers made 2D and blocked: the grid is cut into b x b blocks
(the last block of an axis may be partial) and every patch query of a block attends to the block grown
by ``halo`` cells on each side, cut at the grid border (keys outside the grid do not exist). Per axis
the queries of block ``[s, min(s + b, L))`` see ``[s - halo, s + b + halo) ∩ [0, L)``. Prefix tokens
(class, registers) attend to all tokens and are not in any block's window.

With ``tile_aligned=True`` the blocks are the tiles of ``aligned_tile`` (rows x cols cells, in place of
b x b) and the halo is rounded out to whole tiles, ``ceil(halo / t)`` of side t on each side, cut at the
border as above: ``halo=0`` gives Swin's windows without the shift (each tile attends to itself), the
default ``halo=3`` the tile and its neighbouring tiles. With the default tile, FlexAttention's 128-token
block (8 x 16 cells), every block the CUDA path keeps is then full, computed without a mask; on a grid
that the tile does not divide, the last tile of an axis is ragged and the blocks that hold it are
partial. The same function on every path and device: the tile is an option, not the device's.
"""
from __future__ import annotations

import torch

from visattn.ops.checks import check_dropout, check_nonnegative_int, check_positive_int, check_qkv
from visattn.ops.local import (
    ALIGNED_TILE,
    AxisPlan,
    blocked_axis,
    check_grid_for_order,
    check_tile_alignment,
    naive_masked_attn,
    separable_grid_mask,
    tiled_local_attn,
    tiles_holding,
    with_prefix_tokens,
)


def sparse_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grid: tuple[int, int],
    block_size: int,
    halo: int,
    *,
    num_prefix_tokens: int = 0,
    tile_aligned: bool = False,
    aligned_tile: int | tuple[int, int] = ALIGNED_TILE,
    dropout_p: float = 0.0,
    scale: float | None = None,
    backend: str | None = None,
    token_order: str = "raster",
) -> torch.Tensor:
    """Softmax attention of each b x b patch query block (or, ``tile_aligned``, each tile) over the block
    plus a halo; of each prefix query over all tokens.

    Args:
        q, k, v: (B, heads, N, d), N = num_prefix_tokens + H * W, prefix tokens first, patches in raster order.
        grid: (H, W) of the patch tokens.
        block_size: block side b; unused with tile_aligned (the blocks are the tiles).
        halo: cells added on each side of the block (0: plain non-overlapping block attention); with
            tile_aligned rounded out to whole tiles.
        num_prefix_tokens: P >= 0 tokens before the patches.
        tile_aligned: blocks of whole tiles and halos of whole tiles (module docstring).
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
    check_qkv(q, k, v, "sparse_attn")
    check_dropout(dropout_p, "sparse_attn")
    check_positive_int(block_size, "block_size", "sparse_attn")
    check_nonnegative_int(halo, "halo", "sparse_attn")
    tile = check_tile_alignment(tile_aligned, aligned_tile, "sparse_attn")
    H, W = check_grid_for_order(grid, q.shape[2], num_prefix_tokens, token_order, "sparse_attn")
    rows, cols = sparse_plans((H, W), block_size, halo, tile, q.device)
    return tiled_local_attn(
        q, k, v, rows, cols, num_prefix_tokens=num_prefix_tokens, dropout_p=dropout_p, scale=scale, backend=backend,
        token_order=token_order,
    )


def aligned_blocks(block_size: int, halo: int, aligned_tile: tuple[int, int] | None) -> tuple[tuple[int, int], ...]:
    """(block, halo) of the rows and of the columns: b and halo on both, or with an ``aligned_tile`` its
    sides and the halo rounded out to whole tiles."""
    if aligned_tile is None:
        return (block_size, halo), (block_size, halo)
    return tuple((tile, tiles_holding(halo, tile) * tile) for tile in aligned_tile)


def sparse_plans(
    grid: tuple[int, int], block_size: int, halo: int, aligned_tile: tuple[int, int] | None, device: torch.device
) -> tuple[AxisPlan, AxisPlan]:
    """The window plans of the rows and the columns (see :func:`aligned_blocks`)."""
    return tuple(
        blocked_axis(length, block, axis_halo, device)
        for length, (block, axis_halo) in zip(grid, aligned_blocks(block_size, halo, aligned_tile))
    )


def sparse_mask(
    grid: tuple[int, int],
    block_size: int,
    halo: int,
    device: torch.device | None = None,
    aligned_tile: tuple[int, int] | None = None,
) -> torch.Tensor:
    """(H*W, H*W) bool over the patches, row-major tokens: ``[i, j]`` says query i may see key j. The
    plain definition: b x b blocks, or with an ``aligned_tile`` its tiles, each with its halo."""
    H, W = grid

    def axis(length: int, block: int, halo: int) -> torch.Tensor:  # (length, length): query position x key position
        pos = torch.arange(length, device=device)
        block_start = pos // block * block
        return (block_start[:, None] - halo <= pos[None, :]) & (pos[None, :] < block_start[:, None] + block + halo)

    (row_block, row_halo), (col_block, col_halo) = aligned_blocks(block_size, halo, aligned_tile)
    return separable_grid_mask(axis(H, row_block, row_halo), axis(W, col_block, col_halo))


def naive_sparse_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grid: tuple[int, int],
    block_size: int,
    halo: int,
    *,
    num_prefix_tokens: int = 0,
    tile_aligned: bool = False,
    aligned_tile: int | tuple[int, int] = ALIGNED_TILE,
    scale: float | None = None,
) -> torch.Tensor:
    """Naive twin of :func:`sparse_attn`: explicit N x N scores with the block-plus-halo mask (prefix rows
    see every token, patch rows their block plus halo only)."""
    tile = check_tile_alignment(tile_aligned, aligned_tile, "naive_sparse_attn")
    allowed = with_prefix_tokens(sparse_mask(grid, block_size, halo, q.device, tile), num_prefix_tokens)
    return naive_masked_attn(q, k, v, allowed, scale)
