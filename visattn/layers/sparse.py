"""2D blocked local attention layer with a halo (HaloNet): b x b query blocks see the block plus a halo."""
from __future__ import annotations

import torch
import torch.nn as nn

from visattn.layers.base import GridAttention
from visattn.ops._checks import check_nonnegative_int, check_positive_int
from visattn.ops.local import blocked_axis, tiled_local_attention


class SparseAttention(GridAttention):
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
        block_size: int = 8,
        halo: int = 3,
    ) -> None:
        super().__init__(
            dim, num_heads, qkv_bias, qk_norm, scale_norm, proj_bias, attn_drop, proj_drop, norm_layer, device, dtype
        )
        check_positive_int(block_size, "block_size", self.name)
        check_nonnegative_int(halo, "halo", self.name)
        self.block_size = block_size
        self.halo = halo

    def mix(self, q, k, v, grid, attn_mask, is_causal) -> torch.Tensor:
        rows = blocked_axis(grid[0], self.block_size, self.halo, q.device)
        cols = blocked_axis(grid[1], self.block_size, self.halo, q.device)
        return tiled_local_attention(
            q, k, v, rows, cols, num_prefix_tokens=self.num_prefix_tokens, dropout_p=self.dropout_p
        )

    def extra_repr(self) -> str:
        return super().extra_repr() + f", block_size={self.block_size}, halo={self.halo}"
