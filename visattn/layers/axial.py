"""Axial attention layer (Ho et al. 2019): row, then column softmax attention over the patch grid."""
from __future__ import annotations

import torch
import torch.nn as nn

from visattn import ops
from visattn.layers.base import GridAttention
from visattn.ops.axial import axial_packed


class AxialAttention(GridAttention):
    """Row attention then column attention with one set of q, k, v (timm's single ``qkv``), so every
    output sees the whole grid in two hops; prefix tokens are keys of every row and column and attend
    to all tokens. O(N (H + W) d) per head. See :func:`visattn.ops.axial`."""

    name = "axial"
    supports_attn_drop = True

    def project_and_mix(self, x, grid, attn_mask, is_causal) -> torch.Tensor:
        """Without q/k norms the op runs on the qkv projection itself (:func:`visattn.ops.axial.axial_packed`),
        whose gradient then comes back in one piece."""
        if torch.compiler.is_compiling() or not (isinstance(self.q_norm, nn.Identity) and isinstance(self.k_norm, nn.Identity)):
            return super().project_and_mix(x, grid, attn_mask, is_causal)
        return axial_packed(self.qkv(x), self.num_heads, grid, self.num_prefix_tokens, self.dropout_p)

    def mix(self, q, k, v, grid, attn_mask, is_causal) -> torch.Tensor:
        return ops.axial(q, k, v, grid, num_prefix_tokens=self.num_prefix_tokens, dropout_p=self.dropout_p)
