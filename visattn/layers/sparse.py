"""2D blocked local attention layer with a halo (HaloNet): b x b query blocks see the block plus a halo."""
from __future__ import annotations

from typing import Any

import torch

from visattn.layers.local import LocalWindowAttention
from visattn.ops.checks import check_nonnegative_int, check_positive_int
from visattn.ops.local import AxisTiling, blocked_tiling
from visattn.ops.sparse import sparse_attn


class SparseAttention(LocalWindowAttention):
    """Patch tokens in b x b blocks attend to their block grown by ``halo`` cells on each side (cut at
    the grid border); prefix tokens attend to all tokens. O(N (b + 2 halo)^2 d) per head for the patches.

    Type options:
        block_size: block side b; the last block of an axis may be partial.
        halo: cells added on each side of a block (0: non-overlapping block attention).
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
        **contract: Any,
    ) -> None:
        super().__init__(dim, num_heads, **contract)
        check_positive_int(block_size, "block_size", self.name)
        check_nonnegative_int(halo, "halo", self.name)
        self.block_size = block_size
        self.halo = halo

    def mix(self, q, k, v, grid, attn_mask, is_causal) -> torch.Tensor:
        return sparse_attn(
            q, k, v, grid, self.block_size, self.halo, num_prefix_tokens=self.num_prefix_tokens,
            dropout_p=self.dropout_p,
        )

    def extra_repr(self) -> str:
        return super().extra_repr() + f", block_size={self.block_size}, halo={self.halo}"

    @staticmethod
    def window_tilings(grid, options) -> tuple[AxisTiling, AxisTiling]:
        """Each query's block plus halo, cut at the border: ``S_L = sum_i |block(i) + halo|`` keys seen
        along an axis, so the patches cost ``4 C S_H S_W`` FLOPs."""
        rows, cols = (blocked_tiling(length, options["block_size"], options["halo"]) for length in grid)
        return rows, cols
