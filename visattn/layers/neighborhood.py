"""2D neighbourhood attention layer (NATTEN semantics): each patch sees its k x k grid neighbours."""
from __future__ import annotations

import torch
import torch.nn as nn

from visattn.layers.base import GridAttention
from visattn.ops._checks import check_positive_int
from visattn.ops.local import neighborhood_axis, tiled_local_attention


class NeighborhoodAttention(GridAttention):
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
        qkv_bias: bool = False,
        qk_norm: bool = False,
        scale_norm: bool = False,
        proj_bias: bool = True,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        norm_layer: type[nn.Module] | None = None,
        device=None,
        dtype=None,
        *,
        kernel_size: int = 7,
        tile_size: int = 8,
    ) -> None:
        super().__init__(
            dim, num_heads, qkv_bias, qk_norm, scale_norm, proj_bias, attn_drop, proj_drop, norm_layer, device, dtype
        )
        check_positive_int(kernel_size, "kernel_size", self.name, odd=True)
        check_positive_int(tile_size, "tile_size", self.name)
        self.kernel_size = kernel_size
        self.tile_size = tile_size

    def mix(self, q, k, v, grid, attn_mask, is_causal) -> torch.Tensor:
        rows = neighborhood_axis(grid[0], self.kernel_size, self.tile_size, q.device)
        cols = neighborhood_axis(grid[1], self.kernel_size, self.tile_size, q.device)
        return tiled_local_attention(
            q, k, v, rows, cols, num_prefix_tokens=self.num_prefix_tokens, dropout_p=self.dropout_p
        )

    def extra_repr(self) -> str:
        return super().extra_repr() + f", kernel_size={self.kernel_size}, tile_size={self.tile_size}"
