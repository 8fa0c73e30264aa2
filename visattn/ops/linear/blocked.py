"""Non-causal linear attention in O(N d^2), walked block by block of tokens so that each block's feature
map and products stay in cache; the backward pass recomputes the feature maps, so a training step
stores only q, k, v and the (d, d + 1) state.

:func:`packed_linear_attn` runs the same on the qkv projection itself, so its gradient comes back in
one piece. Every sum over tokens is taken in fp32, also under fp16/bf16 autocast, and the normalizer
is clamped away from zero.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from visattn.ops._checks import check_packed_qkv, check_qkv
from visattn.ops._layout import split_heads, split_qkv, token_major_empty
from visattn.ops._pieces import items_per_piece, pieces
from visattn.ops.linear.feature_maps import FeatureMap, get_feature_map

# Values per (B, heads, n, d) tensor of a token block: a block's feature map and products stay in
# cache, so every input is read from memory once per pass.
BLOCK_ELEMENTS = 1 << 19


class TokenBlocks:
    """Token blocks of (B, heads, N, d) tensors and two reusable fp32 work buffers of one block."""

    def __init__(self, batch: int, heads: int, n: int, d: int, device: torch.device) -> None:
        self.n = n
        self.step = min(n, items_per_piece(BLOCK_ELEMENTS, batch * heads * d, minimum=16))
        # token-major in memory, as q, k, v come (views of a projection): elementwise passes between them
        # then run over whole tokens of heads x d contiguous values, not rows of d
        self.buffers = [
            torch.empty(batch, self.step, heads, d, dtype=torch.float32, device=device).transpose(1, 2) for _ in range(2)
        ]

    @classmethod
    def like(cls, t: torch.Tensor) -> "TokenBlocks":
        return cls(*t.shape, t.device)

    def __iter__(self) -> Iterator[tuple[slice, list[torch.Tensor]]]:
        """Yields (token slice, the two work buffers cut to the block's length)."""
        for blk in pieces(self.n, self.step):
            yield blk, [buf[:, :, : blk.stop - blk.start] for buf in self.buffers]


def _matmul_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``a @ b`` written into ``out`` (any strides), converting when out is not fp32."""
    if out.dtype == a.dtype:
        return torch.matmul(a, b, out=out)
    return out.copy_(a @ b)


def kv_state(
    keys_values: Callable[[slice], tuple[torch.Tensor, torch.Tensor]], blocks: TokenBlocks, phi: FeatureMap
) -> tuple[torch.Tensor, torch.Tensor]:
    """``S = phi(k)^T v`` (B, h, d, e) and ``z = phi(k)^T 1`` (B, h, d, 1), fp32, from the key and value
    blocks (B, h, n, d) that ``keys_values(tokens)`` gives for the token slices of ``blocks``."""
    kv = k_sum = None
    for blk, (phi_k, scratch) in blocks:
        k_blk, v_blk = keys_values(blk)
        phi.fast_into(k_blk, phi_k, scratch)
        kv_blk = phi_k.transpose(-2, -1) @ v_blk.float()
        kv = kv_blk if kv is None else kv.add_(kv_blk)
        k_sum = phi_k.sum(dim=-2) if k_sum is None else k_sum.add_(phi_k.sum(dim=-2))
    return kv, k_sum.unsqueeze(-1)


def _normalized_phi_q(
    q_blk: torch.Tensor, k_sum: torch.Tensor, phi: FeatureMap, eps: float, phi_q: torch.Tensor, scaled: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Writes phi(q) into ``phi_q`` and ``phi(q) / den`` into ``scaled`` (so that the output is
    ``scaled @ S``); returns the normalizer ``den = max(phi(q) . z, eps)`` (B, h, n, 1) and whether the
    clamp let it through (its gradient is zero where it did not)."""
    phi.fast_into(q_blk, phi_q, scaled)
    den = phi_q @ k_sum
    live = den >= eps
    den.clamp_min_(eps)
    torch.mul(phi_q, den.reciprocal(), out=scaled)
    return den, live


def attend(
    queries: Callable[[slice], torch.Tensor],
    kv: torch.Tensor,
    k_sum: torch.Tensor,
    blocks: TokenBlocks,
    phi: FeatureMap,
    eps: float,
    out: torch.Tensor,
) -> torch.Tensor:
    """Writes ``phi(q) S / max(phi(q) z, eps)`` into ``out`` (B, h, N, e), block by block of ``queries``."""
    for blk, (phi_q, scaled) in blocks:
        _normalized_phi_q(queries(blk), k_sum, phi, eps, phi_q, scaled)
        _matmul_into(scaled, kv, out[:, :, blk])
    return out


def _forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, phi: FeatureMap, eps: float, out: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The output (B, h, N, e), written into ``out`` if given, else token-major in memory, and S, z."""
    batch, heads, n, _ = q.shape
    with torch.autocast(device_type=q.device.type, enabled=False):
        blocks = TokenBlocks.like(k)
        kv, k_sum = kv_state(lambda blk: (k[:, :, blk], v[:, :, blk]), blocks, phi)
        out = token_major_empty(batch, heads, n, v.shape[-1], v) if out is None else out
        attend(lambda blk: q[:, :, blk], kv, k_sum, blocks, phi, eps, out)
    return out, kv, k_sum


def _backward(
    saved: tuple[torch.Tensor, ...], grad_out: torch.Tensor, phi: FeatureMap, eps: float, grads: tuple[torch.Tensor, ...]
) -> None:
    """Writes dq, dk, dv into ``grads`` (three tensors shaped like q, k, v, any strides).

    With S = phi(k)^T v, z = phi(k)^T 1, den = max(phi(q) z, eps), a = phi(q) / den, out = a S, and the
    output gradient g: t = g S^T, c = -(t . a) where the clamp passes (0 elsewhere),
    dphi(q) = (t + c z^T) / den, dS = a^T g, dz = a^T c, dphi(k) = v dS^T + 1 dz^T, dv = phi(k) dS.
    """
    q, k, v, kv, k_sum = saved
    dq, dk, dv = grads
    grad_kv, grad_k_sum = torch.zeros_like(kv), torch.zeros_like(k_sum)
    with torch.autocast(device_type=q.device.type, enabled=False):
        kv_t, k_sum_t = kv.transpose(-2, -1), k_sum.transpose(-2, -1)
        blocks = TokenBlocks.like(q)
        for blk, (phi_q, scaled) in blocks:
            den, live = _normalized_phi_q(q[:, :, blk], k_sum, phi, eps, phi_q, scaled)
            g = grad_out[:, :, blk].float()
            t = g @ kv_t  # (B, h, n, d)
            c = torch.linalg.vecdot(t, scaled).unsqueeze(-1).neg_().mul_(live)
            grad_kv += scaled.transpose(-2, -1) @ g
            grad_k_sum += scaled.transpose(-2, -1) @ c
            t.addcmul_(c, k_sum_t)
            torch.mul(t, phi.derivative_(phi_q).div_(den), out=dq[:, :, blk])
        grad_kv_t, grad_k_sum_t = grad_kv.transpose(-2, -1), grad_k_sum.transpose(-2, -1)
        for blk, (phi_k, scratch) in blocks:
            phi.fast_into(k[:, :, blk], phi_k, scratch)
            _matmul_into(phi_k, grad_kv, dv[:, :, blk])
            grad_phi_k = torch.matmul(v[:, :, blk].float(), grad_kv_t, out=scratch).add_(grad_k_sum_t)
            torch.mul(grad_phi_k, phi.derivative_(phi_k), out=dk[:, :, blk])


class _BlockedLinearAttention(torch.autograd.Function):
    """Saves q, k, v and the small S, z; the backward pass recomputes the feature maps block by block,
    so a training step stores no (N, d) tensor of its own. The output is laid out token-major,
    (B, N, h, e) in memory, so merging the heads afterwards is a view."""

    @staticmethod
    def forward(ctx, q, k, v, phi: FeatureMap, eps: float):
        out, kv, k_sum = _forward(q, k, v, phi, eps)
        ctx.save_for_backward(q, k, v, kv, k_sum)
        ctx.phi, ctx.eps = phi, eps
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        saved = ctx.saved_tensors
        grads = tuple(torch.empty_like(t) for t in saved[:3])
        _backward(saved, grad_out, ctx.phi, ctx.eps, grads)
        return *grads, None, None


class _PackedLinearAttention(torch.autograd.Function):
    """:class:`_BlockedLinearAttention` on the qkv projection (B, N, 3 C) itself, returning (B, N, C)
    with the heads merged, and the values (B, N, C) as a view of the projection. Its gradient comes back
    as one (B, N, 3 C) tensor written block by block (the values' own gradient, if any, added into it),
    so autograd neither stacks dq, dk, dv, copies them into the projection's layout, nor zero-fills a
    projection-sized gradient for a slice of it."""

    @staticmethod
    def forward(ctx, qkv, num_heads: int, phi: FeatureMap, eps: float):
        dim = qkv.shape[2] // 3
        merged = qkv.new_empty(*qkv.shape[:2], dim)  # not a view: callers may add to it in place
        _, kv, k_sum = _forward(*split_qkv(qkv, num_heads), phi, eps, out=split_heads(merged, num_heads))
        ctx.save_for_backward(qkv, kv, k_sum)
        ctx.num_heads, ctx.phi, ctx.eps = num_heads, phi, eps
        return merged, qkv[..., 2 * dim :]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, grad_values):
        qkv, kv, k_sum = ctx.saved_tensors
        grad_qkv = torch.empty_like(qkv, memory_format=torch.contiguous_format)
        saved = (*split_qkv(qkv, ctx.num_heads), kv, k_sum)
        _backward(saved, split_heads(grad_out, ctx.num_heads), ctx.phi, ctx.eps, split_qkv(grad_qkv, ctx.num_heads))
        if grad_values is not None:
            grad_qkv[..., 2 * (qkv.shape[2] // 3) :] += grad_values
        return grad_qkv, None, None, None


def blocked_linear_attn(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, feature_map: str = "elu", eps: float = 1e-6
) -> torch.Tensor:
    """Non-causal linear attention, block by block of tokens.

    Args:
        q, k, v: (B, heads, N, d).
        feature_map: ``"elu"`` (elu + 1) or ``"relu"``.
        eps: lower bound of the normalizer ``phi(q_i) . sum_j phi(k_j)``.
    Returns:
        (B, heads, N, d) in v's dtype, computed in fp32; a view of a token-major (B, N, heads, d) tensor.
    """
    check_qkv(q, k, v, "blocked_linear_attn")
    return _BlockedLinearAttention.apply(q, k, v, get_feature_map(feature_map), eps)


def packed_linear_attn(
    qkv: torch.Tensor, num_heads: int, feature_map: str = "elu", eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`blocked_linear_attn` on a qkv projection: (B, N, 3 C) laid out as timm's (q, k, v, then
    heads of d = C / num_heads) -> the output (B, N, C), heads merged, and the values (B, N, C), a view
    of the projection (for a locality term on them). The same values as splitting the heads and calling
    :func:`blocked_linear_attn`; with autograd the gradient is one (B, N, 3 C) tensor."""
    check_packed_qkv(qkv, num_heads, "packed_linear_attn")
    return _PackedLinearAttention.apply(qkv, num_heads, get_feature_map(feature_map), eps)
