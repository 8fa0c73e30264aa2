"""2D blocked local attention with a halo (HaloNet, Vaswani et al. 2021) on the tiled engine.

The sliding window of sparse transformers made 2D and blocked: the grid is cut into b x b blocks
(the last block of an axis may be partial) and every patch query of a block attends to the block grown
by ``halo`` cells on each side, cut at the grid border (keys outside the grid do not exist). Per axis
the queries of block ``[s, min(s + b, L))`` see ``[s - halo, s + b + halo) ∩ [0, L)``. Prefix tokens
(class, registers) attend to all tokens and are not in any block's window.
"""
from __future__ import annotations

import torch

from visattn.ops.checks import check_dropout, check_grid, check_nonnegative_int, check_positive_int, check_qkv
from visattn.ops.local import blocked_axis, naive_masked_attn, separable_grid_mask, tiled_local_attn, with_prefix_tokens


def sparse_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grid: tuple[int, int],
    block_size: int,
    halo: int,
    *,
    num_prefix_tokens: int = 0,
    dropout_p: float = 0.0,
    scale: float | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Softmax attention of each b x b patch query block over the block plus a halo; of each prefix
    query over all tokens.

    Args:
        q, k, v: (B, heads, N, d), N = num_prefix_tokens + H * W, prefix tokens first, patches in raster order.
        grid: (H, W) of the patch tokens.
        block_size: block side b.
        halo: cells added on each side of the block (0: plain non-overlapping block attention).
        num_prefix_tokens: P >= 0 tokens before the patches.
        dropout_p: dropout on the attention weights.
        scale: score scale, default d^-0.5.
        backend: the tiled engine's path, ``"chunked"``, ``"gathered"``, ``"dense"``, ``"flex"`` or ``"triton"`` (see
            :func:`visattn.ops.local.tiled_local_attn`); None: chosen.
    Returns:
        (B, heads, N, d)
    """
    check_qkv(q, k, v, "sparse_attn")
    check_dropout(dropout_p, "sparse_attn")
    check_positive_int(block_size, "block_size", "sparse_attn")
    check_nonnegative_int(halo, "halo", "sparse_attn")
    H, W = check_grid(grid, q.shape[2], num_prefix_tokens, "sparse_attn")
    rows = blocked_axis(H, block_size, halo, q.device)
    cols = blocked_axis(W, block_size, halo, q.device)
    return tiled_local_attn(
        q, k, v, rows, cols, num_prefix_tokens=num_prefix_tokens, dropout_p=dropout_p, scale=scale, backend=backend
    )


def sparse_mask(
    grid: tuple[int, int], block_size: int, halo: int, device: torch.device | None = None
) -> torch.Tensor:
    """(H*W, H*W) bool over the patches, row-major tokens: ``[i, j]`` says query i may see key j. The
    plain definition."""
    H, W = grid

    def axis(length: int) -> torch.Tensor:  # (length, length): query position x key position
        pos = torch.arange(length, device=device)
        block_start = pos // block_size * block_size
        return (block_start[:, None] - halo <= pos[None, :]) & (pos[None, :] < block_start[:, None] + block_size + halo)

    return separable_grid_mask(axis(H), axis(W))


def naive_sparse_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grid: tuple[int, int],
    block_size: int,
    halo: int,
    *,
    num_prefix_tokens: int = 0,
    scale: float | None = None,
) -> torch.Tensor:
    """Naive twin of :func:`sparse_attn`: explicit N x N scores with the block-plus-halo mask (prefix rows
    see every token, patch rows their block plus halo only)."""
    allowed = with_prefix_tokens(sparse_mask(grid, block_size, halo, q.device), num_prefix_tokens)
    return naive_masked_attn(q, k, v, allowed, scale)
