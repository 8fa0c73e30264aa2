"""No token mixing: each token keeps its own value. The speed limit of any attention layer.

The qkv and proj projections stay, so the cost of everything but the mixing is that of a real layer;
the benchmark reports every attention type as a fraction of this one.
"""
from __future__ import annotations

import torch

from visattn.layers.base import GridAttention
from visattn.layers.cost import CostCase, MixingMemory


class FloorAttention(GridAttention):
    """Passes V through: out_i = v_i. Not an attention; a reference for speed and accuracy."""

    name = "floor"
    needs_grid = False
    takes_rope = False

    def mix(self, q, k, v, grid, attn_mask, is_causal) -> torch.Tensor:
        return v

    @classmethod
    def mixing_flops(cls, case: CostCase) -> int:
        return 0

    @classmethod
    def mixing_memory(cls, case: CostCase) -> MixingMemory:
        return MixingMemory(infer=0, train=0)
