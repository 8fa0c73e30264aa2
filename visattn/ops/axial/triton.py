"""Axial attention as Triton kernels that read q, k and v in place from strided views of the qkv
projection ((B, N, 3 C) viewed (B, N, 3, heads, d)) and write the output token-major: no prefix
concatenation, no row or column copy, no scatter of the output.

The kernels (:mod:`visattn.ops.axial.triton_kernels`: ``line_forward_kernel`` and
``line_backward_kernel`` for each hop, ``prefix_forward_kernel`` and ``prefix_backward_kernel`` for the
prefix queries) give one program to one line (a row in the row hop, a column in the column hop) of one
image and head, holding the line's keys and values and the prefix keys and values whole, so the softmax
over [prefix keys, line keys] is exact in one step, with fp32 sums and a base-2 log-sum-exp kept for the
backward. This module launches them, registers the ops through
``torch.library`` with their autograd, and says which inputs they take (:func:`check_triton_axial`).

Forward (grid (B * heads, lines) for each hop):

1. rows: the row hop's output is written into ``v_rows`` (B, heads, N, d), token-major, whose prefix
   tokens take v's (the column hop's values, as in :func:`visattn.ops.axial.naive.naive_axial_attn`). Each row
   program also attends the prefix queries to its row's keys and leaves a partial output and
   log-sum-exp per row;
2. columns: the column hop over the keys of the column plus the prefix keys, values ``v_rows``,
   written into the output's patch tokens;
3. prefix queries (grid (B * heads,)): their attention to the prefix keys, merged with the rows'
   partials by log-sum-exp in row order.

Backward (flash style: scores recomputed from the saved log-sum-exps; saved: q, k, v, ``v_rows``, the
output and the fp32 log-sum-exps): the column hop first (dq, dk of the patches; the gradient of
``v_rows``, which is the row hop's output gradient, and its row sums with ``v_rows``), then the rows
(adding their dq, dk; dv of the patches; the prefix queries' share of the row keys' gradients), then
the prefix tokens (summing every line's partial gradients of the prefix keys and values, and the rows'
partial gradients of the prefix queries, in a fixed order). No atomics: every value is written by one
program, so the result is deterministic.
"""
from __future__ import annotations

import torch

from visattn.ops.layout import split_heads, split_qkv, token_major_empty
from visattn.ops.triton_support import AUTOTUNE, HAS_TRITON, INTERPRETED, check_triton_runs_on, register_triton_op

if HAS_TRITON:
    import triton
    from torch.library import wrap_triton

    from visattn.ops.axial import triton_kernels as kernels

MAX_LINE = 256  # longest row or column (and most prefix tokens, largest head dim) one program holds
LOG2E = 1.4426950408889634
DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# (kernel, BLOCK_L, BLOCK_D, dtype) -> (BLOCK_Q, num_warps, num_stages), measured on a GPU with
# :func:`autotuned_configs`; a launch finds its configuration here before it would autotune.
TUNED_CONFIGS: dict[tuple[str, int, int, str], tuple[int, int, int]] = {}
INTERPRETED_CONFIG = (16, 4, 1)  # 16-query blocks, so that the tests walk several blocks per line
# (BLOCK_Q, num_warps, num_stages); compiled for sm_90 at BLOCK_L 128, d 64, bf16, the backward spills
# fewest registers with 16-query blocks on 8 warps, the forward none with 64 or 128 on 8 warps
AUTOTUNE_CONFIGS = ((16, 4, 2), (16, 8, 1), (32, 8, 1), (64, 4, 2), (64, 8, 2), (128, 8, 1))
Tensors3 = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
Tensors4 = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
Tensors5 = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


if HAS_TRITON:

    def _autotuned(kernel, restore_value: tuple[str, ...] = ()):
        """``kernel`` autotuned over :data:`AUTOTUNE_CONFIGS` per tile sizes, hop and dtype;
        ``restore_value``: the outputs it adds to, restored between the trial runs."""
        configs = [
            triton.Config({"BLOCK_Q": block_q}, num_warps=warps, num_stages=stages)
            for block_q, warps, stages in AUTOTUNE_CONFIGS
        ]
        return triton.autotune(configs, key=["BLOCK_L", "BLOCK_D", "ROWS"], restore_value=list(restore_value))(kernel)

    _KERNELS = {"forward": kernels.line_forward_kernel, "backward": kernels.line_backward_kernel}
    _AUTOTUNED = {} if INTERPRETED else {
        "forward": _autotuned(kernels.line_forward_kernel),
        # the rows add to dq, dk
        "backward": _autotuned(kernels.line_backward_kernel, restore_value=("dq_ptr", "dk_ptr")),
    }


