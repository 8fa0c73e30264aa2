"""Causal linear attention (raster order), chunk by chunk: a running d x d state carries the past, and
the backward pass recomputes it instead of storing a state per position, so memory stays O(N d)
instead of O(N d^2)."""
from __future__ import annotations

import torch

from visattn.ops.checks import check_positive_int, check_qkv
from visattn.ops.linear.feature_maps import get_feature_map
from visattn.ops.linear.plain import divide_by_last_column, with_ones_column
from visattn.ops.pieces import pieces
from visattn.ops.rope import apply_rope


def _causal_product(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """``tril(q k^T) v`` without the N x N matrix: (B, h, N, d) x2, (B, h, N, e) -> (B, h, N, e)."""
    out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
    state = q.new_zeros(*q.shape[:-2], q.shape[-1], v.shape[-1])  # (B, h, d, e): sum of k_j v_j^T so far
    for chunk in pieces(q.shape[-2], chunk_size):
        q_c, k_c, v_c = q[..., chunk, :], k[..., chunk, :], v[..., chunk, :]
        intra = (q_c @ k_c.transpose(-2, -1)).tril_()  # (B, h, C, C): causal inside the chunk
        out[..., chunk, :] = q_c @ state + intra @ v_c
        state = state + k_c.transpose(-2, -1) @ v_c
    return out


class _CausalProduct(torch.autograd.Function):
    """``tril(q k^T) v``; saves only q, k, v. Each gradient is itself a causal product:
    dq_i = sum_{j<=i} (do_i . v_j) k_j,  dk_j = sum_{i>=j} (v_j . do_i) q_i,  dv_j = sum_{i>=j} (k_j . q_i) do_i,
    the last two run on the reversed sequence."""

    @staticmethod
    def forward(ctx, q, k, v, chunk_size):
        ctx.save_for_backward(q, k, v)
        ctx.chunk_size = chunk_size
        return _causal_product(q, k, v, chunk_size)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        q, k, v = ctx.saved_tensors
        c = ctx.chunk_size
        grad_out = grad_out.contiguous()
        dq = _causal_product(grad_out, v, k, c)
        q_r, k_r, v_r, g_r = (t.flip(-2) for t in (q, k, v, grad_out))
        dk = _causal_product(v_r, g_r, q_r, c).flip(-2)
        dv = _causal_product(k_r, q_r, g_r, c).flip(-2)
        return dq, dk, dv, None


def chunk_linear_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    feature_map: str = "elu",
    chunk_size: int = 64,
    eps: float = 1e-6,
    rope: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal linear attention: token i attends to tokens 0..i.

    Args:
        q, k, v: (B, heads, N, d).
        chunk_size: tokens per chunk; the result does not depend on it.
        rope: a rotation table (:mod:`visattn.ops.rope`) for the features of the numerator; the
            normalizer keeps the unrotated ones, so it is a second causal product.
    Returns:
        (B, heads, N, d), in v's dtype; computed in fp32.
    """
    check_qkv(q, k, v, "chunk_linear_attn")
    check_positive_int(chunk_size, "chunk_size", "chunk_linear_attn")
    phi = get_feature_map(feature_map)
    with torch.autocast(device_type=q.device.type, enabled=False):
        qf, kf, vf = phi(q.float()), phi(k.float()), v.float()
        if rope is None:
            num_den = _CausalProduct.apply(qf, kf, with_ones_column(vf), chunk_size)  # (B, h, N, d + 1)
            return divide_by_last_column(num_den, eps).to(v.dtype)
        rope = rope.float()
        num = _CausalProduct.apply(apply_rope(qf, rope), apply_rope(kf, rope), vf, chunk_size)  # (B, h, N, e)
        den = _CausalProduct.apply(qf, kf, vf.new_ones(*vf.shape[:-1], 1), chunk_size)  # (B, h, N, 1)
        out = num / den.clamp_min(eps)
    return out.to(v.dtype)
