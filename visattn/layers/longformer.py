"""2D Longformer layer (ViL-style): local windows on the patch grid plus global tokens."""
from __future__ import annotations

import torch
import torch.nn as nn

from visattn import ops
from visattn.layers.base import GridAttention
from visattn.ops._checks import check_nonnegative_int
from visattn.ops.longformer import check_local_options


class LongformerAttention(GridAttention):
    """The model's prefix tokens (class/register) are global: they attend to all tokens and every patch
    attends to them, in the same softmax as its local window (``local="neighborhood"`` or ``"sparse"``).
    O(N (R^2 + G) d) per head for the patches, R^2 keys in a tile's local region (see the local layers),
    plus O(G N d) for the G global tokens.

    Type options:
        local: ``"neighborhood"`` (kernel_size, tile_size) or ``"sparse"`` (block_size, halo).
        kernel_size, tile_size: see :class:`visattn.layers.neighborhood.NeighborhoodAttention`.
        block_size, halo: see :class:`visattn.layers.sparse.SparseAttention`.
        num_extra_global_tokens: learned global tokens (projected by the same qkv) added after the prefix
            tokens for the mixing only; they leave the token count unchanged. Useful when the model has
            no prefix token, or to give patches more global memory.
    """

    name = "longformer"
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
        local: str = "neighborhood",
        kernel_size: int = 7,
        block_size: int = 8,
        halo: int = 3,
        tile_size: int = 8,
        num_extra_global_tokens: int = 0,
    ) -> None:
        super().__init__(
            dim, num_heads, qkv_bias, qk_norm, scale_norm, proj_bias, attn_drop, proj_drop, norm_layer, device, dtype
        )
        check_local_options(local, kernel_size, block_size, halo, tile_size)
        check_nonnegative_int(num_extra_global_tokens, "num_extra_global_tokens", self.name)
        self.local = local
        self.kernel_size = kernel_size
        self.block_size = block_size
        self.halo = halo
        self.tile_size = tile_size
        self.num_extra_global_tokens = num_extra_global_tokens
        if num_extra_global_tokens:
            self.global_tokens = nn.Parameter(torch.empty(num_extra_global_tokens, dim, device=device, dtype=dtype))
            nn.init.trunc_normal_(self.global_tokens, std=0.02)
        else:
            self.register_parameter("global_tokens", None)

    def extra_qkv(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v of the learned global tokens, each (B, heads, E, d)."""
        qkv = self.qkv(self.global_tokens).reshape(self.num_extra_global_tokens, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.permute(1, 2, 0, 3).unbind(0)  # (heads, E, d)
        q, k = self.q_norm(q), self.k_norm(k)
        return tuple(t.expand(batch_size, -1, -1, -1) for t in (q, k, v))

    def mix(self, q, k, v, grid, attn_mask, is_causal) -> torch.Tensor:
        p = self.num_prefix_tokens
        if self.global_tokens is not None:
            extra = self.extra_qkv(q.shape[0])
            q, k, v = (torch.cat([t[:, :, :p], e.to(t.dtype), t[:, :, p:]], dim=2) for t, e in zip((q, k, v), extra))
        g = p + self.num_extra_global_tokens
        out = ops.longformer(
            q, k, v, grid, g, local=self.local, kernel_size=self.kernel_size, block_size=self.block_size,
            halo=self.halo, tile_size=self.tile_size, dropout_p=self.dropout_p,
        )  # (B, heads, G + H*W, d)
        if g == p:
            return out
        return torch.cat([out[:, :, :p], out[:, :, g:]], dim=2)

    def extra_repr(self) -> str:
        if self.local == "neighborhood":
            window = f"kernel_size={self.kernel_size}, tile_size={self.tile_size}"
        else:
            window = f"block_size={self.block_size}, halo={self.halo}"
        return (
            super().extra_repr()
            + f", local={self.local!r}, {window}, num_extra_global_tokens={self.num_extra_global_tokens}"
        )