def _block(n: int) -> int:
    """The power-of-two tile side holding n rows, at least 16 (``tl.dot`` takes no smaller operand). A
    symbolic size (a compiled graph with dynamic shapes) is made concrete: a tile size is a constant of
    the kernel."""
    return max(16, 1 << max(int(n) - 1, 0).bit_length())


def _strides(*tensors: torch.Tensor) -> list[int]:
    return [s for t in tensors for s in t.stride()]


def _prefix_meta(q: torch.Tensor, p: int) -> dict:
    """The tile sizes and precision every kernel takes."""
    low_precision = not INTERPRETED and q.dtype != torch.float32  # the interpreter has no fp16/bf16 arithmetic
    return {"LOW_PRECISION": low_precision, "BLOCK_P": _block(p), "BLOCK_D": _block(q.shape[-1])}


def _lines(rows: bool, h: int, w: int) -> dict:
    """A hop's lines for the line kernels: H rows of W patches (patch ``y * W + x``), or W columns of H."""
    if rows:
        return {"length": w, "num_lines": h, "seq_step": w, "elem_step": 1, "ROWS": True, "BLOCK_L": _block(w)}
    return {"length": h, "num_lines": w, "seq_step": 1, "elem_step": w, "ROWS": False, "BLOCK_L": _block(h)}


def _launch(hop: str, kernel: str, grid: tuple[int, int], args: list, meta: dict, dtype: torch.dtype) -> None:
    """A line kernel (``kernel``: "forward" or "backward" of ``hop``: "rows" or "columns") at its
    configuration: the fixed one when interpreted, else :data:`TUNED_CONFIGS`'s, else autotuned (the first
    candidate where autotuning is off, :mod:`visattn.ops.triton_support`)."""
    assert min(meta["BLOCK_L"], meta["BLOCK_P"], meta["BLOCK_D"]) >= 16, meta  # tl.dot's smallest operand
    if INTERPRETED:
        config = INTERPRETED_CONFIG
    else:
        dtype_name = str(dtype).removeprefix("torch.")
        config = TUNED_CONFIGS.get((f"{hop}_{kernel}", meta["BLOCK_L"], meta["BLOCK_D"], dtype_name))
        if config is None and not AUTOTUNE:  # the first candidate (triton_support says when)
            config = AUTOTUNE_CONFIGS[0]
    if config is None:
        wrap_triton(_AUTOTUNED[kernel])[grid](*args, **meta)
        return
    block_q, warps, stages = config
    wrap_triton(_KERNELS[kernel])[grid](*args, **meta, BLOCK_Q=block_q, num_warps=warps, num_stages=stages)


def autotuned_configs() -> dict[tuple[str, int, int, str], tuple[int, int, int]]:
    """What this process's autotuning chose (eager calls on a GPU), as :data:`TUNED_CONFIGS` entries."""
    chosen = {}
    for kernel, tuner in _AUTOTUNED.items() if HAS_TRITON else ():
        for (block_l, block_d, rows, dtype, *_), config in tuner.cache.items():
            name = f"{'rows' if rows else 'columns'}_{kernel}"
            entry = (config.kwargs["BLOCK_Q"], config.num_warps, config.num_stages)
            chosen[(name, block_l, block_d, dtype.removeprefix("torch."))] = entry
    return chosen


def _saved_buffers(q: torch.Tensor, p: int) -> Tensors4:
    """What the forward leaves for the backward besides q, k, v and the output: ``v_rows`` (B, heads, N, d)
    token-major (the row hop's output, v at the prefix tokens; the column hop's values) and the base-2
    log-sum-exps, fp32, of the row hop and the column hop (B * heads, H * W) and of the prefix queries
    (B * heads, P)."""
    batch, heads, n, d = q.shape
    lse_rows, lse_cols = (q.new_empty(batch * heads, n - p, dtype=torch.float32) for _ in range(2))
    lse_pre = q.new_empty(batch * heads, p, dtype=torch.float32)
    return token_major_empty(batch, heads, n, d, q), lse_rows, lse_cols, lse_pre


