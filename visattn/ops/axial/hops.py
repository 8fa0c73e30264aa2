"""The two hops of axial attention on PyTorch's ``scaled_dot_product_attention``: rows, then columns.

Hop 1 runs B * H row sequences of P + W keys with values v; hop 2 runs B * W column sequences of
P + H keys whose values are hop 1's output (the prefix tokens keep v). Prefix queries attend to all N
tokens. The einops patterns name the row and column layouts of the patch tokens (raster order).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange

from visattn.ops.layout import split_prefix

ROWS = "b heads (y x) d -> (b y) heads x d"
COLUMNS = "b heads (y x) d -> (b x) heads y d"
FROM_ROWS = "(b y) heads x d -> b heads (y x) d"
FROM_COLUMNS = "(b x) heads y d -> b heads (y x) d"
COLUMNS_TO_ROWS = "(b x) heads y d -> (b y) heads x d"
COLUMNS_TO_TOKENS = "(b x) heads y d -> b (y x) heads d"
# The same sequences as views with the image axis kept apart: (b y) and (b x) merge as views only at
# batch 1 (or without prefix tokens), since each image's prefix tokens sit between its patches and the
# next image's.
ROW_PATCHES = "b heads (y x) d -> b y x heads d"
COLUMN_PATCHES = "b heads (y x) d -> b x y heads d"
ROWS_AS_COLUMN_PATCHES = "(b y) heads x d -> b x y heads d"
SEQUENCES = "b s l heads d -> (b s) heads l d"


def with_prefix(patches: torch.Tensor, prefix: torch.Tensor, copy: bool = False) -> torch.Tensor:
    """The row (or column) sequences of the patches with the prefix tokens in front, in one copy.

    Args:
        patches: (B, S, L, heads, d), S rows (or columns) of L patches per image, any strides.
        prefix: (B, heads, P, d).
        copy: copy also without prefix tokens (a column view strides a whole row between its tokens,
            which the fused kernel reads slowly).
    Returns:
        (B * S, heads, P + L, d), token-major in memory; without prefix tokens and ``copy``, the
        patches merged (a view where their layout allows).
    """
    b, s, length, heads, d = patches.shape
    p = prefix.shape[2]
    if p == 0 and not copy:
        return rearrange(patches, SEQUENCES)
    seqs = patches.new_empty(b, s, p + length, heads, d)
    if p:
        seqs[:, :, :p] = rearrange(prefix, "b heads p d -> b 1 p heads d")  # broadcast over the S sequences
    seqs[:, :, p:] = patches
    return rearrange(seqs, SEQUENCES)


def row_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, h: int, p: int) -> tuple[torch.Tensor, ...]:
    """Hop 1's q, k, v: (B * H, heads, W (+ P), d); q is a view, k and v get the prefix in front."""
    (_, q_patches), (k_prefix, k_patches), (v_prefix, v_patches) = (split_prefix(t, p) for t in (q, k, v))
    q_rows = rearrange(q_patches, ROWS, y=h)
    k_rows = with_prefix(rearrange(k_patches, ROW_PATCHES, y=h), k_prefix)
    v_rows = with_prefix(rearrange(v_patches, ROW_PATCHES, y=h), v_prefix)
    return q_rows, k_rows, v_rows


def column_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, v_mixed: torch.Tensor, h: int, p: int, contiguous_q: bool = True
) -> tuple[torch.Tensor, ...]:
    """Hop 2's q, k, v: (B * W, heads, H (+ P), d), copies (a column view strides a whole row between
    its tokens, which the fused kernel reads slowly; its backward kernel minds less, so the queries may
    stay a view there); the values are hop 1's output ``v_mixed`` (B * H, heads, W, d), the prefix
    tokens keep v."""
    (_, q_patches), (k_prefix, k_patches) = (split_prefix(t, p) for t in (q, k))
    q_cols = rearrange(q_patches, COLUMNS, y=h)
    q_cols = q_cols.contiguous() if contiguous_q else q_cols
    k_cols = with_prefix(rearrange(k_patches, COLUMN_PATCHES, y=h), k_prefix, copy=True)
    v_cols = with_prefix(rearrange(v_mixed, ROWS_AS_COLUMN_PATCHES, b=q.shape[0]), v[:, :, :p], copy=True)
    return q_cols, k_cols, v_cols


def rows_then_columns(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, h: int, p: int, dropout_p: float, scale: float | None
) -> torch.Tensor:
    """The two hops and the prefix rows; (B, heads, N, d) -> (B, N, heads, d), token-major."""
    B, heads, n, d = q.shape
    v_mixed = F.scaled_dot_product_attention(*row_inputs(q, k, v, h, p), dropout_p=dropout_p, scale=scale)
    out = F.scaled_dot_product_attention(
        *column_inputs(q, k, v, v_mixed, h, p), dropout_p=dropout_p, scale=scale
    )  # (B * W, heads, H, d)
    mixed = out.new_empty(B, n, heads, d)  # in the attention's dtype (autocast may lower it)
    mixed[:, p:] = rearrange(out, COLUMNS_TO_TOKENS, b=B)
    if p:  # prefix queries see every token
        mixed[:, :p] = F.scaled_dot_product_attention(
            q[:, :, :p], k, v, dropout_p=dropout_p, scale=scale
        ).transpose(1, 2)
    return mixed
