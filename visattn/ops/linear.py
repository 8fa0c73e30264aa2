"""Linear attention (Katharopoulos et al. 2020): ``phi(Q) (phi(K)^T V) / (phi(Q) phi(K)^T 1)``.

Non-causal in O(N d^2). Causal (raster order) chunk by chunk: a running d x d state carries the past,
and the backward pass recomputes it instead of storing a state per position, so memory stays O(N d)
instead of O(N d^2). :func:`linear_step` is the recurrent (RNN) form of the causal op.

Every sum over tokens is taken in fp32, also under fp16/bf16 autocast (at 65,536 tokens an fp16 sum
overflows), and the normalizer is clamped away from zero.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from visattn.ops._checks import check_positive_int, check_qkv


def _elu_plus_one(x: torch.Tensor) -> torch.Tensor:
    return F.elu(x) + 1.0


FEATURE_MAPS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "elu": _elu_plus_one,  # elu(x) + 1 > 0: the paper's choice
    "relu": F.relu,
}


def get_feature_map(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    try:
        return FEATURE_MAPS[name]
    except KeyError:
        raise ValueError(f"unknown feature_map {name!r}; valid: {sorted(FEATURE_MAPS)}") from None


def _causal_product(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """``tril(q k^T) v`` without the N x N matrix: (B, h, N, d) x2, (B, h, N, e) -> (B, h, N, e)."""
    n = q.shape[-2]
    out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
    state = q.new_zeros(*q.shape[:-2], q.shape[-1], v.shape[-1])  # (B, h, d, e): sum of k_j v_j^T so far
    for start in range(0, n, chunk_size):
        end = min(start + chunk_size, n)
        q_c, k_c, v_c = q[..., start:end, :], k[..., start:end, :], v[..., start:end, :]
        intra = (q_c @ k_c.transpose(-2, -1)).tril_()  # (B, h, C, C): causal inside the chunk
        out[..., start:end, :] = q_c @ state + intra @ v_c
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


def linear(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    feature_map: str = "elu",
    causal: bool = False,
    chunk_size: int = 64,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Linear attention.

    Args:
        q, k, v: (B, heads, N, d).
        feature_map: ``"elu"`` (elu + 1) or ``"relu"``.
        causal: each token attends to itself and earlier tokens (raster order).
        chunk_size: tokens per chunk of the causal form.
        eps: lower bound of the normalizer ``phi(q_i) . sum_j phi(k_j)``.
    Returns:
        (B, heads, N, d), in v's dtype; computed in fp32.
    """
    check_qkv(q, k, v, "linear")
    check_positive_int(chunk_size, "chunk_size", "linear")
    phi = get_feature_map(feature_map)
    with torch.autocast(device_type=q.device.type, enabled=False):
        qf, kf, vf = phi(q.float()), phi(k.float()), v.float()
        if causal:
            v_ones = torch.cat([vf, vf.new_ones(*vf.shape[:-1], 1)], dim=-1)  # last column sums the normalizer
            num_den = _CausalProduct.apply(qf, kf, v_ones, chunk_size)  # (B, h, N, d + 1)
        else:
            kv = kf.transpose(-2, -1) @ vf  # (B, h, d, d)
            k_sum = kf.sum(dim=-2).unsqueeze(-1)  # (B, h, d, 1)
            num_den = qf @ torch.cat([kv, k_sum], dim=-1)  # (B, h, N, d + 1): one pass over q
        out = num_den[..., :-1] / num_den[..., -1:].clamp_min(eps)
    return out.to(v.dtype)


def linear_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: tuple[torch.Tensor, torch.Tensor] | None = None,
    feature_map: str = "elu",
    eps: float = 1e-6,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """One step of causal linear attention as an RNN.

    Args:
        q, k, v: (B, heads, d), the current token.
        state: ``(S, z)`` with S (B, heads, d, d) = sum phi(k_j) v_j^T and z (B, heads, d) = sum phi(k_j),
            fp32, or None at the first token.
    Returns:
        the output (B, heads, d) and the new state.
    """
    phi = get_feature_map(feature_map)
    with torch.autocast(device_type=q.device.type, enabled=False):
        qf, kf, vf = phi(q.float()), phi(k.float()), v.float()
        if state is None:
            state = (qf.new_zeros(*kf.shape, vf.shape[-1]), qf.new_zeros(kf.shape))
        s, z = state
        s = s + kf.unsqueeze(-1) * vf.unsqueeze(-2)
        z = z + kf
        num = (qf.unsqueeze(-2) @ s).squeeze(-2)  # (B, h, d)
        den = (qf * z).sum(dim=-1, keepdim=True)
        out = num / den.clamp_min(eps)
    return out.to(v.dtype), (s, z)


def linear_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    feature_map: str = "elu",
    causal: bool = False,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Naive twin of :func:`linear`: the explicit N x N kernel matrix ``phi(q) phi(k)^T``."""
    phi = get_feature_map(feature_map)
    weights = phi(q) @ phi(k).transpose(-2, -1)  # (B, h, N, N)
    if causal:
        weights = weights.tril()
    return (weights @ v) / weights.sum(dim=-1, keepdim=True).clamp_min(eps)
