"""The tiled engine shared by the 2D local attention ops (neighborhood, sparse, longformer).

Queries are cut into tiles of ``t x t`` grid cells. The windows of all queries in a tile lie inside one
rectangular region of keys (``R_h x R_w`` cells), so each tile gathers its region once, an additive mask
(0 or -inf, cached per layout and shared by batch and heads) trims the region to each query's own
window, and PyTorch's fused ``scaled_dot_product_attention`` runs over the tiles (a 4D float mask keeps
it on the fused kernel; a bool or 3D mask would send it to the explicit-scores path). Per head this
costs ``N R^2`` scores, never materialised; keys are gathered once per tile (``N R^2 / t^2`` rows of
``d``), never once per query (the ``N k^2 d`` of an unfold) and never ``N x N``.

The gathers read the token-major layout (B, N, heads * d) that the qkv projection produces, so a tile's
keys of all heads are copied as whole rows, and the output comes back token-major, so the layer merges
the heads with a view. On the CPU without autograd the tiles run a chunk at a time through
:func:`visattn.ops.local.chunked.attend_in_chunks` (the gathered regions stay in cache); with autograd, and on
other devices, all tiles are gathered at once and the fused kernel's own backward pass applies. On CUDA
the same tiles run as fused Triton kernels (:mod:`visattn.ops.local.triton`) that address each tile's
region in place and compute the windows from the cells' positions, gathering nothing. Where the
windows cover most of a short sequence (a 7 x 7 window on 14 x 14 patches: every 8 x 8 tile's region is
the whole grid), the tiles save nothing and cost their gathers: the whole attention then runs as one
SDPA over all tokens with the windows as a mask (:func:`visattn.ops.backends.choose_local_backend`
decides).

Each op only describes its windows per axis, as an :class:`~visattn.ops.local.plans.AxisPlan`; the
engine is the same.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from visattn.ops.backends import choose_local_backend, needs_autograd, planned_backend, select_backend
from visattn.ops.cache import cache_per_inference_mode
from visattn.ops.checks import check_grid, check_grid_size, check_nonnegative_int
from visattn.ops.layout import merge_heads, split_heads, token_major
from visattn.ops.local.chunked import Sequences, attend_in_chunks
from visattn.ops.local.flex import check_token_order, flex_local_attn, full_block_tile
from visattn.ops.local.naive import separable_grid_mask, with_prefix_tokens
from visattn.ops.local.plans import AxisPlan, AxisTiling
from visattn.ops.local.triton import triton_local_attn


@dataclass(frozen=True, eq=False)
class _TileLayout:
    """The tiles as short attention sequences over the tokens (prefix tokens first, then the patches in
    raster order): query slot j of tile i reads token ``seqs.q_index[i, j]``, key slot s reads token
    ``seqs.kv_index[i, s]`` (the visible prefix tokens first, then the region), and ``seqs.bias`` trims
    the region to each query's window. Padding slots past the grid edge take the edge query: its window
    is the edge query's (see the plans), so the slot stays a valid softmax row; its output is dropped."""

    seqs: Sequences
    out_index: torch.Tensor  # (H * W,) flat query slot of each patch, raster order


