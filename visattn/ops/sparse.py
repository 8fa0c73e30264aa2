"""2D blocked local attention with a halo (HaloNet, Vaswani et al. 2021) on the tiled engine.

The sliding window of sparse transformers made 2D and blocked: the grid is cut into b x b blocks
(the last block of an axis may be partial) and every query of a block attends to the block grown by
``halo`` cells on each side, cut at the grid border (keys outside the grid do not exist). Per axis the
queries of block ``[s, min(s + b, L))`` see ``[s - halo, s + b + halo) ∩ [0, L)``.
"""
from __future__ import annotations

import torch

from visattn.ops.checks import check_dropout, check_nonnegative_int, check_positive_int, check_qkv_grid
from visattn.ops.local.engine import local_attn_on_grid
from visattn.ops.local.naive import naive_grid_attn, separable_grid_mask
from visattn.ops.local.plans import blocked_axis


def sparse_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_size: int,
    halo: int,
    dropout_p: float = 0.0,
    scale: float | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Softmax attention of each b x b query block over the block plus a halo.

    Args:
        q, k, v: (B, heads, H, W, d).
        block_size: block side b.
        halo: cells added on each side of the block (0: plain non-overlapping block attention).
        dropout_p: dropout on the attention weights.
        scale: score scale, default d^-0.5.
        backend: the tiled engine's path, ``"chunked"``, ``"gathered"`` or ``"dense"`` (see
            :func:`visattn.ops.local.tiled_local_attn`); None: chosen.
    Returns:
        (B, heads, H, W, d)
    """
    check_qkv_grid(q, k, v, "sparse_attn")
    check_dropout(dropout_p, "sparse_attn")
    check_positive_int(block_size, "block_size", "sparse_attn")
    check_nonnegative_int(halo, "halo", "sparse_attn")
    H, W = q.shape[2:4]
    rows = blocked_axis(H, block_size, halo, q.device)
    cols = blocked_axis(W, block_size, halo, q.device)
    return local_attn_on_grid(q, k, v, rows, cols, dropout_p=dropout_p, scale=scale, backend=backend)


def sparse_mask(
    grid: tuple[int, int], block_size: int, halo: int, device: torch.device | None = None
) -> torch.Tensor:
    """(H*W, H*W) bool, row-major tokens: ``[i, j]`` says query i may see key j. The plain definition."""
    H, W = grid

    def axis(length: int) -> torch.Tensor:  # (length, length): query position x key position
        pos = torch.arange(length, device=device)
        block_start = pos // block_size * block_size
        return (block_start[:, None] - halo <= pos[None, :]) & (pos[None, :] < block_start[:, None] + block_size + halo)

    return separable_grid_mask(axis(H), axis(W))


def naive_sparse_attn(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_size: int, halo: int, scale: float | None = None
) -> torch.Tensor:
    """Naive twin of :func:`sparse_attn`: explicit N x N scores with the block-plus-halo mask."""
    H, W = q.shape[2:4]
    return naive_grid_attn(q, k, v, sparse_mask((H, W), block_size, halo, q.device), scale)
