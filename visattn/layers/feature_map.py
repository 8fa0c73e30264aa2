"""The learnable feature map of linear attention (``feature_map="learned"`` of the linear layer).

Hedgehog (Zhang et al. ICLR 2024) and LoLCATs (Zhang et al. ICLR 2025) make linear attention mimic softmax's
spiky weights by learning the feature map: a per-head linear map of q and k before a fixed positive
function. Here that function is the op's elu + 1, so ``phi(x) = elu(x W_h) + 1`` with one d x d matrix
per head for the queries and one for the keys. The matrices start as the identity, so an untrained map
computes exactly elu + 1 and a converted model starts where ``feature_map="elu"`` does; attention transfer
(:mod:`visattn.models.transfer`) then trains them to reproduce the parent's softmax attention.

The module holds the parameters and applies the map; the ops stay parameter-free and receive the mapped q
and k with ``feature_map="elu"``.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from visattn.ops.linear import FEATURE_MAPS

LEARNED_FEATURE_MAP = "learned"
# What the op applies after the learned projection.
LEARNED_BASE_MAP = "elu"


def check_feature_map_option(feature_map: object, op: str) -> str:
    """``feature_map`` as the linear layer takes it: a name of :data:`visattn.ops.linear.FEATURE_MAPS` or
    ``"learned"``."""
    valid = [*sorted(FEATURE_MAPS), LEARNED_FEATURE_MAP]
    if feature_map not in valid:
        raise ValueError(f"{op}: unknown feature_map {feature_map!r}; valid: {', '.join(valid)}")
    return feature_map


class LearnedFeatureMap(nn.Module):
    """Per-head linear maps of q and k, ``x W_h`` with ``W_h`` (d, d), initialised to the identity.

    Args:
        num_heads, head_dim: h heads of width d.
    """

    def __init__(
        self, num_heads: int, head_dim: int, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        identity = torch.eye(head_dim, device=device, dtype=dtype).expand(num_heads, head_dim, head_dim)
        self.query = nn.Parameter(identity.clone())  # (heads, d, d)
        self.key = nn.Parameter(identity.clone())  # (heads, d, d)

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k: (B, heads, N, d) -> the mapped q, k, (B, heads, N, d)."""
        return torch.matmul(q, self.query), torch.matmul(k, self.key)

    def no_weight_decay(self) -> set[str]:
        """Weight decay would pull the matrices towards zero, where phi is constant; they start at the identity."""
        return {"query", "key"}

    @staticmethod
    def flops(num_tokens: int, num_heads: int, head_dim: int) -> int:
        """``4 N C d``: q and k of every token through a d x d matrix per head (``2 d^2`` each)."""
        return 4 * num_tokens * num_heads * head_dim * head_dim

    def extra_repr(self) -> str:
        heads, d, _ = self.query.shape
        return f"num_heads={heads}, head_dim={d}"
