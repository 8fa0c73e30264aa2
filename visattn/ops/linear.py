"""Linear attention (Katharopoulos et al. 2020): ``phi(Q) (phi(K)^T V) / (phi(Q) phi(K)^T 1)``.

Non-causal in O(N d^2), walked block by block of tokens so that each block's feature map and products
stay in cache; the backward pass recomputes the feature maps, so a training step stores only q, k, v
and the (d, d + 1) state. :func:`linear_packed` runs on the qkv projection itself (its gradient comes
back in one piece) and :func:`linear_from_input` fuses the projection into the blocks for inference.
Causal (raster order) chunk by chunk: a running d x d state carries the past, and the backward pass
recomputes it instead of storing a state per position, so memory stays O(N d) instead of O(N d^2).
:func:`linear_step` is the recurrent (RNN) form of the causal op.

Every sum over tokens is taken in fp32, also under fp16/bf16 autocast (at 65,536 tokens an fp16 sum
overflows), and the normalizer is clamped away from zero.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from visattn.ops._checks import check_positive_int, check_qkv
from visattn.ops._packed import check_packed_qkv, split_heads


@dataclass(frozen=True)
class FeatureMap:
    """A positive feature map phi. ``definition`` is the plain formula (the naive twin uses it);
    ``fast_into(x, out, scratch)`` writes the same values into the fp32 buffer ``out`` in cheap in-place
    passes (``scratch`` is a second buffer of the same shape); ``derivative_`` turns phi(x) into phi'(x)
    in place, so a backward pass that recomputes phi(x) needs nothing else."""

    definition: Callable[[torch.Tensor], torch.Tensor]
    fast_into: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    derivative_: Callable[[torch.Tensor], torch.Tensor]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.definition(x)


def _elu_plus_one(x: torch.Tensor) -> torch.Tensor:
    return F.elu(x) + 1.0


def _in_fp32(x: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
    """x itself if fp32, else x converted into ``buffer``."""
    return x if x.dtype == buffer.dtype else buffer.copy_(x)


def _matmul_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``a @ b`` written into ``out`` (any strides), converting when out is not fp32."""
    if out.dtype == a.dtype:
        return torch.matmul(a, b, out=out)
    return out.copy_(a @ b)


