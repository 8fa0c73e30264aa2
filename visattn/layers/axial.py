"""Axial attention layer (Ho et al. 2019): row, then column softmax attention over the patch grid."""
from __future__ import annotations

import torch
import torch.nn as nn

from visattn.layers.base import GridAttention
from visattn.layers.cost import MixingMemory
from visattn.ops.axial import axial_attn, packed_axial_attn


class AxialAttention(GridAttention):
    """Row attention then column attention with one set of q, k, v (timm's single ``qkv``), so every
    output sees the whole grid in two hops; prefix tokens are keys of every row and column and attend
    to all tokens. O(N (H + W) d) per head. See :func:`visattn.ops.axial_attn`.

    With ``rope``, q and k are turned once, before both hops, and each axis gets its own rotation: in the
    row hop a query and its keys share the row, so the row angles cancel and a score depends on the column
    offset only; in the column hop, on the row offset only. With ``rope="axial"`` a hop's position lives in
    the half of the channels that turns with its axis (the other half is position-free there); with
    ``"mixed"`` every pair turns with the hop's axis at its learned frequency along that axis.
    """

    name = "axial"
    supports_attn_drop = True

    def project_and_mix(self, x, grid, attn_mask, is_causal) -> torch.Tensor:
        """Without q/k norms and rope the op runs on the qkv projection itself
        (:func:`visattn.ops.packed_axial_attn`), whose gradient then comes back in one piece on the
        ``"cpu_kernels"`` path."""
        plain_qk = isinstance(self.q_norm, nn.Identity) and isinstance(self.k_norm, nn.Identity)
        if not plain_qk or self.rope is not None:
            return super().project_and_mix(x, grid, attn_mask, is_causal)
        return packed_axial_attn(self.qkv(x), self.num_heads, grid, self.num_prefix_tokens, self.dropout_p)

    def mix(self, q, k, v, grid, attn_mask, is_causal) -> torch.Tensor:
        return axial_attn(q, k, v, grid, num_prefix_tokens=self.num_prefix_tokens, dropout_p=self.dropout_p)

    @classmethod
    def mixing_flops(cls, layout, num_heads, head_dim, options) -> int:
        """``4 C (M (2P + H + W) + P N)``: rows, M queries x (P + W) keys; columns, x (P + H); prefix
        queries, P x N."""
        (rows, cols), p, m = layout.grid, layout.num_prefix_tokens, layout.num_patches
        return 4 * num_heads * head_dim * (m * (2 * p + rows + cols) + p * layout.num_tokens)

    @classmethod
    def mixing_memory(cls, layout, num_heads, head_dim, options, act_bytes) -> MixingMemory:
        """Inference: the row hop's output and the op's output; training: q, k, v, which
        :func:`visattn.ops.axial_attn` keeps on every path. Left out: the column hop's contiguous copies
        (inference) and, on the CPU path, the row hop's output and log-sum-exps kept for the backward."""
        n, c = layout.num_tokens, num_heads * head_dim
        return MixingMemory(infer=2 * n * c * act_bytes, train=3 * n * c * act_bytes)