@cache_per_inference_mode(maxsize=32)
def _tile_layout(
    rows: AxisPlan, cols: AxisPlan, num_prefix_tokens: int, prefix_visible: bool, dtype: torch.dtype
) -> _TileLayout:
    device = rows.region_start.device
    H, W, p = rows.length, cols.length, num_prefix_tokens
    th, tw, bh, bw = rows.num_tiles, cols.num_tiles, rows.tile, cols.tile
    num_tiles, queries = th * tw, bh * bw
    q_rows = torch.arange(th * bh, device=device).clamp_max(H - 1).view(th, 1, bh, 1)
    q_cols = torch.arange(tw * bw, device=device).clamp_max(W - 1).view(1, tw, 1, bw)
    q_index = (p + q_rows * W + q_cols).reshape(num_tiles, queries)  # (th, tw, bh, bw) -> (T, L)
    k_rows = rows.key_index().view(th, 1, rows.region, 1)
    k_cols = cols.key_index().view(1, tw, 1, cols.region)
    kv_index = (p + k_rows * W + k_cols).reshape(num_tiles, -1)  # (T, R_h * R_w)
    allowed = rows.mask()[:, None, :, None, :, None] & cols.mask()[None, :, None, :, None, :]
    allowed = allowed.reshape(num_tiles, queries, -1)  # (th, tw, bh, bw, R_h, R_w) -> (T, L, R_h * R_w)
    if prefix_visible and p:
        kv_index = torch.cat([torch.arange(p, device=device).expand(num_tiles, p), kv_index], dim=1)
        allowed = torch.cat([allowed.new_ones(num_tiles, queries, p), allowed], dim=2)
    bias = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))
    y, x = torch.arange(H, device=device)[:, None], torch.arange(W, device=device)[None, :]
    out_index = ((y // bh * tw + x // bw) * queries + y % bh * bw + x % bw).flatten()
    dest = torch.full((num_tiles * queries,), -1, dtype=torch.long, device=device)
    dest[out_index] = p + torch.arange(H * W, device=device)
    seqs = Sequences(q_index, kv_index, dest.view(num_tiles, queries), bias.unsqueeze(1))
    return _TileLayout(seqs, out_index)


# The tiled paths gather each tile's key region and mask it, at about the cost of the scores themselves
# (CPU, 7 x 7 windows: 64 images of 14 x 14 patches run in 65 ms dense, 131 ms chunked), so attention
# over all N keys with the windows as a mask pays where its N^2 scores are at most twice the tiles'.
DENSE_SCORE_RATIO = 2


def dense_is_cheaper(
    rows: AxisPlan | AxisTiling, cols: AxisPlan | AxisTiling, num_prefix_tokens: int, prefix_visible: bool
) -> bool:
    """Whether the windows cover enough of the grid (short sequences) for dense attention to pay. Reads the
    sizes alone, so the tilings of the plans answer it too (the cost model has only those)."""
    n = num_prefix_tokens + rows.length * cols.length
    keys = rows.region * cols.region + (num_prefix_tokens if prefix_visible else 0)
    tiled = rows.num_tiles * cols.num_tiles * rows.tile * cols.tile * keys + num_prefix_tokens * n
    return n * n <= DENSE_SCORE_RATIO * tiled


@cache_per_inference_mode(maxsize=32)
def _dense_mask(
    rows: AxisPlan, cols: AxisPlan, num_prefix_tokens: int, prefix_visible: bool, dtype: torch.dtype
) -> torch.Tensor:
    """(1, 1, N, N) additive mask (0 or -inf) of the whole attention, shared by batch and heads: prefix
    queries see every token, patch queries their window, and the prefix keys if ``prefix_visible``."""
    window = separable_grid_mask(rows.axis_mask(), cols.axis_mask())  # (H * W, H * W)
    allowed = with_prefix_tokens(window, num_prefix_tokens, prefix_visible)  # (N, N)
    n = allowed.shape[0]
    return torch.zeros(1, 1, n, n, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def is_self_only(
    rows: AxisPlan | AxisTiling, cols: AxisPlan | AxisTiling, num_prefix_tokens: int, prefix_visible: bool
) -> bool:
    """Whether every patch query's window is the query itself, and no prefix key joins it (plans or their
    tilings, as :func:`dense_is_cheaper`)."""
    return not (prefix_visible and num_prefix_tokens) and rows.self_only and cols.self_only


def _dense_path(q, k, v, rows, cols, num_prefix_tokens, prefix_visible, dropout_p, scale) -> torch.Tensor:
    """All N keys, the windows as an N x N additive mask: one SDPA, differentiable."""
    mask = _dense_mask(rows, cols, num_prefix_tokens, prefix_visible, q.dtype)
    # token-major when q is (a view of the qkv projection); else made so, as the other paths return
    return token_major(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale))


def _chunked_path(q, k, v, rows, cols, num_prefix_tokens, prefix_visible, dropout_p, scale) -> torch.Tensor:
    """The tiles a chunk at a time through :func:`visattn.ops.local.chunked.attend_in_chunks`: inference only."""
    B, heads, N, _ = q.shape
    p = num_prefix_tokens
    needs_grad = needs_autograd(q, k, v)
    if needs_grad or dropout_p:
        raise ValueError(
            f"tiled_local_attn: backend 'chunked' has no autograd and no dropout; got dropout_p={dropout_p} "
            f"and inputs {'with' if needs_grad else 'without'} autograd; use 'gathered'"
        )
    layout = _tile_layout(rows, cols, p, prefix_visible, q.dtype)
    tokens = (merge_heads(t).flatten(0, 1) for t in (q, k, v))  # (B * N, heads * d): views of a qkv projection
    out = attend_in_chunks(*tokens, layout.seqs, B, heads, scale).view(B, N, heads, -1)
    if p:
        out[:, :p] = F.scaled_dot_product_attention(q[:, :, :p], k, v, scale=scale).transpose(1, 2)
    return out.transpose(1, 2)


def _gathered_path(q, k, v, rows, cols, num_prefix_tokens, prefix_visible, dropout_p, scale) -> torch.Tensor:
    """All tiles gathered at once, one SDPA over them, differentiable; prefix queries over all N keys."""
    B, heads, _, _ = q.shape
    p = num_prefix_tokens
    if is_self_only(rows, cols, p, prefix_visible):
        # softmax over the one key, the query's own: weight exp(s - s) = 1 and gradient 0, both exactly
        # (the fused kernel's backward would leave rounding noise where the gradient is exactly zero)
        scores = (q[:, :, p:] * k[:, :, p:]).sum(dim=-1, keepdim=True)
        weight = F.dropout((scores - scores).exp(), dropout_p) if dropout_p else (scores - scores).exp()
        out = (v[:, :, p:] * weight).transpose(1, 2)  # (B, H * W, heads, d_v)
    else:
        layout = _tile_layout(rows, cols, p, prefix_visible, q.dtype)
        T, L = layout.seqs.num_seqs, layout.seqs.q_index.shape[1]

        def gather(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:  # -> (B * T, heads, slots, d)
            tokens = merge_heads(t)  # (B, N, heads * d): a view of a qkv projection
            return split_heads(tokens.index_select(1, index.flatten()).view(B * T, index.shape[1], -1), heads)

        bias = layout.seqs.bias if B == 1 else layout.seqs.bias.repeat(B, 1, 1, 1)
        out = F.scaled_dot_product_attention(
            gather(q, layout.seqs.q_index),
            gather(k, layout.seqs.kv_index),
            gather(v, layout.seqs.kv_index),
            attn_mask=bias.expand(-1, heads, -1, -1),  # 4D, so SDPA keeps its fused kernel
            dropout_p=dropout_p,
            scale=scale,
        )  # (B * T, heads, L, d_v)
        out = out.transpose(1, 2).reshape(B, T * L, heads, -1).index_select(1, layout.out_index)
    if p:
        prefix = F.scaled_dot_product_attention(q[:, :, :p], k, v, dropout_p=dropout_p, scale=scale)
        out = torch.cat([prefix.transpose(1, 2), out], dim=1)  # (B, N, heads, d_v)
    return out.transpose(1, 2)


def _flex_path(q, k, v, rows, cols, num_prefix_tokens, prefix_visible, dropout_p, scale, token_order="raster"):
    """FlexAttention over the tokens in tile order (:mod:`visattn.ops.local.flex`): differentiable, no dropout."""
    if dropout_p:
        raise ValueError(f"tiled_local_attn: backend 'flex' has no dropout, got dropout_p={dropout_p}; use 'gathered'")
    return flex_local_attn(q, k, v, rows, cols, num_prefix_tokens, prefix_visible, scale, token_order)


def _triton_path(q, k, v, rows, cols, num_prefix_tokens, prefix_visible, dropout_p, scale) -> torch.Tensor:
    """Fused Triton kernels on 2D query tiles (:mod:`visattn.ops.local.triton`): differentiable, no dropout."""
    if dropout_p:
        raise ValueError(
            f"tiled_local_attn: backend 'triton' has no dropout, got dropout_p={dropout_p}; use 'gathered'"
        )
    return triton_local_attn(q, k, v, rows, cols, num_prefix_tokens, prefix_visible, scale)


# backend name (visattn.ops.backends.BACKENDS["local"]) -> path; each takes
# (q, k, v, rows, cols, num_prefix_tokens, prefix_visible, dropout_p, scale) -> (B, heads, N, d_v)
LOCAL_PATHS = {
    "chunked": _chunked_path, "gathered": _gathered_path, "dense": _dense_path, "flex": _flex_path,
    "triton": _triton_path,
}


def check_grid_for_order(
    grid: tuple[int, int], num_tokens: int, num_prefix_tokens: int, token_order: str, op: str
) -> tuple[int, int]:
    """(H, W) of a local op's grid: in raster order the tokens must be P + H * W; in tile order they are
    the layout's slots, which the FlexAttention path checks."""
    check_token_order(token_order, op)
    if token_order == "tile":
        check_nonnegative_int(num_prefix_tokens, "num_prefix_tokens", op)
        return check_grid_size(grid, "grid", op)
    return check_grid(grid, num_tokens, num_prefix_tokens, op)


def _chooser(
    device: torch.device, needs_grad: bool, dropout_p: float, rows: AxisPlan | AxisTiling, cols: AxisPlan | AxisTiling,
    num_prefix_tokens: int, prefix_visible: bool,
) -> Callable[[], str]:
    """:func:`visattn.ops.backends.choose_local_backend` for these windows, to be called by the selection."""
    p = num_prefix_tokens
    return lambda: choose_local_backend(
        device,
        needs_grad,
        dropout_p,
        is_self_only(rows, cols, p, prefix_visible),
        dense_is_cheaper(rows, cols, p, prefix_visible),
        full_blocks=full_block_tile(rows, cols) is not None,
    )


def planned_local_backend(
    device: torch.device, needs_grad: bool, dropout_p: float, rows: AxisPlan | AxisTiling, cols: AxisPlan | AxisTiling,
    num_prefix_tokens: int, prefix_visible: bool,
) -> str:
    """The path :func:`tiled_local_attn` takes, without ``backend=``, for inputs on ``device``, logging nothing:
    what a model asks before its layers run (to keep the tokens in tile order where every layer takes ``flex``)
    and what the cost model counts. Reads the windows' sizes alone, so the plans' tilings answer it too."""
    return planned_backend(
        "local", _chooser(device, needs_grad, dropout_p, rows, cols, num_prefix_tokens, prefix_visible)
    )


def tiled_local_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rows: AxisPlan,
    cols: AxisPlan,
    num_prefix_tokens: int = 0,
    prefix_visible: bool = False,
    dropout_p: float = 0.0,
    scale: float | None = None,
    backend: str | None = None,
    token_order: str = "raster",
) -> torch.Tensor:
    """Each patch query attends to its window (rows x cols), plus every prefix key if ``prefix_visible``,
    in one softmax; each prefix query attends to all N tokens.

    Args:
        q, k, v: (B, heads, N, d), N = num_prefix_tokens + H * W with H = rows.length, W = cols.length,
            prefix tokens first, patches in raster order; with ``token_order="tile"``, (B, heads, S, d) in
            FlexAttention's tile order (:func:`visattn.ops.local.flex.flex_local_attn`).
        rows, cols: the window plan of each axis.
        num_prefix_tokens: P, the tokens before the patches.
        prefix_visible: whether patch queries see the prefix keys (Longformer's global tokens) or not.
        backend: a name of :data:`LOCAL_PATHS`: ``"chunked"`` (tiles a chunk at a time through
            :func:`visattn.ops.local.chunked.attend_in_chunks`; no autograd, no dropout), ``"gathered"``
            (all tiles at once, differentiable), ``"dense"`` (all N keys, the windows as an N x N
            mask, differentiable), ``"flex"`` (FlexAttention, :mod:`visattn.ops.local.flex`;
            differentiable, no dropout) or ``"triton"`` (fused kernels, :mod:`visattn.ops.local.triton`;
            CUDA or the CPU interpreted, differentiable, no dropout); None: chosen by
            :func:`visattn.ops.backends.choose_local_backend`. Tokens in tile order take ``"flex"``, the
            one path that reads them so.
        token_order: ``"raster"`` or ``"tile"``.
    Returns:
        (B, heads, N, d_v), a view of a token-major (B, N, heads, d_v) tensor; (B, heads, S, d_v) in tile order.
    """
    check_token_order(token_order, "tiled_local_attn")
    p = num_prefix_tokens
    if token_order == "tile":  # flex is the one path that reads tokens in tile order
        name = select_backend("local", backend, lambda: "flex")
        if name != "flex":
            raise ValueError(f"tiled_local_attn: tokens in tile order take backend 'flex', got {name!r}")
        return _flex_path(q, k, v, rows, cols, p, prefix_visible, dropout_p, scale, token_order)
    name = select_backend(
        "local", backend, _chooser(q.device, needs_autograd(q, k, v), dropout_p, rows, cols, p, prefix_visible)
    )
    return LOCAL_PATHS[name](q, k, v, rows, cols, p, prefix_visible, dropout_p, scale)
