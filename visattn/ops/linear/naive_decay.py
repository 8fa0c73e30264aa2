"""Naive twin of decayed linear attention: the N x N kernel matrix times the N x N decay matrix."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from visattn.ops.linear.feature_maps import get_feature_map
from visattn.ops.rope import naive_apply_rope


def manhattan_decay(gamma: torch.Tensor, grid: tuple[int, int], num_prefix_tokens: int = 0) -> torch.Tensor:
    """The decay weights (heads, N, N): ``gamma_h ** (|row_i - row_j| + |col_i - col_j|)`` between patch
    tokens (raster order), 1 wherever a prefix token is the query or the key.

    Args:
        gamma: (heads,) decay rates.
        grid: (H, W) patch grid; N = num_prefix_tokens + H * W.
    """
    rows, cols = torch.meshgrid(
        torch.arange(grid[0], device=gamma.device), torch.arange(grid[1], device=gamma.device), indexing="ij"
    )
    rows, cols = rows.flatten(), cols.flatten()
    distance = (rows[:, None] - rows[None, :]).abs() + (cols[:, None] - cols[None, :]).abs()  # (H W, H W)
    weights = gamma[:, None, None] ** distance.to(gamma.dtype)
    p = num_prefix_tokens
    return F.pad(weights, (p, 0, p, 0), value=1.0)


def naive_decayed_linear_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gamma: torch.Tensor,
    grid: tuple[int, int],
    num_prefix_tokens: int = 0,
    feature_map: str = "elu",
    eps: float = 1e-6,
    rope: torch.Tensor | None = None,
) -> torch.Tensor:
    """Naive twin of :func:`visattn.ops.decayed_linear_attn`: ``phi(q) phi(k)^T`` (B, heads, N, N) times
    :func:`manhattan_decay`, spelled out, then normalised by its row sums. With a ``rope`` table the
    numerator's weights are those of the rotated features, ``R phi(q) (R phi(k))^T``, times the decay, and
    the row sums stay those of the unrotated ones. Computed in q's dtype."""
    phi = get_feature_map(feature_map)
    phi_q, phi_k = phi(q), phi(k)
    decay = manhattan_decay(gamma.to(q.dtype), grid, num_prefix_tokens)  # (heads, N, N)
    weights = (phi_q @ phi_k.transpose(-2, -1)) * decay
    if rope is None:
        numerator = weights
    else:
        numerator = (naive_apply_rope(phi_q, rope) @ naive_apply_rope(phi_k, rope).transpose(-2, -1)) * decay
    return (numerator @ v) / weights.sum(dim=-1, keepdim=True).clamp_min(eps)
