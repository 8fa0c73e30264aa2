"""Naive twins of linear attention: the explicit N x N kernel matrix, and of the linear layer's op from the
qkv projection's input, its locality term as explicit sums."""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from einops import rearrange

from visattn.ops.linear.feature_maps import get_feature_map
from visattn.ops.rope import naive_apply_rope


def naive_linear_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    feature_map: str = "elu",
    causal: bool = False,
    eps: float = 1e-6,
    rope: torch.Tensor | None = None,
) -> torch.Tensor:
    """Naive twin of :func:`visattn.ops.linear_attn`: ``phi(q) phi(k)^T`` (B, heads, N, N) spelled out,
    lower-triangular when causal, then normalised by its row sums. With a ``rope`` table the numerator's
    weights are those of the rotated features, ``R phi(q) (R phi(k))^T``, and the row sums stay those of the
    unrotated ones."""
    phi = get_feature_map(feature_map)
    phi_q, phi_k = phi(q), phi(k)
    weights = phi_q @ phi_k.transpose(-2, -1)  # (B, h, N, N)
    if rope is None:
        numerator = weights
    else:
        numerator = naive_apply_rope(phi_q, rope) @ naive_apply_rope(phi_k, rope).transpose(-2, -1)
    if causal:
        weights, numerator = weights.tril(), numerator.tril()
    return (numerator @ v) / weights.sum(dim=-1, keepdim=True).clamp_min(eps)


def naive_projected_linear_attn(
    x: torch.Tensor,
    qkv_weight: torch.Tensor,
    qkv_bias: torch.Tensor | None,
    num_heads: int,
    feature_map: str = "elu",
    *,
    causal: bool = False,
    eps: float = 1e-6,
    rope: torch.Tensor | None = None,
    grid: tuple[int, int] | None = None,
    num_prefix_tokens: int = 0,
    conv_weight: torch.Tensor | None = None,
    conv_bias: torch.Tensor | None = None,
    q_norm: Callable[[torch.Tensor], torch.Tensor] | None = None,
    k_norm: Callable[[torch.Tensor], torch.Tensor] | None = None,
    qk_map: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> torch.Tensor:
    """Naive twin of :func:`visattn.ops.linear.projected_linear_attn`: the projection, the heads split, the
    norms and the q/k map, :func:`naive_linear_attn`, the heads merged, then the locality term spelled out as
    a sum over the K x K taps of shifted, zero-padded values (:func:`naive_locality`). (B, N, C_in) -> (B, N, C)."""
    qkv = F.linear(x, qkv_weight, qkv_bias)
    q, k, v = rearrange(qkv, "b n (three heads d) -> three b heads n d", three=3, heads=num_heads).unbind(0)
    q, k = q if q_norm is None else q_norm(q), k if k_norm is None else k_norm(k)
    if qk_map is not None:
        q, k = qk_map(q, k)
    out = rearrange(naive_linear_attn(q, k, v, feature_map, causal, eps, rope), "b heads n d -> b n (heads d)")
    if conv_weight is None:
        return out
    values = rearrange(v, "b heads n d -> b n (heads d)")
    return out + naive_locality(values, grid, num_prefix_tokens, conv_weight, conv_bias)


def naive_locality(
    values: torch.Tensor,
    grid: tuple[int, int],
    num_prefix_tokens: int,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
) -> torch.Tensor:
    """The locality term as explicit sums: for each patch (y, x) and channel c, ``bias_c + sum_{i, j}
    weight[c, 0, i, j] v[y + i - K // 2, x + j - K // 2, c]``, zero outside the grid and for the prefix
    tokens. values: (B, N, C) -> (B, N, C)."""
    height, width = grid
    kernel = conv_weight.shape[-1]
    half = kernel // 2
    patches = rearrange(values[:, num_prefix_tokens:], "b (y x) c -> b y x c", y=height)
    padded = F.pad(patches, (0, 0, half, half, half, half))  # (B, H + K - 1, W + K - 1, C)
    term = sum(
        padded[:, i : i + height, j : j + width] * conv_weight[:, 0, i, j]
        for i in range(kernel)
        for j in range(kernel)
    )
    if conv_bias is not None:
        term = term + conv_bias
    return F.pad(rearrange(term, "b y x c -> b (y x) c"), (0, 0, num_prefix_tokens, 0))
