"""Axial attention (Ho et al. 2019): row attention, then column attention, over the patch grid.

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
import torch.nn.functional as F
from einops import rearrange
from torch.utils.checkpoint import checkpoint

from visattn.ops._checks import check_grid, check_qkv
from visattn.ops._packed import check_packed_qkv, split_heads
from visattn.ops._reference import masked_attention_reference


def _with_prefix(seqs: torch.Tensor, prefix: torch.Tensor) -> torch.Tensor:
    """Put the prefix tokens in front of every row (or column) sequence.

    Args:
        seqs: (B * S, heads, L, d), S rows (or columns) per image.
        prefix: (B, heads, P, d).
    Returns:
        (B * S, heads, P + L, d); ``seqs`` itself when P = 0. The prefix is broadcast with expand; the
        concatenation is the only copy.
    """
    b, p = prefix.shape[0], prefix.shape[2]
    if p == 0:
        return seqs
    prefix = prefix.unsqueeze(1).expand(b, seqs.shape[0] // b, *prefix.shape[1:]).flatten(0, 1)
    return torch.cat([prefix, seqs], dim=2)


def _rows_then_columns(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, h: int, p: int, dropout_p: float, scale: float | None
) -> torch.Tensor:
    """The two hops and the prefix rows; (B, heads, N, d) -> (B, N, heads, d), token-major."""
    B, heads, n, d = q.shape
    # hop 1, rows: B * H sequences of P + W keys; values v. The output is token-major (b y x heads d).
    v_mixed = F.scaled_dot_product_attention(*_row_inputs(q, k, v, h, p), dropout_p=dropout_p, scale=scale)
    # hop 2, columns: B * W sequences of P + H keys; values from hop 1 (prefix tokens keep v)
    out = F.scaled_dot_product_attention(
        *_column_inputs(q, k, v, v_mixed, h, p), dropout_p=dropout_p, scale=scale
    )  # (B * W, heads, H, d)
    mixed = out.new_empty(B, n, heads, d)  # in the attention's dtype (autocast may lower it)
    mixed[:, p:] = rearrange(out, "(b x) heads y d -> b (y x) heads d", b=B)
    if p:  # prefix queries see every token
        mixed[:, :p] = F.scaled_dot_product_attention(
            q[:, :, :p], k, v, dropout_p=dropout_p, scale=scale
        ).transpose(1, 2)
    return mixed


_ROWS = "b heads (y x) d -> (b y) heads x d"
_COLUMNS = "b heads (y x) d -> (b x) heads y d"
_FROM_ROWS = "(b y) heads x d -> b heads (y x) d"
_FROM_COLUMNS = "(b x) heads y d -> b heads (y x) d"
_ROWS_TO_COLUMNS = "(b y) heads x d -> (b x) heads y d"
_COLUMNS_TO_ROWS = "(b x) heads y d -> (b y) heads x d"


def _axial_cpu_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, h: int, p: int, scale: float | None
) -> tuple[torch.Tensor, tuple]:
    """:func:`_rows_then_columns` without dropout, directly on the CPU's fused kernel, which also returns
    the log-sum-exps its backward kernel needs. Returns the output (B, heads, N, d), token-major, and what
    :func:`_axial_cpu_backward` needs."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    B, heads, n, d = q.shape
    q_rows, k_rows, v_rows = _row_inputs(q, k, v, h, p)
    out1, lse1 = flash(q_rows, k_rows, v_rows, 0.0, False, scale=scale)  # (B * H, heads, W, d)
    out2, lse2 = flash(*_column_inputs(q, k, v, out1, h, p), 0.0, False, scale=scale)  # (B * W, heads, H, d)
    mixed = q.new_empty(B, n, heads, d)
    mixed[:, p:] = rearrange(out2, "(b x) heads y d -> b (y x) heads d", b=B)
    out_pre = lse_pre = None
    if p:  # prefix queries see every token
        out_pre, lse_pre = flash(q[:, :, :p], k, v, 0.0, False, scale=scale)
        mixed[:, :p] = out_pre.transpose(1, 2)
    out = mixed.transpose(1, 2)
    return out, (k_rows, v_rows, out1, lse1, lse2, out, out_pre, lse_pre)


