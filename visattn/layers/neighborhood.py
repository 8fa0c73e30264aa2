"""2D neighbourhood attention layer (NATTEN semantics): each patch sees its k x k grid neighbours."""
from __future__ import annotations

from typing import Any

import torch

from visattn.layers.local import LocalWindowAttention
from visattn.ops.checks import check_positive_int
from visattn.ops.local import (
    ALIGNED_TILE,
    AxisPlan,
    AxisTiling,
    check_aligned_tile,
    check_tile_alignment,
    neighborhood_tiling,
    tile_neighborhood_tiling,
    tiles_holding,
)
from visattn.ops.neighborhood import neighborhood_attn, neighborhood_plans


class NeighborhoodAttention(LocalWindowAttention):
    """Patch tokens attend to their k x k neighbourhood (shifted inward at the borders, so always k^2
    keys); prefix tokens attend to all tokens. Per head the patches cost O(N (t + k - 1)^2 d) with tile
    side t (each query scores its tile's key region, N k^2 d of it useful), the prefix O(P N d).

    With ``tile_aligned=True``, neighbourhoods strided by a tile (GNA's strided neighbourhood): the queries
    of each ``aligned_tile`` share one window, the fewest whole tiles centred on their tile (shifted inward
    at the borders) that hold every one of their k x k neighbourhoods; with k = 7 and 8 x 16 tiles, 3 x 3
    tiles, 24 x 48 patches. Every query still sees its own neighbourhood, and more. It is an option of
    this type, not a type of its own, because it is the same neighbourhood with the tile's stride: a
    ``neighborhood`` row of a table, a config or ``attn_kwargs`` reads the same with it, and the flat
    option ``tile_aligned=true`` applies to ``sparse`` as well. The default tile is FlexAttention's block
    on the CUDA path, so every block it keeps there is full and computed without a mask (those of a ragged
    last tile, where 8 or 16 does not divide a grid side, are partial); the tile is fixed by the option,
    so the layer computes the same function on every device and path. Per head the patches cost
    O(N R^2 d) with R^2 the window's cells: more scores than the exact window, in fewer, unmasked blocks.

    Type options:
        kernel_size: odd window side k, clamped to a grid side smaller than k.
        tile_size: side of the query tiles of the blocked computation; does not change the result.
            Unused with tile_aligned (the tiles are then aligned_tile).
        tile_aligned: neighbourhoods strided by a tile, each tile's window whole tiles.
        aligned_tile: (rows, cols) of that tile in patches, or one integer for a square one (8 x 16).
    """

    name = "neighborhood"
    supports_attn_drop = True

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        *,
        kernel_size: int = 7,
        tile_size: int = 8,
        tile_aligned: bool = False,
        aligned_tile: tuple[int, int] = ALIGNED_TILE,
        **contract: Any,
    ) -> None:
        super().__init__(dim, num_heads, **contract)
        check_positive_int(kernel_size, "kernel_size", self.name, odd=True)
        check_positive_int(tile_size, "tile_size", self.name)
        check_tile_alignment(tile_aligned, aligned_tile, self.name)
        self.kernel_size = kernel_size
        self.tile_size = tile_size
        self.tile_aligned = tile_aligned
        self.aligned_tile = check_aligned_tile(aligned_tile, self.name)

    def mix(self, q, k, v, grid, attn_mask, is_causal) -> torch.Tensor:
        return neighborhood_attn(
            q, k, v, grid, self.kernel_size, num_prefix_tokens=self.num_prefix_tokens, tile_size=self.tile_size,
            tile_aligned=self.tile_aligned, aligned_tile=self.aligned_tile, dropout_p=self.dropout_p,
            token_order=self.token_order,
        )

    def window_plans(self, grid, device) -> tuple[AxisPlan, AxisPlan]:
        tile = self.aligned_tile if self.tile_aligned else None
        return neighborhood_plans(grid, self.kernel_size, self.tile_size, tile, device)

    def extra_repr(self) -> str:
        if self.tile_aligned:
            return super().extra_repr() + f", kernel_size={self.kernel_size}, aligned_tile={self.aligned_tile}"
        return super().extra_repr() + f", kernel_size={self.kernel_size}, tile_size={self.tile_size}"

    @staticmethod
    def window_tilings(grid, options) -> tuple[AxisTiling, AxisTiling]:
        """The k x k window of every patch: ``S_L = L min(k, L)`` keys seen along an axis of length L, so
        the patches cost ``4 C S_H S_W`` FLOPs. Tile-aligned: ``S_L`` sums, over the tiles of side t, the
        tile's cells times its window's (2 r + 1 tiles, r = ceil((k // 2) / t), cut to the axis)."""
        k = options["kernel_size"]
        tile = check_tile_alignment(options.get("tile_aligned", False), options.get("aligned_tile", ALIGNED_TILE),
                                    "neighborhood")
        if tile is None:
            rows, cols = (neighborhood_tiling(length, k, options["tile_size"]) for length in grid)
        else:
            rows, cols = (
                tile_neighborhood_tiling(length, t, tiles_holding(k // 2, t)) for length, t in zip(grid, tile)
            )
        return rows, cols
