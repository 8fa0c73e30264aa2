"""2D Longformer layer (ViL-style): local windows on the patch grid plus global tokens."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from visattn.layers.base import GridAttention
from visattn.layers.cost import CostCase, MixingMemory, local_memory
from visattn.layers.neighborhood import NeighborhoodAttention
from visattn.layers.sparse import SparseAttention
from visattn.ops.checks import check_nonnegative_int
from visattn.ops.layout import split_prefix, split_qkv
from visattn.ops.local import AxisTiling
from visattn.ops.longformer import check_local_options, longformer_attn


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
        *,
        local: str = "neighborhood",
        kernel_size: int = 7,
        block_size: int = 8,
        halo: int = 3,
        tile_size: int = 8,
        num_extra_global_tokens: int = 0,
        **contract: Any,
    ) -> None:
        super().__init__(dim, num_heads, **contract)
        check_local_options(local, kernel_size, block_size, halo, tile_size)
        check_nonnegative_int(num_extra_global_tokens, "num_extra_global_tokens", self.name)
        self.local = local
        self.kernel_size = kernel_size
        self.block_size = block_size
        self.halo = halo
        self.tile_size = tile_size
        self.num_extra_global_tokens = num_extra_global_tokens
        if num_extra_global_tokens:
            dd = self.factory_kwargs
            self.global_tokens = nn.Parameter(torch.empty(num_extra_global_tokens, dim, **dd))
            nn.init.trunc_normal_(self.global_tokens, std=0.02)
        else:
            self.register_parameter("global_tokens", None)

    def extra_qkv(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v of the learned global tokens, each (B, heads, E, d)."""
        q, k, v = split_qkv(self.qkv(self.global_tokens), self.num_heads)  # (heads, E, d) each
        q, k = self.q_norm(q), self.k_norm(k)
        return tuple(t.expand(batch_size, -1, -1, -1) for t in (q, k, v))

    def mix(self, q, k, v, grid, attn_mask, is_causal) -> torch.Tensor:
        p, extra = self.num_prefix_tokens, self.num_extra_global_tokens

        def with_extra(t: torch.Tensor, e: torch.Tensor) -> torch.Tensor:  # the extra tokens after the prefix
            prefix, patches = split_prefix(t, p)
            return torch.cat([prefix, e.to(t.dtype), patches], dim=2)

        if extra:
            q, k, v = (with_extra(t, e) for t, e in zip((q, k, v), self.extra_qkv(q.shape[0])))
        out = longformer_attn(
            q, k, v, grid, p + extra, local=self.local, kernel_size=self.kernel_size, block_size=self.block_size,
            halo=self.halo, tile_size=self.tile_size, dropout_p=self.dropout_p,
        )  # (B, heads, G + H*W, d)
        if not extra:
            return out
        prefix, _, patches = out.split([p, extra, grid[0] * grid[1]], dim=2)
        return torch.cat([prefix, patches], dim=2)

    def extra_repr(self) -> str:
        if self.local == "neighborhood":
            window = f"kernel_size={self.kernel_size}, tile_size={self.tile_size}"
        else:
            window = f"block_size={self.block_size}, halo={self.halo}"
        return (
            super().extra_repr()
            + f", local={self.local!r}, {window}, num_extra_global_tokens={self.num_extra_global_tokens}"
        )

    @classmethod
    def mixing_flops(cls, case: CostCase) -> int:
        """``4 C (S_H S_W + M G + G (G + M))`` with the keys S of the local window (see the neighborhood and
        sparse layers) and G = P + extra global tokens; ``+ 6 E C^2`` to project the E extra global
        tokens (once per forward, whatever the batch; counted per image as if the batch were 1)."""
        rows, cols = cls._tilings(case.layout.grid, case.options)
        extra = case.options["num_extra_global_tokens"]
        g, m, c = case.layout.num_prefix_tokens + extra, case.layout.num_patches, case.dim
        return 4 * c * (rows.keys_seen * cols.keys_seen + m * g + g * (g + m)) + 6 * extra * c * c

    @classmethod
    def mixing_memory(cls, case: CostCase) -> MixingMemory:
        """The Triton kernels' tensors (or FlexAttention's) where the engine takes them (CUDA), else the
        tiles' (:func:`visattn.layers.cost.local_memory`), with the global tokens seen by every patch: the
        prefix tokens and the extra global tokens."""
        num_global = case.layout.num_prefix_tokens + case.options["num_extra_global_tokens"]
        return local_memory(case, *cls._tilings(case.layout.grid, case.options), num_global, True)

    @staticmethod
    def _tilings(grid, options) -> tuple[AxisTiling, AxisTiling]:
        local = NeighborhoodAttention if options["local"] == "neighborhood" else SparseAttention
        return local.window_tilings(grid, options)
