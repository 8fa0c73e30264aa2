"""Axial attention (Ho et al. 2019): row attention, then column attention, over the patch grid, on the
path :func:`visattn.ops.backends.choose_axial_backend` picks.

One set of q, k, v covers the whole grid in two hops:

1. rows: each patch query attends to the keys of its own row plus the prefix keys, with values v; the
   result v' replaces v for the patch tokens (the prefix tokens keep their v);
2. columns: each patch query attends to the keys of its own column plus the prefix keys, with values
   v' (the row-mixed values).

Every patch output thus aggregates over the whole grid. Prefix (class/register) queries attend to all
N tokens with ordinary softmax over k and v. Cost per head: O(N (H + W) d + P N d), never N x N.
"""
from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from visattn.ops.axial.cpu_kernels import CPUKernelsAxialAttention, PackedCPUKernelsAxialAttention
from visattn.ops.axial.hops import rows_then_columns
from visattn.ops.axial.triton import (
    DTYPES,
    check_triton_axial,
    packed_triton_axial_attn,
    triton_axial_attn,
    triton_fits,
)
from visattn.ops.backends import choose_axial_backend, cpu_kernels_apply, needs_autograd, select_backend
from visattn.ops.checks import check_dropout, check_grid, check_packed_qkv, check_qkv
from visattn.ops.layout import merge_heads, split_qkv


def _select(
    op: str, t: torch.Tensor, grid: tuple[int, int], p: int, head_dim: int, dropout_p: float, needs_grad: bool,
    backend: str | None,
) -> str:
    fits = t.dtype in DTYPES and triton_fits(grid, p, head_dim)
    name = select_backend("axial", backend, lambda: choose_axial_backend(t.device, dropout_p, needs_grad, fits))
    if name == "cpu_kernels" and not cpu_kernels_apply(t.device, dropout_p):
        raise ValueError(
            f"{op}: backend 'cpu_kernels' needs a CPU tensor, dropout_p=0 and no autocast; got device "
            f"{t.device.type}, dropout_p={dropout_p}; use 'sdpa' or 'sdpa_checkpoint'"
        )
    if name == "triton":
        if dropout_p:
            raise ValueError(f"{op}: backend 'triton' has no dropout, got dropout_p={dropout_p}; use 'sdpa'")
        check_triton_axial(op, grid, p, head_dim, t)
    return name


def axial_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grid: tuple[int, int],
    num_prefix_tokens: int = 0,
    dropout_p: float = 0.0,
    scale: float | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Row-then-column softmax attention over the patch grid, prefix keys visible in both hops.

    On the SDPA paths the row hop reads strided views of q, k, v (the prefix keys and values are
    concatenated in front); the column hop works on contiguous copies of its columns, which the fused
    kernel reads much faster than column views. The Triton path reads q, k, v in place and copies
    nothing. The output is token-major.

    Args:
        q, k, v: (B, heads, N, d), N = num_prefix_tokens + H * W, prefix tokens first, patches in
            raster order (row by row).
        grid: (H, W), the patch grid.
        num_prefix_tokens: P, the class/register tokens before the patches.
        dropout_p: attention dropout, applied in every softmax (rows, columns, prefix queries).
        scale: score scale; ``d ** -0.5`` if None.
        backend: ``"cpu_kernels"`` (CPU, no dropout: the fused kernels with a hand-written backward that
            keeps q, k, v, the row hop's output and the log-sum-exps), ``"sdpa"`` (autograd through
            SDPA), ``"sdpa_checkpoint"`` (SDPA, the hops recomputed in the backward: only q, k and v
            are kept), ``"triton"`` (CUDA, or the CPU interpreted; no dropout: the kernels of
            :mod:`visattn.ops.axial.triton`, with a flash-style backward that keeps q, k, v, the row hop's
            output and the log-sum-exps); None: chosen by :func:`visattn.ops.backends.choose_axial_backend`.
    Returns:
        (B, heads, N, d), a view of a token-major (B, N, heads, d) tensor.
    """
    check_qkv(q, k, v, "axial_attn")
    check_dropout(dropout_p, "axial_attn")
    h, _ = check_grid(grid, q.shape[2], num_prefix_tokens, "axial_attn")
    needs_grad = needs_autograd(q, k, v)
    name = _select("axial_attn", q, grid, num_prefix_tokens, q.shape[-1], dropout_p, needs_grad, backend)
    args = (q, k, v, h, num_prefix_tokens, dropout_p, scale)
    if name == "triton":
        return triton_axial_attn(q, k, v, grid, num_prefix_tokens, scale)
    if name == "cpu_kernels":
        return CPUKernelsAxialAttention.apply(q, k, v, h, num_prefix_tokens, scale)
    if name == "sdpa_checkpoint":
        return checkpoint(rows_then_columns, *args, use_reentrant=False).transpose(1, 2)
    return rows_then_columns(*args).transpose(1, 2)


def packed_axial_attn(
    qkv: torch.Tensor,
    num_heads: int,
    grid: tuple[int, int],
    num_prefix_tokens: int = 0,
    dropout_p: float = 0.0,
    backend: str | None = None,
) -> torch.Tensor:
    """:func:`axial_attn` on a qkv projection: (B, N, 3 C) laid out as timm's (q, k, v, then heads of
    d = C / num_heads) -> (B, N, C), heads merged. On the ``"cpu_kernels"`` and ``"triton"`` paths the
    gradient is one (B, N, 3 C) tensor, and the Triton kernels read q, k, v from ``qkv`` in place."""
    check_packed_qkv(qkv, num_heads, "packed_axial_attn")
    check_dropout(dropout_p, "packed_axial_attn")
    h, _ = check_grid(grid, qkv.shape[1], num_prefix_tokens, "packed_axial_attn")
    head_dim = qkv.shape[-1] // (3 * num_heads)
    needs_grad = needs_autograd(qkv)
    name = _select("packed_axial_attn", qkv, grid, num_prefix_tokens, head_dim, dropout_p, needs_grad, backend)
    if name == "triton":
        return packed_triton_axial_attn(qkv, num_heads, grid, num_prefix_tokens)
    if name == "cpu_kernels":
        return PackedCPUKernelsAxialAttention.apply(qkv, num_heads, h, num_prefix_tokens, None)
    return merge_heads(axial_attn(*split_qkv(qkv, num_heads), grid, num_prefix_tokens, dropout_p, backend=name))
