"""Non-causal linear attention as plain batched matmuls: the formulation a compiler fuses, and the one
that runs where the blocked autograd of :mod:`visattn.ops.linear.blocked` is not wanted."""
from __future__ import annotations

import torch
from einops import rearrange
from torch.utils.checkpoint import checkpoint

from visattn.ops.backends import needs_autograd
from visattn.ops.checks import check_qkv
from visattn.ops.linear.feature_maps import FeatureMap, get_feature_map
from visattn.ops.rope import apply_rope


def with_ones_column(v: torch.Tensor) -> torch.Tensor:
    """(..., N, e) -> (..., N, e + 1): the last column, all ones, sums the normalizer beside the values."""
    return torch.cat([v, v.new_ones(*v.shape[:-1], 1)], dim=-1)


def divide_by_last_column(num_den: torch.Tensor, eps: float) -> torch.Tensor:
    """(..., e + 1) numerators and normalizer -> (..., e), the normalizer clamped to at least ``eps``."""
    return num_den[..., :-1] / num_den[..., -1:].clamp_min(eps)


def plain_linear_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    feature_map: str = "elu",
    eps: float = 1e-6,
    rope: torch.Tensor | None = None,
) -> torch.Tensor:
    """``phi(q) (phi(k)^T [v, 1])``, normalised: q, k, v (B, heads, N, d) -> (B, heads, N, d) in v's dtype,
    computed in fp32; bf16 inputs without rope and without autograd in bf16 (:func:`bf16_linear_attn`).
    Autograd stores the feature maps (N d per tensor).

    With a ``rope`` table (:mod:`visattn.ops.rope`), ``R phi(q) ((R phi(k))^T v) / (phi(q) phi(k)^T 1)``:
    the rotated features in the numerator, the unrotated ones in the normalizer, still O(N d^2)."""
    check_qkv(q, k, v, "plain_linear_attn")
    phi = get_feature_map(feature_map)
    with torch.autocast(device_type=q.device.type, enabled=False):
        # with autograd the sums stay fp32: gradients that cancel (the normalization makes phi(q)'s scale
        # and a shift shared by all values irrelevant) would keep bf16's rounding of each term
        if rope is None and q.dtype == k.dtype == v.dtype == torch.bfloat16 and not needs_autograd(q, k, v):
            return bf16_linear_attn(q, k, v, phi, eps)
        qf, kf, vf = phi(q.float()), phi(k.float()), v.float()
        if rope is None:
            kv_sum = kf.transpose(-2, -1) @ with_ones_column(vf)  # (B, h, d, e + 1)
            return divide_by_last_column(qf @ kv_sum, eps).to(v.dtype)
        rope = rope.float()
        kv = apply_rope(kf, rope).transpose(-2, -1) @ vf  # (B, h, d, e)
        den = qf @ kf.sum(dim=-2).unsqueeze(-1)  # (B, h, N, 1)
        out = (apply_rope(qf, rope) @ kv) / den.clamp_min(eps)
    return out.to(v.dtype)


# Tokens per partial sum of phi(k)^T v in bf16_linear_attn. One (d x N) @ (N x d) product per head runs
# its long reduction in a few thread blocks; cut into chunks, the products fill the GPU, and the partial
# sums are added in fp32.
KV_CHUNK = 1024


def bf16_linear_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, phi: FeatureMap, eps: float) -> torch.Tensor:
    """:func:`plain_linear_attn` on bf16 q, k, v (B, heads, N, d), without autograd: the feature maps in bf16
    (elu + 1 of a very negative input to within bf16's absolute rounding, 2^-9, not its relative one), the
    matmuls in bf16 (each accumulating in fp32), phi(k)^T v summed over chunks of :data:`KV_CHUNK` tokens and
    those partial sums, the fp32 product of the last fewer than :data:`KV_CHUNK` tokens (all of them, fp32 copies
    of k and v, when N is smaller) and the normalizer's sums added in fp32. bf16 has fp32's range, so no sum overflows; the results are rounded to bf16 where the
    fp32 path keeps fp32."""
    qf, kf = phi(q), phi(k)  # (B, h, N, d) bf16
    n = k.shape[-2]
    whole = n - n % KV_CHUNK
    kv = kf[..., whole:, :].transpose(-2, -1).float() @ v[..., whole:, :].float()  # (B, h, d, e) fp32: the tail
    if whole:
        chunks_k = rearrange(kf[..., :whole, :], "b h (c t) d -> b h c d t", t=KV_CHUNK)
        chunks_v = rearrange(v[..., :whole, :], "b h (c t) e -> b h c t e", t=KV_CHUNK)
        kv = kv + (chunks_k @ chunks_v).sum(2, dtype=torch.float32)  # (B, h, c, d, e) partial sums
    k_sum = kf.sum(-2, dtype=torch.float32)  # (B, h, d)
    numerator = qf @ kv.to(q.dtype)  # (B, h, N, e)
    normalizer = qf @ k_sum.to(q.dtype).unsqueeze(-1)  # (B, h, N, 1)
    return (numerator / normalizer.clamp_min(eps)).to(v.dtype)


def checkpointed_plain_linear_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    feature_map: str = "elu",
    eps: float = 1e-6,
    rope: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`plain_linear_attn` with its fp32 feature maps recomputed in the backward instead of kept:
    autograd keeps q, k, v (views of the qkv projection, kept anyway) and the rope table."""
    return checkpoint(plain_linear_attn, q, k, v, feature_map, eps, rope, use_reentrant=False)
