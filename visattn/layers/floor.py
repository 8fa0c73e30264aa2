"""No token mixing: each token keeps its own value. The speed limit of any attention layer.

The qkv and proj projections stay, so the cost of everything but the mixing is that of a real layer;
the benchmark reports every attention type as a fraction of this one.
"""
from __future__ import annotations

import torch

from visattn.layers.base import GridAttention


class FloorAttention(GridAttention):
    """Passes V through: out_i = v_i. Not an attention; a reference for speed and accuracy."""

    name = "floor"
    needs_grid = False

    def mix(self, q, k, v, grid, attn_mask, is_causal) -> torch.Tensor:
        return v
