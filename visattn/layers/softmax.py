"""Softmax attention layer: timm's ``Attention`` with the fused SDPA path, the baseline."""
from __future__ import annotations

import torch

from visattn.layers.base import GridAttention
from visattn.layers.cost import CostCase, MixingMemory
from visattn.ops.softmax import softmax_attn


class SoftmaxAttention(GridAttention):
    """Full softmax attention over all tokens; O(N^2 d). Numerically identical to timm's Attention."""

    name = "softmax"
    needs_grid = False
    supports_causal = True
    supports_attn_mask = True
    supports_attn_drop = True

    def mix(self, q, k, v, grid, attn_mask, is_causal) -> torch.Tensor:
        return softmax_attn(q, k, v, attn_mask=attn_mask, is_causal=is_causal, dropout_p=self.dropout_p)

    @classmethod
    def mixing_flops(cls, case: CostCase) -> int:
        """``4 N^2 C``: QK^T and AV, each ``2 N^2 d`` per head."""
        return 4 * case.layout.num_tokens**2 * case.dim

    @classmethod
    def mixing_memory(cls, case: CostCase) -> MixingMemory:
        """Fused SDPA: the output and an fp32 log-sum-exp per row; the backward keeps q, k, v (the qkv output)."""
        n, c, act_bytes = case.layout.num_tokens, case.dim, case.act_bytes
        return MixingMemory(infer=n * c * act_bytes, train=4 * n * c * act_bytes + 4 * case.num_heads * n)
