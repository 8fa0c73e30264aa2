"""2D neighbourhood attention layer (NATTEN semantics): each patch sees its k x k grid neighbours."""
from __future__ import annotations

from typing import Any

import torch

from visattn.layers.local import LocalWindowAttention
from visattn.ops.checks import check_positive_int
from visattn.ops.local import AxisTiling, neighborhood_tiling
from visattn.ops.neighborhood import neighborhood_attn


class NeighborhoodAttention(LocalWindowAttention):
    """Patch tokens attend to their k x k neighbourhood (shifted inward at the borders, so always k^2
    keys); prefix tokens attend to all tokens. Per head the patches cost O(N (t + k - 1)^2 d) with tile
    side t (each query scores its tile's key region, N k^2 d of it useful), the prefix O(P N d).

    Type options:
        kernel_size: odd window side k, clamped to a grid side smaller than k.
        tile_size: side of the query tiles of the blocked computation; does not change the result.
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
        **contract: Any,
    ) -> None:
        super().__init__(dim, num_heads, **contract)
        check_positive_int(kernel_size, "kernel_size", self.name, odd=True)
        check_positive_int(tile_size, "tile_size", self.name)
        self.kernel_size = kernel_size
        self.tile_size = tile_size

    def mix(self, q, k, v, grid, attn_mask, is_causal) -> torch.Tensor:
        return neighborhood_attn(
            q, k, v, grid, self.kernel_size, num_prefix_tokens=self.num_prefix_tokens, tile_size=self.tile_size,
            dropout_p=self.dropout_p,
        )

    def extra_repr(self) -> str:
        return super().extra_repr() + f", kernel_size={self.kernel_size}, tile_size={self.tile_size}"

    @staticmethod
    def window_tilings(grid, options) -> tuple[AxisTiling, AxisTiling]:
        """The k x k window of every patch: ``S_L = L min(k, L)`` keys seen along an axis of length L, so
        the patches cost ``4 C S_H S_W`` FLOPs."""
        rows, cols = (neighborhood_tiling(length, options["kernel_size"], options["tile_size"]) for length in grid)
        return rows, cols