def _forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, saved: Tensors4, h: int, p: int, scale: float
) -> None:
    """Writes the output into ``out`` and :func:`_saved_buffers` into ``saved``; q, k, v, out
    (B, heads, N, d), any strides."""
    batch, heads, n, d = q.shape
    w, bh = (n - p) // h, batch * heads
    v_rows, lse_rows, lse_cols, lse_pre = saved
    # the prefix queries' partial outputs over each row; without prefix tokens never read (placeholders)
    part_out = q.new_empty(bh, h, p, d, dtype=torch.float32) if p else lse_rows
    part_lse = q.new_empty(bh, h, p, dtype=torch.float32) if p else lse_rows
    meta = {"heads": heads, "p": p, "head_dim": d, "scale_log2e": scale * LOG2E, "HAS_PREFIX": p > 0}
    meta |= _prefix_meta(q, p)
    row_args = [q, k, v, v_rows, lse_rows, part_out, part_lse, *_strides(q, k, v, v_rows)]
    _launch("rows", "forward", (bh, h), row_args, _lines(True, h, w) | meta, q.dtype)
    column_args = [q, k, v_rows, out, lse_cols, part_out, part_lse, *_strides(q, k, v_rows, out)]
    _launch("columns", "forward", (bh, w), column_args, _lines(False, h, w) | meta, q.dtype)
    if p:
        wrap_triton(kernels.prefix_forward_kernel)[(bh,)](
            q, k, v, out, lse_pre, part_out, part_lse, *_strides(q, k, v, out), heads, p, h, d, scale * LOG2E,
            **_prefix_meta(q, p),
        )


def _backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    grad: torch.Tensor,
    saved: Tensors4,
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    h: int,
    p: int,
    scale: float,
) -> None:
    """Writes dq, dk, dv into ``grads`` (shaped like q, k, v, any strides); ``grad`` is the output's
    gradient (any strides), ``saved`` what :func:`_forward` left."""
    v_rows, lse_rows, lse_cols, lse_pre = saved
    dq, dk, dv = grads
    batch, heads, n, d = q.shape
    w, bh = (n - p) // h, batch * heads
    dv_rows = token_major_empty(batch, heads, n, d, v)  # the gradient of v_rows: the row hop's output gradient
    delta_rows = q.new_empty(bh, h * w, dtype=torch.float32)
    # each line's share of the prefix tokens' gradients; without prefix tokens never read (placeholders)
    part_dq = q.new_empty(bh, h, p, d, dtype=torch.float32) if p else delta_rows
    part_dk, part_dv = (q.new_empty(bh, h + w, p, d, dtype=torch.float32) if p else delta_rows for _ in range(2))
    lse_pre = lse_pre if p else delta_rows
    meta = {
        "heads": heads, "p": p, "num_all_lines": h + w, "head_dim": d, "scale": scale, "scale_log2e": scale * LOG2E,
        "HAS_PREFIX": p > 0, **_prefix_meta(q, p),
    }
    partials = [part_dk, part_dv, grad, lse_pre, part_dq]
    column_args = [
        q, k, v_rows, grad, out, lse_cols, delta_rows, dq, dk, dv_rows, *partials,
        *_strides(q, k, v_rows, grad, out, grad, dq, dk, dv_rows),
    ]
    _launch("columns", "backward", (bh, w), column_args, _lines(False, h, w) | meta | {"line_offset": h}, q.dtype)
    row_args = [
        q, k, v, dv_rows, out, lse_rows, delta_rows, dq, dk, dv, *partials,
        *_strides(q, k, v, dv_rows, out, grad, dq, dk, dv),
    ]
    _launch("rows", "backward", (bh, h), row_args, _lines(True, h, w) | meta | {"line_offset": 0}, q.dtype)
    if p:
        wrap_triton(kernels.prefix_backward_kernel)[(bh,)](
            q, k, v, grad, out, lse_pre, part_dq, part_dk, part_dv, dq, dk, dv,
            *_strides(q, k, v, grad, out, dq, dk, dv), heads, p, h, h + w, d, scale, scale * LOG2E,
            **_prefix_meta(q, p),
        )