def _axial_cpu_backward(
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
    grad_cols = rearrange(grad[:, :, p:], _COLUMNS, y=h)
    out_cols = rearrange(out[:, :, p:], _COLUMNS, y=h)
    dq2, dk2, dv2 = flash_backward(
        grad_cols, *_column_inputs(q, k, v, out1, h, p, contiguous_q=False), out_cols, lse2, 0.0, False, scale=scale
    )
    grad_rows = rearrange(dv2[:, :, p:], _COLUMNS_TO_ROWS, b=B)
    q_rows = rearrange(q[:, :, p:], _ROWS, y=h)
    dq1, dk1, dv1 = flash_backward(grad_rows, q_rows, k_rows, v_rows, out1, lse1, 0.0, False, scale=scale)

    torch.add(rearrange(dq1, _FROM_ROWS, b=B), rearrange(dq2, _FROM_COLUMNS, b=B), out=dq[:, :, p:])
    torch.add(rearrange(dk1[:, :, p:], _FROM_ROWS, b=B), rearrange(dk2[:, :, p:], _FROM_COLUMNS, b=B), out=dk[:, :, p:])
    dv[:, :, p:] = rearrange(dv1[:, :, p:], _FROM_ROWS, b=B)
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


class _AxialCPU(torch.autograd.Function):
    """:func:`_rows_then_columns` without dropout on the CPU's fused kernels, with a backward pass written
    on their own backward kernels. Saves q, k, v, the row hop's keys and values (with the prefix in
    front: without prefix tokens they are views of k and v), its output and the log-sum-exps (the column
    hop's output is the op's output); unlike activation checkpointing nothing is computed twice."""

    @staticmethod
    def forward(ctx, q, k, v, h: int, p: int, scale: float | None):
        out, saved = _axial_cpu_forward(q, k, v, h, p, scale)
        ctx.save_for_backward(q, k, v, *saved)
        ctx.h, ctx.p, ctx.scale = h, p, scale
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        q, k, v, *saved = ctx.saved_tensors
        grads = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        _axial_cpu_backward(q, k, v, saved, grad, ctx.h, ctx.p, ctx.scale, grads)
        return *grads, None, None, None


class _PackedAxialCPU(torch.autograd.Function):
    """:class:`_AxialCPU` on the qkv projection (B, N, 3 C) itself, returning (B, N, C) with the heads
    merged: the gradient comes back as one (B, N, 3 C) tensor, so autograd neither stacks dq, dk, dv
    nor copies them into the projection's layout."""

    @staticmethod
    def forward(ctx, qkv, num_heads: int, h: int, p: int, scale: float | None):
        out, saved = _axial_cpu_forward(*split_heads(qkv, num_heads), h, p, scale)
        ctx.save_for_backward(qkv, *saved)
        ctx.num_heads, ctx.h, ctx.p, ctx.scale = num_heads, h, p, scale
        return out.transpose(1, 2).flatten(2)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        qkv, *saved = ctx.saved_tensors
        grad_qkv = torch.empty_like(qkv, memory_format=torch.contiguous_format)
        grad = grad.unflatten(-1, (ctx.num_heads, -1)).transpose(1, 2)  # (B, heads, N, d)
        _axial_cpu_backward(
            *split_heads(qkv, ctx.num_heads), saved, grad, ctx.h, ctx.p, ctx.scale, split_heads(grad_qkv, ctx.num_heads)
        )
        return grad_qkv, None, None, None, None


def _fused_kernels_apply(t: torch.Tensor, dropout_p: float) -> bool:
    """Whether the hand-written backward pass applies: on the CPU, without dropout or autocast, and with
    SDPA's fused (flash) backend enabled (``torch.nn.attention.sdpa_kernel`` can select another)."""
    return (
        not torch.compiler.is_compiling()  # a compiled graph gets the plain formulation, which the compiler fuses
        and t.device.type == "cpu"
        and not dropout_p
        and not torch.is_autocast_enabled("cpu")
        and torch.backends.cuda.flash_sdp_enabled()  # the backend switch SDPA itself reads, on every device
    )


def _row_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, h: int, p: int) -> tuple[torch.Tensor, ...]:
    """Hop 1's q, k, v: (B * H, heads, W (+ P), d); q is a view, k and v get the prefix in front."""
    q_rows = rearrange(q[:, :, p:], _ROWS, y=h)
    k_rows = _with_prefix(rearrange(k[:, :, p:], _ROWS, y=h), k[:, :, :p])
    v_rows = _with_prefix(rearrange(v[:, :, p:], _ROWS, y=h), v[:, :, :p])
    return q_rows, k_rows, v_rows


def _column_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, v_mixed: torch.Tensor, h: int, p: int, contiguous_q: bool = True
) -> tuple[torch.Tensor, ...]:
    """Hop 2's q, k, v: (B * W, heads, H (+ P), d), contiguous (a column view strides a whole row between
    its tokens, which the fused kernel reads slowly; its backward kernel minds less, so the queries may
    stay a view there); the values are hop 1's output ``v_mixed`` (B * H, heads, W, d), the prefix
    tokens keep v."""
    B = q.shape[0]
    q_cols = rearrange(q[:, :, p:], _COLUMNS, y=h)
    q_cols = q_cols.contiguous() if contiguous_q else q_cols
    k_cols = _with_prefix(rearrange(k[:, :, p:], _COLUMNS, y=h), k[:, :, :p]).contiguous()
    v_cols = _with_prefix(rearrange(v_mixed, _ROWS_TO_COLUMNS, b=B), v[:, :, :p]).contiguous()
    return q_cols, k_cols, v_cols


