"""Window plans of the tiled local engine: how each grid axis is cut into query tiles and which keys each
query of a tile sees. Each local op describes its windows per axis as an :class:`AxisPlan`; the
engine (:func:`visattn.ops.local.tiled_local_attn`) is the same for all of them."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from visattn.ops.cache import cache_per_inference_mode


# The tile of the tile-aligned windows by default: FlexAttention's block of 128 tokens as the CUDA path lays
# it out (visattn.ops.local.flex: 8 x 16 cells where the grid is at least 16 wide).
ALIGNED_TILE = (8, 16)


class WindowRule(NamedTuple):
    """The windows of one axis as a formula, for kernels that compute them from the query's position
    instead of reading ``window_lo`` and ``window_hi``: ``"neighborhood"``: query i sees ``[s, s + size)``
    with ``s = clamp(i - size // 2, 0, length - size)`` (``size`` clamped to the axis); ``"blocked"``: the
    block ``[i // size * size, +size)`` grown by ``halo`` on each side, cut at the axis ends;
    ``"tile_neighborhood"``: the tile ``j = i // size`` sees the ``m = min(2 r + 1, n)`` tiles from
    ``clamp(j - r, 0, n - m)`` on, ``r = halo // size`` and ``n`` the axis's tiles, cut at the axis end."""

    kind: str
    size: int
    halo: int = 0


@dataclass(frozen=True, eq=False)
class AxisPlan:
    """How one grid axis of ``length`` cells is tiled.

    Query ``i`` (padded positions past the end included) sees keys ``[window_lo[i], window_hi[i])``; the
    queries ``[j * tile, (j + 1) * tile)`` of tile ``j`` read the keys
    ``[region_start[j], region_start[j] + region)``, which contain all their windows. Plans are cached
    and compared by identity.
    """

    length: int
    tile: int
    region: int
    region_start: torch.Tensor  # (num_tiles,) long
    window_lo: torch.Tensor  # (num_tiles * tile,) long
    window_hi: torch.Tensor  # (num_tiles * tile,) long
    self_only: bool  # every query's window is the query itself
    rule: WindowRule  # the same windows as a formula

    @property
    def num_tiles(self) -> int:
        return self.region_start.shape[0]

    @property
    def whole_tiles(self) -> bool:
        """Every window is a run of whole tiles (the axis's last tile may be ragged)."""
        return windows_are_whole_tiles(self.rule, self.length, self.num_tiles)

    def key_index(self) -> torch.Tensor:
        """(num_tiles, region): the key position of each region slot."""
        return self.region_start[:, None] + torch.arange(self.region, device=self.region_start.device)

    def axis_mask(self) -> torch.Tensor:
        """(length, length) bool: query i may see key j, over the whole axis."""
        keys = torch.arange(self.length, device=self.region_start.device)
        lo, hi = self.window_lo[: self.length, None], self.window_hi[: self.length, None]
        return (lo <= keys) & (keys < hi)

    def mask(self) -> torch.Tensor:
        """(num_tiles, tile, region) bool: query may see the key in this region slot."""
        keys = self.key_index()[:, None, :]  # (num_tiles, 1, region)
        lo = self.window_lo.view(self.num_tiles, self.tile, 1)
        hi = self.window_hi.view(self.num_tiles, self.tile, 1)
        return (lo <= keys) & (keys < hi)


class AxisTiling(NamedTuple):
    """The sizes of one axis's tiling, in plain integers (the cost formulas of the layers read them too):
    ``num_tiles`` query tiles of ``tile`` cells, each reading a key region of ``region`` cells, and
    ``keys_seen``, the keys in the windows of the axis's ``length`` queries, summed."""

    tile: int
    num_tiles: int
    region: int
    keys_seen: int
    length: int
    whole_tiles: bool = False  # every window is a run of whole tiles, as :attr:`AxisPlan.whole_tiles`

    @property
    def self_only(self) -> bool:
        """Every query's window is the query itself: one key each, and a window holds its own query."""
        return self.keys_seen == self.length


def windows_are_whole_tiles(rule: WindowRule, length: int, num_tiles: int) -> bool:
    """Whether the windows of ``rule`` on an axis of ``length`` cells in ``num_tiles`` tiles are runs of whole
    tiles: the tile-aligned windows, blocks whose halo is whole blocks or that fill the axis, and
    neighbourhoods as wide as the axis."""
    if rule.kind == "neighborhood":
        return rule.size == length
    if rule.kind == "blocked":
        return num_tiles == 1 or rule.halo % rule.size == 0
    return True


def check_aligned_tile(aligned_tile: int | tuple[int, int] | list[int], op: str) -> tuple[int, int]:
    """(rows, cols) of the ``aligned_tile`` option: two integers >= 1, or one for a square tile."""
    shape = (aligned_tile, aligned_tile) if isinstance(aligned_tile, int) else aligned_tile
    if not (isinstance(shape, (tuple, list)) and len(shape) == 2
            and all(isinstance(side, int) and not isinstance(side, bool) and side >= 1 for side in shape)):
        raise ValueError(f"{op}: aligned_tile must be (rows, cols), two integers >= 1 (or one), got {aligned_tile!r}")
    return int(shape[0]), int(shape[1])


def check_tile_alignment(
    tile_aligned: bool, aligned_tile: int | tuple[int, int] | list[int], op: str
) -> tuple[int, int] | None:
    """The tile (rows, cols) the windows are aligned to, None for the exact windows; ValueError naming a bad
    ``tile_aligned`` (True or False) or ``aligned_tile`` (:func:`check_aligned_tile`)."""
    if not isinstance(tile_aligned, bool):
        raise ValueError(f"{op}: tile_aligned must be True or False, got {tile_aligned!r}")
    shape = check_aligned_tile(aligned_tile, op)
    return shape if tile_aligned else None


def tiles_holding(cells: int, tile: int) -> int:
    """The whole tiles of ``tile`` cells that hold ``cells`` cells: a halo or half a window rounded out."""
    return -(-cells // tile)


def neighborhood_tiling(length: int, kernel_size: int, tile_size: int) -> AxisTiling:
    """The tiling of :func:`neighborhood_axis`: every query sees ``min(kernel_size, length)`` keys."""
    k, tile = min(kernel_size, length), min(tile_size, length)
    return AxisTiling(tile, math.ceil(length / tile), min(tile + k - 1, length), length * k, length, k == length)


def blocked_tiling(length: int, block_size: int, halo: int) -> AxisTiling:
    """The tiling of :func:`blocked_axis`: one tile per block; a block's queries see the block grown by
    ``halo`` on each side, cut at the axis ends."""
    block = min(block_size, length)
    starts = range(0, length, block)
    seen = sum((min(s + block, length) - s) * (min(s + block + halo, length) - max(s - halo, 0)) for s in starts)
    whole_tiles = len(starts) == 1 or halo % block == 0
    return AxisTiling(block, len(starts), min(block + 2 * halo, length), seen, length, whole_tiles)


def tile_neighborhood_tiling(length: int, tile_size: int, reach: int) -> AxisTiling:
    """The tiling of :func:`tile_neighborhood_axis`: each tile's queries see ``min(2 reach + 1, n)`` whole
    tiles of the axis's ``n``, the last one ragged where ``tile_size`` does not divide ``length``."""
    tile = min(tile_size, length)
    num_tiles = math.ceil(length / tile)
    span = min(2 * reach + 1, num_tiles)
    seen = 0
    for j in range(num_tiles):
        first = min(max(j - reach, 0), num_tiles - span) * tile
        seen += (min((j + 1) * tile, length) - j * tile) * (min(first + span * tile, length) - first)
    return AxisTiling(tile, num_tiles, min(span * tile, length), seen, length, whole_tiles=True)


@cache_per_inference_mode(maxsize=64)
def neighborhood_axis(length: int, kernel_size: int, tile: int, device: torch.device) -> AxisPlan:
    """NATTEN windows: query i sees ``[s, s + k)`` with ``s = clamp(i - k // 2, 0, length - k)``, i.e. the
    window is shifted inward at the borders so every query sees exactly k keys. A kernel wider than the
    axis is clamped to the axis: every query then sees the whole axis."""
    k = min(kernel_size, length)
    tile, num_tiles, region, *_ = neighborhood_tiling(length, kernel_size, tile)
    queries = torch.arange(num_tiles * tile, device=device)
    lo = (queries - k // 2).clamp(0, length - k)
    # The first query's window starts the region; the last one's ends at most tile - 1 + k cells later.
    start = (torch.arange(num_tiles, device=device) * tile - k // 2).clamp(0, length - region)
    return AxisPlan(length, tile, region, start, lo, lo + k, self_only=k == 1, rule=WindowRule("neighborhood", k))


@cache_per_inference_mode(maxsize=64)
def blocked_axis(length: int, block_size: int, halo: int, device: torch.device) -> AxisPlan:
    """HaloNet windows: the queries of block ``[s, s + b)`` see ``[s - halo, s + b + halo)`` cut to the
    axis; the last block may be partial. One tile is one block."""
    block, num_tiles, region, *_ = blocked_tiling(length, block_size, halo)
    block_start = torch.arange(num_tiles * block, device=device) // block * block
    lo = (block_start - halo).clamp_min(0)
    hi = (block_start + block + halo).clamp_max(length)
    start = (torch.arange(num_tiles, device=device) * block - halo).clamp(0, length - region)
    self_only = block == 1 and (halo == 0 or length == 1)
    return AxisPlan(length, block, region, start, lo, hi, self_only, rule=WindowRule("blocked", block, halo))


@cache_per_inference_mode(maxsize=64)
def tile_neighborhood_axis(length: int, tile_size: int, reach: int, device: torch.device) -> AxisPlan:
    """Neighbourhoods strided by a tile (GNA's strided neighbourhood, stride = the tile): the queries of tile
    j share one window, the ``2 reach + 1`` whole tiles centred on j, shifted inward at the borders so that
    it stays that many tiles (all of them on an axis with fewer), as the exact neighbourhood stays k cells.
    The last tile is ragged where ``tile_size`` does not divide ``length``."""
    tile, num_tiles, region, *_ = tile_neighborhood_tiling(length, tile_size, reach)
    span = min(2 * reach + 1, num_tiles)
    first = (torch.arange(num_tiles, device=device) - reach).clamp(0, num_tiles - span) * tile  # (num_tiles,)
    lo = first.repeat_interleave(tile)
    hi = (lo + span * tile).clamp_max(length)
    start = first.clamp_max(length - region)
    self_only = tile == 1 and span == 1
    rule = WindowRule("tile_neighborhood", tile, reach * tile)
    return AxisPlan(length, tile, region, start, lo, hi, self_only, rule)
