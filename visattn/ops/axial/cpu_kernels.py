"""Axial attention on the CPU's fused SDPA kernels, with a backward pass written on their own backward
kernels: the forward keeps the log-sum-exps those need, so unlike activation checkpointing nothing is
computed twice. No dropout (the kernels drop nothing)."""
from __future__ import annotations

import torch
from einops import rearrange

from visattn.ops.axial.hops import (
    COLUMNS,
    COLUMNS_TO_ROWS,
    COLUMNS_TO_TOKENS,
    FROM_COLUMNS,
    FROM_ROWS,
    ROWS,
    column_inputs,
    row_inputs,
)
from visattn.ops.layout import merge_heads, split_heads, split_qkv


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, h: int, p: int, scale: float | None) -> tuple[torch.Tensor, tuple]:
    """:func:`visattn.ops.axial.hops.rows_then_columns` without dropout, directly on the CPU's fused
    kernel, which also returns the log-sum-exps its backward kernel needs. Returns the output
    (B, heads, N, d), token-major, and what :func:`_backward` needs."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    B, heads, n, d = q.shape
    q_rows, k_rows, v_rows = row_inputs(q, k, v, h, p)
    out1, lse1 = flash(q_rows, k_rows, v_rows, 0.0, False, scale=scale)  # (B * H, heads, W, d)
    out2, lse2 = flash(*column_inputs(q, k, v, out1, h, p), 0.0, False, scale=scale)  # (B * W, heads, H, d)
    mixed = q.new_empty(B, n, heads, d)
    mixed[:, p:] = rearrange(out2, COLUMNS_TO_TOKENS, b=B)
    out_pre = lse_pre = None
    if p:  # prefix queries see every token
        out_pre, lse_pre = flash(q[:, :, :p], k, v, 0.0, False, scale=scale)
        mixed[:, :p] = out_pre.transpose(1, 2)
    out = mixed.transpose(1, 2)
    return out, (k_rows, v_rows, out1, lse1, lse2, out, out_pre, lse_pre)


def _backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    saved: tuple,
    grad: torch.Tensor,
    h: int,
    p: int,
    scale: float | None,
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> None:
    """Writes dq, dk, dv into ``grads`` (shaped like q, k, v, any strides) with the fused kernel's backward:
    the column hop first, whose value gradient is the row hop's output gradient, then the row hop and
    the prefix rows. The column copies are rebuilt from q, k, v (the query columns enter as views)."""
    flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    k_rows, v_rows, out1, lse1, lse2, out, out_pre, lse_pre = saved
    dq, dk, dv = grads
    B = q.shape[0]
    # the column hop's output and gradient enter as column views (the kernel takes strides)
    grad_cols = rearrange(grad[:, :, p:], COLUMNS, y=h)
    out_cols = rearrange(out[:, :, p:], COLUMNS, y=h)
    dq2, dk2, dv2 = flash_backward(
        grad_cols, *column_inputs(q, k, v, out1, h, p, contiguous_q=False), out_cols, lse2, 0.0, False, scale=scale
    )
    grad_rows = rearrange(dv2[:, :, p:], COLUMNS_TO_ROWS, b=B)
    q_rows = rearrange(q[:, :, p:], ROWS, y=h)
    dq1, dk1, dv1 = flash_backward(grad_rows, q_rows, k_rows, v_rows, out1, lse1, 0.0, False, scale=scale)

    torch.add(rearrange(dq1, FROM_ROWS, b=B), rearrange(dq2, FROM_COLUMNS, b=B), out=dq[:, :, p:])
    torch.add(rearrange(dk1[:, :, p:], FROM_ROWS, b=B), rearrange(dk2[:, :, p:], FROM_COLUMNS, b=B), out=dk[:, :, p:])
    dv[:, :, p:] = rearrange(dv1[:, :, p:], FROM_ROWS, b=B)
    if p:
        def per_image(t: torch.Tensor) -> torch.Tensor:  # the prefix part of every line, summed per image
            return t[:, :, :p].unflatten(0, (B, -1)).sum(dim=1)

        # the prefix keys and values sit in every row and column; the prefix queries see every token
        dq[:, :, :p], dk_all, dv_all = flash_backward(
            grad[:, :, :p], q[:, :, :p], k, v, out_pre, lse_pre, 0.0, False, scale=scale
        )
        torch.add(per_image(dk1), per_image(dk2), out=dk[:, :, :p])
        torch.add(per_image(dv1), per_image(dv2), out=dv[:, :, :p])
        dk += dk_all
        dv += dv_all


class CPUKernelsAxialAttention(torch.autograd.Function):
    """Saves q, k, v, the row hop's keys and values (with the prefix in front: without prefix tokens they
    are views of k and v), its output and the log-sum-exps (the column hop's output is the op's output).
    ``apply(q, k, v, h, p, scale)`` -> (B, heads, N, d), token-major."""

    @staticmethod
    def forward(ctx, q, k, v, h: int, p: int, scale: float | None):
        out, saved = _forward(q, k, v, h, p, scale)
        ctx.save_for_backward(q, k, v, *saved)
        ctx.h, ctx.p, ctx.scale = h, p, scale
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        q, k, v, *saved = ctx.saved_tensors
        grads = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        _backward(q, k, v, saved, grad, ctx.h, ctx.p, ctx.scale, grads)
        return *grads, None, None, None


class PackedCPUKernelsAxialAttention(torch.autograd.Function):
    """:class:`CPUKernelsAxialAttention` on the qkv projection (B, N, 3 C) itself, returning (B, N, C) with
    the heads merged: the gradient comes back as one (B, N, 3 C) tensor, so autograd neither stacks
    dq, dk, dv nor copies them into the projection's layout. ``apply(qkv, num_heads, h, p, scale)``."""

    @staticmethod
    def forward(ctx, qkv, num_heads: int, h: int, p: int, scale: float | None):
        out, saved = _forward(*split_qkv(qkv, num_heads), h, p, scale)
        ctx.save_for_backward(qkv, *saved)
        ctx.num_heads, ctx.h, ctx.p, ctx.scale = num_heads, h, p, scale
        return merge_heads(out)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        qkv, *saved = ctx.saved_tensors
        grad_qkv = torch.empty_like(qkv, memory_format=torch.contiguous_format)
        _backward(
            *split_qkv(qkv, ctx.num_heads), saved, split_heads(grad, ctx.num_heads), ctx.h, ctx.p, ctx.scale,
            split_qkv(grad_qkv, ctx.num_heads),
        )
        return grad_qkv, None, None, None, None
