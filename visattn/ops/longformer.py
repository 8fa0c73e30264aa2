"""Longformer attention made 2D (Beltagy et al. 2020; Zhang et al. 2021, ViL): local windows plus
global tokens.

Tokens are ``G`` global tokens followed by the H x W patch grid. Global tokens attend to all N tokens
and are attended by all tokens; each patch token attends to its local window (``"neighborhood"`` or
``"sparse"`` semantics, see :mod:`visattn.ops.neighborhood`, :mod:`visattn.ops.sparse`) plus all
global tokens, in one softmax. The global keys enter the tiled engine as extra keys of every tile, so
the cost stays ``O(N (R^2 + G))`` for the patches plus ``O(G N)`` for the global rows.
"""
from __future__ import annotations

import torch

from visattn.ops.checks import check_dropout, check_grid, check_nonnegative_int, check_positive_int, check_qkv
from visattn.ops.local import (
    AxisPlan,
    blocked_axis,
    naive_masked_attn,
    neighborhood_axis,
    tiled_local_attn,
    with_prefix_tokens,
)
from visattn.ops.neighborhood import neighborhood_mask
from visattn.ops.sparse import sparse_mask

LOCAL_KINDS = ("neighborhood", "sparse")


def check_local_options(local: str, kernel_size: int, block_size: int, halo: int, tile_size: int) -> None:
    if local not in LOCAL_KINDS:
        raise ValueError(f"longformer: unknown local {local!r}; valid: {', '.join(LOCAL_KINDS)}")
    if local == "neighborhood":
        check_positive_int(kernel_size, "kernel_size", "longformer", odd=True)
        check_positive_int(tile_size, "tile_size", "longformer")
    else:
        check_positive_int(block_size, "block_size", "longformer")
        check_nonnegative_int(halo, "halo", "longformer")


def _axis_plan(
    local: str, length: int, kernel_size: int, block_size: int, halo: int, tile_size: int, device: torch.device
) -> AxisPlan:
    if local == "neighborhood":
        return neighborhood_axis(length, kernel_size, tile_size, device)
    return blocked_axis(length, block_size, halo, device)


def longformer_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grid: tuple[int, int],
    num_global_tokens: int,
    local: str = "neighborhood",
    kernel_size: int = 7,
    block_size: int = 8,
    halo: int = 3,
    tile_size: int = 8,
    dropout_p: float = 0.0,
    scale: float | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Local windows on the patch grid plus global tokens.

    Args:
        q, k, v: (B, heads, N, d), N = num_global_tokens + H * W, global tokens first.
        grid: (H, W) of the patch tokens.
        num_global_tokens: G >= 0; with G = 0 this is the local op alone.
        local: ``"neighborhood"`` (uses kernel_size, tile_size) or ``"sparse"`` (uses block_size, halo).
        dropout_p: dropout on the attention weights.
        scale: score scale, default d^-0.5.
        backend: the tiled engine's path, ``"chunked"``, ``"gathered"``, ``"dense"``, ``"flex"`` or ``"triton"`` (see
            :func:`visattn.ops.local.tiled_local_attn`); None: chosen.
    Returns:
        (B, heads, N, d)
    """
    check_qkv(q, k, v, "longformer_attn")
    check_dropout(dropout_p, "longformer_attn")
    check_nonnegative_int(num_global_tokens, "num_global_tokens", "longformer_attn")
    H, W = check_grid(grid, q.shape[2], num_global_tokens, "longformer_attn")
    check_local_options(local, kernel_size, block_size, halo, tile_size)
    rows = _axis_plan(local, H, kernel_size, block_size, halo, tile_size, q.device)
    cols = _axis_plan(local, W, kernel_size, block_size, halo, tile_size, q.device)
    return tiled_local_attn(
        q, k, v, rows, cols, num_prefix_tokens=num_global_tokens, prefix_visible=True, dropout_p=dropout_p, scale=scale,
        backend=backend,
    )


def longformer_mask(
    grid: tuple[int, int],
    num_global_tokens: int,
    local: str = "neighborhood",
    kernel_size: int = 7,
    block_size: int = 8,
    halo: int = 3,
    device: torch.device | None = None,
) -> torch.Tensor:
    """(N, N) bool with N = G + H*W: global rows and columns all True, the patch block is the local mask."""
    if local not in LOCAL_KINDS:
        raise ValueError(f"longformer: unknown local {local!r}; valid: {', '.join(LOCAL_KINDS)}")
    if local == "neighborhood":
        window = neighborhood_mask(grid, kernel_size, device)
    else:
        window = sparse_mask(grid, block_size, halo, device)
    return with_prefix_tokens(window, num_global_tokens, prefix_visible=True)


def naive_longformer_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grid: tuple[int, int],
    num_global_tokens: int,
    local: str = "neighborhood",
    kernel_size: int = 7,
    block_size: int = 8,
    halo: int = 3,
    scale: float | None = None,
) -> torch.Tensor:
    """Naive twin of :func:`longformer_attn`: explicit N x N scores with the local + global mask."""
    allowed = longformer_mask(grid, num_global_tokens, local, kernel_size, block_size, halo, q.device)
    return naive_masked_attn(q, k, v, allowed, scale)