def axial(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grid: tuple[int, int],
    num_prefix_tokens: int = 0,
    dropout_p: float = 0.0,
    scale: float | None = None,
) -> torch.Tensor:
    """Row-then-column softmax attention over the patch grid, prefix keys visible in both hops.

    The row hop reads strided views of q, k, v (the prefix keys and values are concatenated in front);
    the column hop works on contiguous copies of its columns, which the fused kernel reads much faster
    than column views. The output is token-major. With autograd on the CPU (no dropout, no autocast)
    the backward pass is hand-written on the fused kernels' own backward (:class:`_AxialCPU`): it keeps
    q, k, v, the row hop's output and the log-sum-exps. Elsewhere the two hops are recomputed in the
    backward pass (activation checkpointing) and only q, k and v are kept.

    Args:
        q, k, v: (B, heads, N, d), N = num_prefix_tokens + H * W, prefix tokens first, patches in
            raster order (row by row).
        grid: (H, W), the patch grid.
        num_prefix_tokens: P, the class/register tokens before the patches.
        dropout_p: attention dropout, applied in every softmax (rows, columns, prefix queries).
        scale: score scale; ``d ** -0.5`` if None.
    Returns:
        (B, heads, N, d), a view of a token-major (B, N, heads, d) tensor.
    """
    check_qkv(q, k, v, "axial")
    h, _ = check_grid(grid, q.shape[2], num_prefix_tokens, "axial")
    args = (q, k, v, h, num_prefix_tokens, dropout_p, scale)
    if torch.compiler.is_compiling() or not (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))):
        return _rows_then_columns(*args).transpose(1, 2)
    if _fused_kernels_apply(q, dropout_p):
        return _AxialCPU.apply(q, k, v, h, num_prefix_tokens, scale)
    return checkpoint(_rows_then_columns, *args, use_reentrant=False).transpose(1, 2)


def axial_packed(
    qkv: torch.Tensor, num_heads: int, grid: tuple[int, int], num_prefix_tokens: int = 0, dropout_p: float = 0.0
) -> torch.Tensor:
    """:func:`axial` on a qkv projection: (B, N, 3 C) laid out as timm's (q, k, v, then heads of
    d = C / num_heads) -> (B, N, C), heads merged. With autograd on the CPU the gradient is one
    (B, N, 3 C) tensor."""
    check_packed_qkv(qkv, num_heads, "axial_packed")
    h, _ = check_grid(grid, qkv.shape[1], num_prefix_tokens, "axial_packed")
    if torch.is_grad_enabled() and qkv.requires_grad and _fused_kernels_apply(qkv, dropout_p):
        return _PackedAxialCPU.apply(qkv, num_heads, h, num_prefix_tokens, None)
    return axial(*split_heads(qkv, num_heads), grid, num_prefix_tokens, dropout_p).transpose(1, 2).flatten(2)


def axial_masks(
    grid: tuple[int, int], num_prefix_tokens: int, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (N, N) bool masks of the two hops: same row (hop 1) and same column (hop 2).

    Prefix keys are visible to every query and prefix queries see every key.
    """
    h, w = grid
    p = num_prefix_tokens
    idx = torch.arange(p + h * w, device=device)
    is_prefix = idx < p
    row = torch.where(is_prefix, -1, (idx - p) // w)
    col = torch.where(is_prefix, -1, (idx - p) % w)
    seen_by_all = is_prefix[None, :] | is_prefix[:, None]
    same_row = (row[:, None] == row[None, :]) | seen_by_all
    same_col = (col[:, None] == col[None, :]) | seen_by_all
    return same_row, same_col


def axial_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grid: tuple[int, int],
    num_prefix_tokens: int = 0,
    scale: float | None = None,
) -> torch.Tensor:
    """Naive twin of :func:`axial`: two explicit N x N masked softmax attentions."""
    check_qkv(q, k, v, "axial_reference")
    check_grid(grid, q.shape[2], num_prefix_tokens, "axial_reference")
    p = num_prefix_tokens
    same_row, same_col = axial_masks(grid, p, q.device)
    hop1 = masked_attention_reference(q, k, v, same_row, scale)  # prefix rows: full attention over v
    v_rows = torch.cat([v[:, :, :p], hop1[:, :, p:]], dim=2)  # prefix tokens keep their v
    hop2 = masked_attention_reference(q, k, v_rows, same_col, scale)
    return torch.cat([hop1[:, :, :p], hop2[:, :, p:]], dim=2)