def _axial_outputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, h: int, p: int, scale: float) -> Tensors5:
    """:func:`_axial`'s outputs, unwritten (its fake under the interpreter)."""
    return token_major_empty(*q.shape, q), *_saved_buffers(q, p)


def _axial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, h: int, p: int, scale: float) -> Tensors5:
    """(output (B, heads, N, d) token-major, *:func:`_saved_buffers`)."""
    out, *saved = _axial_outputs(q, k, v, h, p, scale)
    _forward(q, k, v, out, saved, h, p, scale)
    return out, *saved


def _axial_grads_outputs(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *_) -> Tensors3:
    """:func:`_axial_grads`'s outputs, unwritten (its fake under the interpreter)."""
    return token_major_empty(*q.shape, q), token_major_empty(*k.shape, k), token_major_empty(*v.shape, v)


def _axial_grads(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    v_rows: torch.Tensor,
    lse_rows: torch.Tensor,
    lse_cols: torch.Tensor,
    lse_pre: torch.Tensor,
    h: int,
    p: int,
    scale: float,
) -> Tensors3:
    """dq, dk, dv, token-major."""
    grads = _axial_grads_outputs(grad, q, k, v)
    _backward(q, k, v, out, grad, (v_rows, lse_rows, lse_cols, lse_pre), grads, h, p, scale)
    return grads


