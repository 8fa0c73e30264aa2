"""Softmax attention layer: timm's ``Attention`` with the fused SDPA path, the baseline."""
from __future__ import annotations

import torch

from visattn import ops
from visattn.layers.base import GridAttention


class SoftmaxAttention(GridAttention):
    """Full softmax attention over all tokens; O(N^2 d). Numerically identical to timm's Attention."""

    name = "softmax"
    needs_grid = False
    supports_causal = True
    supports_attn_mask = True
    supports_attn_drop = True

    def mix(self, q, k, v, grid, attn_mask, is_causal) -> torch.Tensor:
        return ops.softmax(q, k, v, attn_mask=attn_mask, is_causal=is_causal, dropout_p=self.dropout_p)
