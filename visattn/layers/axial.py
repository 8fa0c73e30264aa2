"""Axial attention layer (Ho et al. 2019): row, then column softmax attention over the patch grid."""
from __future__ import annotations

import torch

from visattn import ops
from visattn.layers.base import GridAttention


class AxialAttention(GridAttention):
    """Row attention then column attention with one set of q, k, v (timm's single ``qkv``), so every
    output sees the whole grid in two hops; prefix tokens are keys of every row and column and attend
    to all tokens. O(N (H + W) d) per head. See :func:`visattn.ops.axial`."""

    name = "axial"
    supports_attn_drop = True

    def mix(self, q, k, v, grid, attn_mask, is_causal) -> torch.Tensor:
        return ops.axial(q, k, v, grid, num_prefix_tokens=self.num_prefix_tokens, dropout_p=self.dropout_p)