def _packed_outputs(qkv: torch.Tensor, num_heads: int, h: int, p: int, scale: float) -> Tensors5:
    """:func:`_packed`'s outputs, unwritten (its fake under the interpreter)."""
    batch, n, width = qkv.shape
    return qkv.new_empty(batch, n, width // 3), *_saved_buffers(split_qkv(qkv, num_heads)[0], p)


def _packed(qkv: torch.Tensor, num_heads: int, h: int, p: int, scale: float) -> Tensors5:
    """(output (B, N, C), *:func:`_saved_buffers`) from the projection (B, N, 3 C)."""
    out, *saved = _packed_outputs(qkv, num_heads, h, p, scale)
    _forward(*split_qkv(qkv, num_heads), split_heads(out, num_heads), saved, h, p, scale)
    return out, *saved


def _packed_grads_outputs(grad: torch.Tensor, qkv: torch.Tensor, *_) -> torch.Tensor:
    """:func:`_packed_grads`'s output, unwritten (its fake under the interpreter)."""
    return torch.empty_like(qkv, memory_format=torch.contiguous_format)


def _packed_grads(
    grad: torch.Tensor,
    qkv: torch.Tensor,
    out: torch.Tensor,
    v_rows: torch.Tensor,
    lse_rows: torch.Tensor,
    lse_cols: torch.Tensor,
    lse_pre: torch.Tensor,
    num_heads: int,
    h: int,
    p: int,
    scale: float,
) -> torch.Tensor:
    """The gradient of the projection, one (B, N, 3 C) tensor."""
    grad_qkv = _packed_grads_outputs(grad, qkv)
    _backward(
        *split_qkv(qkv, num_heads), split_heads(out, num_heads), split_heads(grad, num_heads),
        (v_rows, lse_rows, lse_cols, lse_pre), split_qkv(grad_qkv, num_heads), h, p, scale,
    )
    return grad_qkv


def _setup_context(ctx, inputs: tuple, output: Tensors5) -> None:
    """Keeps the input tensors, the output and the saved buffers; only the output carries a gradient."""
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(*(t for t in inputs if isinstance(t, torch.Tensor)), *output)
    ctx.arguments = [x for x in inputs if not isinstance(x, torch.Tensor)]


def _axial_backward(ctx, grad: torch.Tensor, *_) -> tuple:
    return *_axial_grads_op(grad, *ctx.saved_tensors, *ctx.arguments), None, None, None


def _packed_backward(ctx, grad: torch.Tensor, *_) -> tuple:
    return _packed_grads_op(grad, *ctx.saved_tensors, *ctx.arguments), None, None, None, None


if HAS_TRITON:
    _axial_op = register_triton_op("axial_attn_triton", _axial, _axial_outputs)
    _axial_grads_op = register_triton_op("axial_attn_triton_backward", _axial_grads, _axial_grads_outputs)
    _packed_op = register_triton_op("packed_axial_attn_triton", _packed, _packed_outputs)
    _packed_grads_op = register_triton_op("packed_axial_attn_triton_backward", _packed_grads, _packed_grads_outputs)
    _axial_op.register_autograd(_axial_backward, setup_context=_setup_context)
    _packed_op.register_autograd(_packed_backward, setup_context=_setup_context)


def triton_fits(grid: tuple[int, int], num_prefix_tokens: int, head_dim: int) -> bool:
    """Whether one program holds a row, a column, the prefix tokens and a head: each at most :data:`MAX_LINE`."""
    return max(*grid, num_prefix_tokens, head_dim) <= MAX_LINE


def check_triton_axial(
    op: str, grid: tuple[int, int], num_prefix_tokens: int, head_dim: int, t: torch.Tensor
) -> None:
    """Raises a one-line ValueError where the ``triton`` path cannot take the inputs: its device (see
    :func:`visattn.ops.triton_support.check_triton_runs_on`), its dtype, or a grid side, prefix or head
    longer than :func:`triton_fits` allows."""
    check_triton_runs_on(op, t.device)
    if t.dtype not in DTYPES:
        raise ValueError(f"{op}: the 'triton' backend takes float32, float16 or bfloat16 tensors, got {t.dtype}")
    if not triton_fits(grid, num_prefix_tokens, head_dim):
        sizes = {"grid height": grid[0], "grid width": grid[1], "num_prefix_tokens": num_prefix_tokens}
        sizes["head_dim"] = head_dim
        too_long = ", ".join(f"{name} {size}" for name, size in sizes.items() if size > MAX_LINE)
        raise ValueError(
            f"{op}: the 'triton' backend takes a grid height and width, num_prefix_tokens and head_dim of at "
            f"most {MAX_LINE}; got {too_long}"
        )


def _in_autocast_dtype(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors in autocast's dtype where it is on (as SDPA takes them), else as they are."""
    device = tensors[0].device.type
    if not torch.is_autocast_enabled(device):
        return tensors
    return tuple(t.to(torch.get_autocast_dtype(device)) for t in tensors)


def triton_axial_attn(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: tuple[int, int], num_prefix_tokens: int = 0,
    scale: float | None = None,
) -> torch.Tensor:
    """:func:`visattn.ops.axial_attn` on the Triton kernels (no dropout); the caller has checked the
    shapes (:func:`visattn.ops.checks.check_qkv`, :func:`~visattn.ops.checks.check_grid`).

    Args:
        q, k, v: (B, heads, N, d), any strides: views of the qkv projection are read in place.
        grid: (H, W); num_prefix_tokens: P, N = P + H * W.
        scale: score scale; ``d ** -0.5`` if None.
    Returns:
        (B, heads, N, d), a view of a token-major (B, N, heads, d) tensor.
    """
    check_triton_axial("triton_axial_attn", grid, num_prefix_tokens, q.shape[-1], q)
    q, k, v = _in_autocast_dtype(q, k, v)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _axial_op(q, k, v, grid[0], num_prefix_tokens, scale)[0]


def packed_triton_axial_attn(
    qkv: torch.Tensor, num_heads: int, grid: tuple[int, int], num_prefix_tokens: int = 0, scale: float | None = None
) -> torch.Tensor:
    """:func:`triton_axial_attn` on the qkv projection (B, N, 3 C) itself (timm's layout, any strides)
    -> (B, N, C), heads merged; its gradient comes back as one (B, N, 3 C) tensor."""
    head_dim = qkv.shape[-1] // (3 * num_heads)
    check_triton_axial("packed_triton_axial_attn", grid, num_prefix_tokens, head_dim, qkv)
    (qkv,) = _in_autocast_dtype(qkv)
    scale = head_dim**-0.5 if scale is None else scale
    return _packed_op(qkv, num_heads, grid[0], num_prefix_tokens, scale)[0]