def _elu_plus_one_into(x: torch.Tensor, out: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    # elu(x) + 1 = exp(min(x, 0)) + max(x, 0): exp and clamps vectorise, elu's expm1 is ~10x slower
    x = _in_fp32(x, scratch)
    torch.clamp_max(x, 0.0, out=out).exp_()
    return out.add_(torch.clamp_min(x, 0.0, out=scratch))


def _relu_into(x: torch.Tensor, out: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    return torch.clamp_min(_in_fp32(x, scratch), 0.0, out=out)


def _relu_derivative_(phi_x: torch.Tensor) -> torch.Tensor:
    return phi_x.sign_()  # relu(x) >= 0: 1 where positive, 0 where not (relu's own gradient at 0 is 0)


FEATURE_MAPS: dict[str, FeatureMap] = {
    # elu(x) + 1 > 0, the paper's choice; its derivative is exp(x) = phi(x) for x <= 0 and 1 above: min(phi, 1)
    "elu": FeatureMap(_elu_plus_one, _elu_plus_one_into, lambda phi_x: phi_x.clamp_max_(1.0)),
    "relu": FeatureMap(F.relu, _relu_into, _relu_derivative_),
}


def get_feature_map(name: str) -> FeatureMap:
    try:
        return FEATURE_MAPS[name]
    except KeyError:
        raise ValueError(f"unknown feature_map {name!r}; valid: {sorted(FEATURE_MAPS)}") from None


# The non-causal op walks the tokens in blocks of about this many values per (B, heads, n, d) tensor, so
# that a block's feature map and products stay in cache: every input is read from memory once per pass,
# and the work buffers are reused from block to block.
_BLOCK_ELEMENTS = 1 << 19


class _TokenBlocks:
    """Token blocks of (B, heads, N, d) tensors and two reusable fp32 work buffers of one block."""

    def __init__(self, batch: int, heads: int, n: int, d: int, device: torch.device) -> None:
        self.n = n
        self.step = min(n, max(16, _BLOCK_ELEMENTS // (batch * heads * d)))
        # token-major in memory, as q, k, v come (views of a projection): elementwise passes between them
        # then run over whole tokens of heads x d contiguous values, not rows of d
        self.buffers = [
            torch.empty(batch, self.step, heads, d, dtype=torch.float32, device=device).transpose(1, 2) for _ in range(2)
        ]

    @classmethod
    def like(cls, t: torch.Tensor) -> "_TokenBlocks":
        return cls(*t.shape, t.device)

    def __iter__(self):
        """Yields (token slice, the two work buffers cut to the block's length)."""
        for start in range(0, self.n, self.step):
            length = min(self.step, self.n - start)
            yield slice(start, start + length), [buf[:, :, :length] for buf in self.buffers]


def _kv_state(
    keys_values: Callable[[slice], tuple[torch.Tensor, torch.Tensor]], blocks: _TokenBlocks, phi: FeatureMap
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


def _attend(
    queries: Callable[[slice], torch.Tensor], kv: torch.Tensor, k_sum: torch.Tensor, blocks: _TokenBlocks, phi: FeatureMap, eps: float, out: torch.Tensor
) -> torch.Tensor:
    """Writes ``phi(q) S / max(phi(q) z, eps)`` into ``out`` (B, h, N, e), block by block of ``queries``."""
    for blk, (phi_q, scaled) in blocks:
        _normalized_phi_q(queries(blk), k_sum, phi, eps, phi_q, scaled)
        _matmul_into(scaled, kv, out[:, :, blk])
    return out


def _token_major(batch: int, n: int, heads: int, d: int, like: torch.Tensor) -> torch.Tensor:
    """An empty (B, heads, N, d) tensor laid out (B, N, heads, d) in memory: merging its heads is a view.
    Not itself a view, so a caller may add to it in place (a locality term) even under autograd."""
    return like.new_empty_strided((batch, heads, n, d), (n * heads * d, d, heads * d, 1))


def _linear_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, phi: FeatureMap, eps: float, out: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The output (B, h, N, e), written into ``out`` if given, else token-major in memory, and S, z."""
    batch, heads, n, _ = q.shape
    with torch.autocast(device_type=q.device.type, enabled=False):
        blocks = _TokenBlocks.like(k)
        kv, k_sum = _kv_state(lambda blk: (k[:, :, blk], v[:, :, blk]), blocks, phi)
        out = _token_major(batch, n, heads, v.shape[-1], v) if out is None else out
        _attend(lambda blk: q[:, :, blk], kv, k_sum, blocks, phi, eps, out)
    return out, kv, k_sum


def _linear_backward(
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
        blocks = _TokenBlocks.like(q)
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


class _LinearAttention(torch.autograd.Function):
    """Non-causal linear attention. Saves q, k, v and the small S, z; the backward pass recomputes the
    feature maps block by block, so a training step stores no (N, d) tensor of its own. The output is
    laid out token-major, (B, N, h, e) in memory, so merging the heads afterwards is a view."""

    @staticmethod
    def forward(ctx, q, k, v, phi: FeatureMap, eps: float):
        out, kv, k_sum = _linear_forward(q, k, v, phi, eps)
        ctx.save_for_backward(q, k, v, kv, k_sum)
        ctx.phi, ctx.eps = phi, eps
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        saved = ctx.saved_tensors
        grads = tuple(torch.empty_like(t) for t in saved[:3])
        _linear_backward(saved, grad_out, ctx.phi, ctx.eps, grads)
        return *grads, None, None


class _PackedLinearAttention(torch.autograd.Function):
    """:class:`_LinearAttention` on the qkv projection (B, N, 3 C) itself, returning (B, N, C) with the
    heads merged, and the values (B, N, C) as a view of the projection. Its gradient comes back as one
    (B, N, 3 C) tensor written block by block (the values' own gradient, if any, added into it), so
    autograd neither stacks dq, dk, dv, copies them into the projection's layout, nor zero-fills a
    projection-sized gradient for a slice of it."""

    @staticmethod
    def forward(ctx, qkv, num_heads: int, phi: FeatureMap, eps: float):
        q, k, v = split_heads(qkv, num_heads)
        dim = qkv.shape[2] // 3
        merged = qkv.new_empty(*qkv.shape[:2], dim)  # not a view: callers may add to it in place
        _, kv, k_sum = _linear_forward(q, k, v, phi, eps, out=merged.unflatten(-1, (num_heads, -1)).transpose(1, 2))
        ctx.save_for_backward(qkv, kv, k_sum)
        ctx.num_heads, ctx.phi, ctx.eps = num_heads, phi, eps
        return merged, qkv[..., 2 * dim :]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, grad_values):
        qkv, kv, k_sum = ctx.saved_tensors
        grad_qkv = torch.empty_like(qkv, memory_format=torch.contiguous_format)
        saved = (*split_heads(qkv, ctx.num_heads), kv, k_sum)
        grad_out = grad_out.unflatten(-1, (ctx.num_heads, -1)).transpose(1, 2)  # (B, h, N, e)
        _linear_backward(saved, grad_out, ctx.phi, ctx.eps, split_heads(grad_qkv, ctx.num_heads))
        if grad_values is not None:
            grad_qkv[..., 2 * (qkv.shape[2] // 3) :] += grad_values
        return grad_qkv, None, None, None


def linear_packed(
    qkv: torch.Tensor, num_heads: int, feature_map: str = "elu", eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-causal :func:`linear` on a qkv projection: (B, N, 3 C) laid out as timm's (q, k, v, then heads of
    d = C / num_heads) -> the output (B, N, C), heads merged, and the values (B, N, C), a view of the
    projection (for a locality term on them). The same values as splitting the heads and calling
    :func:`linear`; with autograd the gradient is one (B, N, 3 C) tensor."""
    check_packed_qkv(qkv, num_heads, "linear_packed")
    return _PackedLinearAttention.apply(qkv, num_heads, get_feature_map(feature_map), eps)


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
    if not causal and not torch.compiler.is_compiling():
        return _LinearAttention.apply(q, k, v, phi, eps)
    with torch.autocast(device_type=q.device.type, enabled=False):
        qf, kf, vf = phi(q.float()), phi(k.float()), v.float()
        if causal:
            v_ones = torch.cat([vf, vf.new_ones(*vf.shape[:-1], 1)], dim=-1)  # last column sums the normalizer
            num_den = _CausalProduct.apply(qf, kf, v_ones, chunk_size)  # (B, h, N, d + 1)
        else:  # a compiled graph: the plain formulation, which the compiler fuses
            kv_sum = kf.transpose(-2, -1) @ torch.cat([vf, vf.new_ones(*vf.shape[:-1], 1)], dim=-1)  # (B, h, d, e + 1)
            num_den = qf @ kv_sum
        out = num_den[..., :-1] / num_den[..., -1:].clamp_min(eps)
    return out.to(v.dtype)


def linear_from_input(
    x: torch.Tensor,
    qkv_weight: torch.Tensor,
    qkv_bias: torch.Tensor | None,
    num_heads: int,
    feature_map: str = "elu",
    eps: float = 1e-6,
    q_norm: Callable[[torch.Tensor], torch.Tensor] | None = None,
    k_norm: Callable[[torch.Tensor], torch.Tensor] | None = None,
    keep_values: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Non-causal linear attention fused with the qkv projection, for inference (no autograd).

    Equal to projecting ``x`` with ``qkv_weight`` (timm's ``qkv``: the q rows, then k, then v; heads of
    ``d = C / num_heads``), applying the norms and :func:`linear`, but block by block of tokens: a first
    pass projects the keys and values of a block and folds them into ``S`` and ``z``, a second projects
    the queries of a block and writes its output. The (B, N, 3 C) projection never exists; q, k and v
    live in cache.

    Args:
        x: (B, N, C_in).
        qkv_weight: (3 C, C_in); qkv_bias: (3 C,) or None.
        q_norm, k_norm: per-head norms on (B, heads, n, d), or None.
        keep_values: also return the projected values (B, N, C), e.g. for a locality term on them.
    Returns:
        (B, N, C), heads merged, in the projection's dtype (autocast applies to the projection; the
        mixing is fp32); with ``keep_values`` also the values.
    """
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, qkv_weight) if t is not None):
        raise ValueError("linear_from_input: inference only; use the qkv projection and linear() for autograd")
    phi = get_feature_map(feature_map)
    batch, n, _ = x.shape
    dim = qkv_weight.shape[0] // 3
    d = dim // num_heads
    q_norm = q_norm or (lambda t: t)
    k_norm = k_norm or (lambda t: t)
    q_bias, kv_bias = (None, None) if qkv_bias is None else (qkv_bias[:dim], qkv_bias[dim:])
    device = x.device.type
    caller_autocast = {"enabled": torch.is_autocast_enabled(device), "dtype": torch.get_autocast_dtype(device)}

    def project(blk: slice, rows: slice, bias: torch.Tensor | None) -> torch.Tensor:  # (B, n, len(rows))
        with torch.autocast(device_type=device, **caller_autocast):  # as the plain projection would run
            return F.linear(x[:, blk], qkv_weight[rows], bias)

    values_dtype = caller_autocast["dtype"] if caller_autocast["enabled"] else x.dtype
    values = x.new_empty(batch, n, dim, dtype=values_dtype) if keep_values else None

    def keys_values(blk: slice) -> tuple[torch.Tensor, torch.Tensor]:
        kv = project(blk, slice(dim, None), kv_bias)  # (B, n, 2 C)
        if values is not None:
            values[:, blk] = kv[..., dim:]
        kv = kv.unflatten(-1, (2, num_heads, d))  # (B, n, 2, h, d)
        return k_norm(kv[:, :, 0].transpose(1, 2)), kv[:, :, 1].transpose(1, 2)

    def queries(blk: slice) -> torch.Tensor:
        return q_norm(project(blk, slice(None, dim), q_bias).unflatten(-1, (num_heads, d)).transpose(1, 2))

    blocks = _TokenBlocks(batch, num_heads, n, d, x.device)
    with torch.autocast(device_type=device, enabled=False):
        kv, k_sum = _kv_state(keys_values, blocks, phi)
        out = x.new_empty(batch, n, dim, dtype=values_dtype)  # in the values' dtype, as in linear()
        _attend(queries, kv, k_sum, blocks, phi, eps, out.unflatten(-1, (num_heads, d)).transpose(1, 2))
    return (out, values) if keep_values else out


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
