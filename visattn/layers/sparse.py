"""2D blocked local attention layer with a halo (HaloNet): b x b query blocks see the block plus a halo."""
from __future__ import annotations

from typing import Any

import torch

from visattn.layers.local import LocalWindowAttention
from visattn.ops.checks import check_nonnegative_int, check_positive_int
from visattn.ops.local import (
    ALIGNED_TILE,
    AxisPlan,
    AxisTiling,
    blocked_tiling,
    check_aligned_tile,
    check_tile_alignment,
)
from visattn.ops.sparse import aligned_blocks, sparse_attn, sparse_plans


class SparseAttention(LocalWindowAttention):
    """Patch tokens in b x b blocks attend to their block grown by ``halo`` cells on each side (cut at
    the grid border); prefix tokens attend to all tokens. O(N (b + 2 halo)^2 d) per head for the patches.

    With ``tile_aligned=True`` the blocks are the tiles of ``aligned_tile`` (8 x 16 patches by default) and
    the halo is rounded out to whole tiles: ``halo=0`` gives Swin's windows without the shift, each tile
    attending to itself; ``halo=3`` the tile and its neighbouring tiles, 3 x 3 tiles (24 x 48 patches),
    cut at the border. An option of this type rather than a type of its own, since it is the same blocks
    and halo, whole tiles: a ``sparse`` row of a table, a config or ``attn_kwargs`` reads the same with it,
    and the flat option ``tile_aligned=true`` applies to ``neighborhood`` as well. The default tile is
    FlexAttention's block on the CUDA path, so every block it keeps there is full and computed without a
    mask (those of a ragged last tile, where 8 or 16 does not divide a grid side, are partial); the tile
    is fixed by the option, so the layer computes the same function on every device and path.

    Type options:
        block_size: block side b; the last block of an axis may be partial. Unused with tile_aligned.
        halo: cells added on each side of a block (0: non-overlapping block attention).
        tile_aligned: blocks of whole tiles with halos of whole tiles.
        aligned_tile: (rows, cols) of that tile in patches, or one integer for a square one (8 x 16).
    """

    name = "sparse"
    supports_attn_drop = True

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        *,
        block_size: int = 8,
        halo: int = 3,
        tile_aligned: bool = False,
        aligned_tile: tuple[int, int] = ALIGNED_TILE,
        **contract: Any,
    ) -> None:
        super().__init__(dim, num_heads, **contract)
        check_positive_int(block_size, "block_size", self.name)
        check_nonnegative_int(halo, "halo", self.name)
        check_tile_alignment(tile_aligned, aligned_tile, self.name)
        self.block_size = block_size
        self.halo = halo
        self.tile_aligned = tile_aligned
        self.aligned_tile = check_aligned_tile(aligned_tile, self.name)

    def mix(self, q, k, v, grid, attn_mask, is_causal) -> torch.Tensor:
        return sparse_attn(
            q, k, v, grid, self.block_size, self.halo, num_prefix_tokens=self.num_prefix_tokens,
            tile_aligned=self.tile_aligned, aligned_tile=self.aligned_tile, dropout_p=self.dropout_p,
            token_order=self.token_order,
        )

    def window_plans(self, grid, device) -> tuple[AxisPlan, AxisPlan]:
        tile = self.aligned_tile if self.tile_aligned else None
        return sparse_plans(grid, self.block_size, self.halo, tile, device)

    def extra_repr(self) -> str:
        if self.tile_aligned:
            return super().extra_repr() + f", aligned_tile={self.aligned_tile}, halo={self.halo}"
        return super().extra_repr() + f", block_size={self.block_size}, halo={self.halo}"

    @staticmethod
    def window_tilings(grid, options) -> tuple[AxisTiling, AxisTiling]:
        """Each query's block plus halo, cut at the border: ``S_L = sum_i |block(i) + halo|`` keys seen
        along an axis, so the patches cost ``4 C S_H S_W`` FLOPs; tile-aligned, the blocks and halos of
        whole tiles."""
        tile = check_tile_alignment(options.get("tile_aligned", False), options.get("aligned_tile", ALIGNED_TILE),
                                    "sparse")
        blocks = aligned_blocks(options["block_size"], options["halo"], tile)
        rows, cols = (blocked_tiling(length, block, halo) for length, (block, halo) in zip(grid, blocks))
        return rows, cols
