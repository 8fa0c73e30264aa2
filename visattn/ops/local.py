"""The tiled engine shared by the 2D local attention ops (neighborhood, sparse, longformer).

Queries are cut into tiles of ``t x t`` grid cells. The windows of all queries in a tile lie inside one
rectangular region of keys (``R_h x R_w`` cells), so each tile gathers its region once, a per-axis boolean
mask trims the region to each query's own window, and a single batched
``scaled_dot_product_attention`` runs over all tiles. Per head this costs ``N R^2`` scores and an
``O(N R^2)`` boolean mask shared by batch and heads; keys are gathered once per tile
(``N R^2 / t^2`` rows of ``d``), never once per query (the ``N k^2 d`` of an unfold) and never ``N x N``.

Each op only describes its windows per axis, as an :class:`AxisPlan`; the engine is the same.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from einops import rearrange


@dataclass(frozen=True)
class AxisPlan:
    """How one grid axis of ``length`` cells is tiled.

    Query ``i`` (padded positions past the end included) sees keys ``[window_lo[i], window_hi[i])``; the
    queries ``[j * tile, (j + 1) * tile)`` of tile ``j`` read the keys
    ``[region_start[j], region_start[j] + region)``, which contain all their windows.
    """

    length: int
    tile: int
    region: int
    region_start: torch.Tensor  # (num_tiles,) long
    window_lo: torch.Tensor  # (num_tiles * tile,) long
    window_hi: torch.Tensor  # (num_tiles * tile,) long

    @property
    def num_tiles(self) -> int:
        return self.region_start.shape[0]

    def key_index(self) -> torch.Tensor:
        """(num_tiles, region): the key position of each region slot."""
        return self.region_start[:, None] + torch.arange(self.region, device=self.region_start.device)

    def mask(self) -> torch.Tensor:
        """(num_tiles, tile, region) bool: query may see the key in this region slot."""
        keys = self.key_index()[:, None, :]  # (num_tiles, 1, region)
        lo = self.window_lo.view(self.num_tiles, self.tile, 1)
        hi = self.window_hi.view(self.num_tiles, self.tile, 1)
        return (lo <= keys) & (keys < hi)


def neighborhood_axis(length: int, kernel_size: int, tile: int, device: torch.device) -> AxisPlan:
    """NATTEN windows: query i sees ``[s, s + k)`` with ``s = clamp(i - k // 2, 0, length - k)``, i.e. the
    window is shifted inward at the borders so every query sees exactly k keys. A kernel wider than the
    axis is clamped to the axis: every query then sees the whole axis."""
    k = min(kernel_size, length)
    tile = min(tile, length)
    num_tiles = math.ceil(length / tile)
    region = min(tile + k - 1, length)
    queries = torch.arange(num_tiles * tile, device=device)
    lo = (queries - k // 2).clamp(0, length - k)
    # The first query's window starts the region; the last one's ends at most tile - 1 + k cells later.
    start = (torch.arange(num_tiles, device=device) * tile - k // 2).clamp(0, length - region)
    return AxisPlan(length, tile, region, start, lo, lo + k)


def blocked_axis(length: int, block_size: int, halo: int, device: torch.device) -> AxisPlan:
    """HaloNet windows: the queries of block ``[s, s + b)`` see ``[s - halo, s + b + halo)`` cut to the
    axis; the last block may be partial. One tile is one block."""
    block = min(block_size, length)
    num_tiles = math.ceil(length / block)
    region = min(block + 2 * halo, length)
    block_start = torch.arange(num_tiles * block, device=device) // block * block
    lo = (block_start - halo).clamp_min(0)
    hi = (block_start + block + halo).clamp_max(length)
    start = (torch.arange(num_tiles, device=device) * block - halo).clamp(0, length - region)
    return AxisPlan(length, block, region, start, lo, hi)


def tiled_local_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rows: AxisPlan,
    cols: AxisPlan,
    global_k: torch.Tensor | None = None,
    global_v: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    scale: float | None = None,
) -> torch.Tensor:
    """Each query attends to its window (rows x cols) plus every global key, in one softmax.

    Args:
        q, k, v: (B, heads, H, W, d) with H = rows.length, W = cols.length.
        rows, cols: the window plan of each axis.
        global_k, global_v: optional (B, heads, G, d) keys/values every query sees besides its window.
    Returns:
        (B, heads, H, W, d_v)
    """
    B, heads, H, W, _ = q.shape
    th, tw, bh, bw = rows.num_tiles, cols.num_tiles, rows.tile, cols.tile
    # Padded queries get valid windows from the plan; their outputs are cut off at the end.
    q = F.pad(q, (0, 0, 0, tw * bw - W, 0, th * bh - H))
    q_tiles = rearrange(q, "b n (th bh) (tw bw) d -> (b n) (th tw) (bh bw) d", bh=bh, bw=bw)
    row_index = rows.key_index()[:, :, None, None]  # (th, R_h, 1, 1)
    col_index = cols.key_index()[None, None, :, :]  # (1, 1, tw, R_w)

    def regions(t: torch.Tensor) -> torch.Tensor:  # (B, heads, H, W, d) -> (B * heads, tiles, R_h * R_w, d)
        return rearrange(t[:, :, row_index, col_index], "b n th rh tw rw d -> (b n) (th tw) (rh rw) d")

    k_tiles, v_tiles = regions(k), regions(v)
    mask = rows.mask()[:, None, :, None, :, None] & cols.mask()[None, :, None, :, None, :]
    mask = rearrange(mask, "th tw bh bw rh rw -> (th tw) (bh bw) (rh rw)")
    if global_k is not None and global_k.shape[-2] > 0:
        num_tiles = th * tw

        def with_global(tiles: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
            g = rearrange(g, "b n g d -> (b n) 1 g d").expand(-1, num_tiles, -1, -1)
            return torch.cat([tiles, g], dim=2)

        k_tiles, v_tiles = with_global(k_tiles, global_k), with_global(v_tiles, global_v)
        mask = torch.cat([mask, mask.new_ones(num_tiles, bh * bw, global_k.shape[-2])], dim=-1)
    out = F.scaled_dot_product_attention(q_tiles, k_tiles, v_tiles, attn_mask=mask, dropout_p=dropout_p, scale=scale)
    out = rearrange(out, "(b n) (th tw) (bh bw) d -> b n (th bh) (tw bw) d", b=B, th=th, bh=bh)
    return out[:, :, :H, :W]


def local_with_prefix(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grid: tuple[int, int],
    num_prefix_tokens: int,
    local_op: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Patch tokens mix through ``local_op`` on the grid and do not see the prefix tokens; the prefix
    (class/register) tokens attend to all N tokens with ordinary softmax (P x N, cheap), so a class token
    still gathers the whole image.

    Args:
        q, k, v: (B, heads, N, d), N = num_prefix_tokens + H * W, prefix tokens first.
        local_op: maps grid-layout q, k, v (B, heads, H, W, d) to (B, heads, H, W, d).
    Returns:
        (B, heads, N, d)
    """
    h, w = grid
    p = num_prefix_tokens

    def to_grid(t: torch.Tensor) -> torch.Tensor:
        return rearrange(t[:, :, p:], "b n (h w) d -> b n h w d", h=h, w=w)

    patches = rearrange(local_op(to_grid(q), to_grid(k), to_grid(v)), "b n h w d -> b n (h w) d")
    if p == 0:
        return patches
    prefix = F.scaled_dot_product_attention(q[:, :, :p], k, v, dropout_p=dropout_p)
    return torch.cat([prefix, patches], dim=2)


def check_nonnegative_int(value: int, name: str, op: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{op}: {name} must be an integer >= 0, got {value!r}")
