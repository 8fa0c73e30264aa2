"""The local windows (neighborhood, sparse, longformer) as fused Triton kernels on 2D query tiles.

:func:`triton_local_attn` is :func:`visattn.ops.local.engine.tiled_local_attn` without gathers: q, k and v
are read in place through their strides (views of the qkv projection (B, N, 3 C) as the layers pass them),
the output is written token-major (B, N, heads, d), straight into what the output projection reads, and
each query's window is computed from its grid position (:class:`visattn.ops.local.plans.WindowRule`), so
no table is read and no token is permuted. The passes over N x C activations: the forward reads q, k and
v (k and v of neighbouring query tiles from cache) and writes the output; the backward reads q, k, v, the
output and its gradient, and writes dq, dk and dv. Autograd keeps q, k, v, the output and an fp32
log-sum-exp per query and head.

Kernels (:mod:`visattn.ops.local.triton_kernels`), grid axis 1 = image x head:
    window_forward_kernel  (query tiles, B heads)  patch queries over their windows (+ prefix keys)
    prefix_rows_kernel     (segments, B heads)     prefix queries over a segment of all N keys
    window_dq_kernel       (query tiles, B heads)  dq of the patch queries, delta, prefix keys' shares
    window_dkdv_kernel     (key tiles, B heads)    dk, dv of the patch keys over their inverse windows
A query tile is QH x QW patch queries; it loops over its key region in KH x KW key tiles. The prefix
queries (class and register tokens, which see all N tokens) are the small separate path: their rows split
the keys into segments whose partial softmax states (or dq shares) torch merges in order, and their
P x P block of dk and dv is plain fp32 torch. Every sum has a fixed order (no atomics): the same inputs
give the same bits, once the launch configuration is fixed (:data:`TUNED_CONFIGS` or the process's
autotuning).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from visattn.ops.layout import token_major_empty
from visattn.ops.local.plans import AxisPlan, WindowRule
from visattn.ops.triton_support import AUTOTUNE, HAS_TRITON, INTERPRETED, check_triton_runs_on, register_triton_op

if HAS_TRITON:
    import triton
    from torch.library import wrap_triton

    from visattn.ops.local import triton_kernels as kernels

OP = "triton_local_attn"
LOG2E = 1 / math.log(2)  # the kernels' softmax runs in base 2


class TileConfig(NamedTuple):
    """A launch: query tiles of qh x qw cells and key tiles of kh x kw (the program's own tile and the
    sub-tiles it loops over; dkdv: the program owns the key tile)."""

    qh: int
    qw: int
    kh: int
    kw: int
    num_warps: int = 4
    num_stages: int = 2


# Interpreted: 8 x 8 tiles (the tests' grids span several, with ragged edges on both axes); the interpreter
# pays per operation, so fewer, larger tiles run faster.
INTERPRETED_CONFIGS = {name: TileConfig(8, 8, 8, 8) for name in ("window_forward_kernel", "window_dq_kernel",
                                                                   "window_dkdv_kernel")}
# Autotuned on a GPU, unless TUNED_CONFIGS holds the choice; few candidates, since each compiles for every
# head dim, dtype and window kind. 8 x 8 query tiles meet a 7 x 7 window's 14 x 14 region in four 8 x 8 key
# tiles (or 4 x 16). 128-cell tiles halve the programs but, compiled for sm_90 at head dim 64, take 236 to
# 255 registers a thread and spill in the backward kernels.
AUTOTUNE_CONFIGS = {
    "window_forward_kernel": (
        TileConfig(8, 8, 8, 8, 4, 2), TileConfig(8, 8, 4, 16, 4, 2), TileConfig(8, 16, 8, 16, 8, 2)
    ),
    "window_dq_kernel": (TileConfig(8, 8, 8, 8, 4, 2), TileConfig(8, 8, 8, 8, 8, 2)),
    "window_dkdv_kernel": (TileConfig(8, 8, 8, 8, 4, 2), TileConfig(8, 8, 8, 8, 8, 2)),
}
# (kernel name, BLOCK_D, dtype name) -> the configuration a GPU's autotuning chose (:func:`autotuned_configs`),
# so that no later run spends time autotuning. Filled in from GPU runs.
TUNED_CONFIGS: dict[tuple[str, int, str], TileConfig] = {}
AUTOTUNE_KEY = ["DIM", "DIM_V", "row_a", "row_c", "col_a", "col_c", "ROW_BLOCK", "COL_BLOCK", "BLOCK_P"]
# The prefix rows' keys per program (a multiple of PREFIX_BLOCK_N) and per inner step; prefix tokens per
# tile (as queries of the prefix rows and of dk, dv; as keys of the patch queries).
PREFIX_SEGMENT, PREFIX_BLOCK_N = (64, 32) if INTERPRETED else (1024, 64)
MAX_BLOCK_P = 64
MAX_IMAGE_HEADS = 65535  # images x heads run on a launch grid's second (or third) axis

if HAS_TRITON and not INTERPRETED:
    _AUTOTUNED = {
        name: triton.autotune(
            [
                triton.Config({"QH": c.qh, "QW": c.qw, "KH": c.kh, "KW": c.kw}, num_warps=c.num_warps,
                              num_stages=c.num_stages)
                for c in AUTOTUNE_CONFIGS[name]
            ],
            key=AUTOTUNE_KEY,
            # the dq kernel's shares of the prefix keys' gradients are summed over the largest tile count
            reset_to_zero=["dk_part_ptr", "dv_part_ptr"] if name == "window_dq_kernel" else None,
        )(getattr(kernels, name))
        for name in AUTOTUNE_CONFIGS
    }


def _launch(name: str, block_d: int, dtype: torch.dtype):
    """The kernel ``name``, its launch keywords and the configurations it may run with: the fixed one when
    interpreted, the table's entry if any, else the autotuned kernel's candidates (it picks one itself), or the
    first of them where autotuning is off (:mod:`visattn.ops.triton_support`)."""
    config = INTERPRETED_CONFIGS[name] if INTERPRETED else TUNED_CONFIGS.get((name, block_d, _dtype_name(dtype)))
    if config is None and not AUTOTUNE:  # the first candidate (triton_support says when)
        config = AUTOTUNE_CONFIGS[name][0]
    if config is None:
        return wrap_triton(_AUTOTUNED[name]), {}, AUTOTUNE_CONFIGS[name]
    if min(config.qh * config.qw, config.kh * config.kw) < 16:
        raise ValueError(f"{OP}: {name}'s tiles {config} need at least 16 cells each (tl.dot)")
    launch = {"QH": config.qh, "QW": config.qw, "KH": config.kh, "KW": config.kw, "num_warps": config.num_warps,
              "num_stages": config.num_stages}
    return wrap_triton(getattr(kernels, name)), launch, (config,)


def autotuned_configs() -> dict[tuple[str, int, str], TileConfig]:
    """What this process's autotuning chose, as :data:`TUNED_CONFIGS` entries (to print after a GPU run). The
    autotuning's key also holds the window, the table's does not: where several windows were tuned, an entry
    keeps the first one's choice (scripts/time_kernels.py tunes neighborhood's 7 x 7 first)."""
    chosen = {}
    for name, tuner in (_AUTOTUNED.items() if HAS_TRITON and not INTERPRETED else ()):
        for key, config in tuner.cache.items():
            dtype = next(k for k in key if isinstance(k, str) and k.startswith("torch."))
            tiles = (config.kwargs[field] for field in ("QH", "QW", "KH", "KW"))
            entry = TileConfig(*tiles, config.num_warps, config.num_stages)
            chosen.setdefault((name, _block_d(key[0]), dtype.removeprefix("torch.")), entry)
    return chosen


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _block_d(d: int) -> int:
    return max(16, triton.next_power_of_2(d))


def _precision(dtype: torch.dtype) -> str:
    """tl.dot's operand precision: TF32 for 16-bit inputs (which it represents exactly) and where torch
    allows TF32 for fp32 matmuls; else full fp32."""
    tf32 = dtype != torch.float32 or torch.get_float32_matmul_precision() != "highest"
    return "tf32" if tf32 else "ieee"


def _axis_args(rule: WindowRule) -> list[int]:
    """[a, c, BLOCK] of :func:`visattn.ops.local.triton_kernels._window` for one axis."""
    if rule.kind == "neighborhood":
        return [rule.size // 2, rule.size, 0]
    if rule.kind == "blocked":
        return [rule.halo, 0, rule.size]
    raise ValueError(f"{OP}: the kernels compute 'neighborhood' and 'blocked' windows, got {rule.kind!r}")


def _window_args(q, k, v, grid, row_window, col_window, num_prefix_tokens, scale):
    """The arguments the window kernels share after their pointers and strides, and their constexprs."""
    heads, n, d, d_v = q.shape[1], q.shape[2], q.shape[3], v.shape[3]
    (row_a, row_c, row_block), (col_a, col_c, col_block) = row_window, col_window
    common = (heads, n, *grid, num_prefix_tokens, row_a, row_c, col_a, col_c, scale * LOG2E)
    flags = {"DIM": d, "DIM_V": d_v, "BLOCK_D": _block_d(d), "BLOCK_DV": _block_d(d_v), "ROW_BLOCK": row_block,
             "COL_BLOCK": col_block, "BLOCK_P": min(_block_d(num_prefix_tokens), MAX_BLOCK_P),
             "UPCAST": INTERPRETED, "PRECISION": _precision(q.dtype)}
    return common, flags


def _forward_outputs(q: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The output (B, heads, N, d_v) laid out (B, N, heads, d_v), and the log-sum-exp (B, heads, N) fp32."""
    b, heads, n, _ = q.shape
    return token_major_empty(b, heads, n, v.shape[-1], v), q.new_empty(b, heads, n, dtype=torch.float32)


def _forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: list[int], row_window: list[int],
    col_window: list[int], num_prefix_tokens: int, prefix_visible: bool, scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse): the patch queries' query tiles, then the prefix rows."""
    out, lse = _forward_outputs(q, v)
    b, heads = q.shape[:2]
    h, w = grid
    common, flags = _window_args(q, k, v, grid, row_window, col_window, num_prefix_tokens, scale)
    kernel, launch, _ = _launch("window_forward_kernel", flags["BLOCK_D"], q.dtype)
    kernel[lambda meta: (triton.cdiv(h, meta["QH"]) * triton.cdiv(w, meta["QW"]), b * heads)](
        q, k, v, out, lse, *q.stride(), *k.stride(), *v.stride(), *out.stride(), *common,
        PREFIX_VISIBLE=prefix_visible and num_prefix_tokens > 0, **flags, **launch,
    )
    if num_prefix_tokens:
        _prefix_forward(q, k, v, out, lse, num_prefix_tokens, scale, flags)
    return out, lse


def _prefix_launch(q, k, v, grad, lse, delta, parts, num_prefix_tokens, scale, flags, backward: bool) -> None:
    b, heads, n, _ = q.shape
    shared = {key: flags[key] for key in ("DIM", "DIM_V", "BLOCK_D", "BLOCK_DV", "BLOCK_P", "UPCAST", "PRECISION")}
    programs = (triton.cdiv(n, PREFIX_SEGMENT), triton.cdiv(num_prefix_tokens, flags["BLOCK_P"]), b * heads)
    wrap_triton(kernels.prefix_rows_kernel)[programs](
        q, k, v, grad, lse, delta, *parts, *q.stride(), *k.stride(), *v.stride(), *grad.stride(), heads, n,
        num_prefix_tokens, scale * LOG2E, BLOCK_N=PREFIX_BLOCK_N, SEGMENT=PREFIX_SEGMENT, BACKWARD=backward,
        **shared,
    )


def _prefix_forward(q, k, v, out, lse, num_prefix_tokens, scale, flags) -> None:
    """The prefix rows of ``out`` and ``lse``: each segment's softmax state, merged in segment order."""
    b, heads, n, _ = q.shape
    p, d_v = num_prefix_tokens, v.shape[-1]
    segments = triton.cdiv(n, PREFIX_SEGMENT)
    acc = q.new_empty(b * heads, segments, p, flags["BLOCK_DV"], dtype=torch.float32)
    top, total = (q.new_empty(b * heads, segments, p, dtype=torch.float32) for _ in range(2))
    _prefix_launch(q, k, v, q, lse, lse, (acc, top, total), p, scale, flags, backward=False)
    best = top.amax(1, keepdim=True)  # base 2
    weight = torch.exp2(top - best)
    total = (total * weight).sum(1)
    rows = (acc[..., :d_v] * weight[..., None]).sum(1) / total[..., None]  # (B heads, P, d_v)
    out[:, :, :p] = rows.view(b, heads, p, d_v).to(out.dtype)
    lse[:, :, :p] = ((best.squeeze(1) + torch.log2(total)) * math.log(2)).view(b, heads, p)


def _backward_outputs(q: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk (B, heads, N, d) and dv (B, heads, N, d_v), each laid out (B, N, heads, .)."""
    b, heads, n, d = q.shape
    return (token_major_empty(b, heads, n, d, q), token_major_empty(b, heads, n, d, q),
            token_major_empty(b, heads, n, v.shape[-1], v))


def _backward(
    grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    grid: list[int], row_window: list[int], col_window: list[int], num_prefix_tokens: int, prefix_visible: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv): the patch queries' dq (and delta), the prefix rows' dq, then dk and dv of the patch keys
    and of the prefix keys."""
    dq, dk, dv = _backward_outputs(q, v)
    b, heads, n, _ = q.shape
    h, w = grid
    p = num_prefix_tokens
    visible = prefix_visible and p > 0
    common, flags = _window_args(q, k, v, grid, row_window, col_window, p, scale)
    delta = torch.empty_like(lse)
    if p:
        delta[:, :, :p] = (grad[:, :, :p].float() * out[:, :, :p].float()).sum(-1)
    kernel, launch, configs = _launch("window_dq_kernel", flags["BLOCK_D"], q.dtype)
    part_tiles = max(triton.cdiv(h, c.qh) * triton.cdiv(w, c.qw) for c in configs) if visible else 0
    dk_part, dv_part = lse, lse  # never read without visible prefix keys
    if visible:
        dk_part = q.new_zeros(b * heads, part_tiles, p, flags["BLOCK_D"], dtype=torch.float32)
        dv_part = q.new_zeros(b * heads, part_tiles, p, flags["BLOCK_DV"], dtype=torch.float32)
    kernel[lambda meta: (triton.cdiv(h, meta["QH"]) * triton.cdiv(w, meta["QW"]), b * heads)](
        q, k, v, out, grad, lse, delta, dq, dk_part, dv_part, *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        *grad.stride(), *dq.stride(), *common, scale, part_tiles, PREFIX_VISIBLE=visible, **flags, **launch,
    )
    if p:
        dq_part = q.new_empty(b * heads, triton.cdiv(n, PREFIX_SEGMENT), p, flags["BLOCK_D"], dtype=torch.float32)
        _prefix_launch(q, k, v, grad, lse, delta, (dq_part, lse, lse), p, scale, flags, backward=True)
        dq[:, :, :p] = (dq_part.sum(1)[..., : q.shape[-1]] * scale).view(b, heads, p, -1).to(dq.dtype)
    kernel, launch, _ = _launch("window_dkdv_kernel", flags["BLOCK_D"], q.dtype)
    kernel[lambda meta: (triton.cdiv(h, meta["KH"]) * triton.cdiv(w, meta["KW"]), b * heads)](
        q, k, v, grad, lse, delta, dk, dv, *q.stride(), *k.stride(), *v.stride(), *grad.stride(), *dk.stride(),
        *dv.stride(), *common, scale, **flags, **launch,
    )
    if p:
        _prefix_key_grads(grad, q, k, v, lse, delta, dk, dv, (dk_part, dv_part) if visible else None, p, scale)
    return dq, dk, dv


def _prefix_key_grads(grad, q, k, v, lse, delta, dk, dv, parts, num_prefix_tokens, scale) -> None:
    """The prefix keys' rows of dk and dv: the prefix queries' P x P block in fp32, plus the patch queries'
    shares from the dq kernel's tiles (``parts``; None where the patches do not see the prefix keys),
    summed in order."""
    b, heads, _, d = q.shape
    p, d_v = num_prefix_tokens, v.shape[-1]
    qp, kp, vp, gp = (t[:, :, :p].float() for t in (q, k, v, grad))
    weights = torch.exp(qp @ kp.transpose(-1, -2) * scale - lse[:, :, :p, None])  # (B, heads, P queries, P keys)
    dscores = weights * (gp @ vp.transpose(-1, -2) - delta[:, :, :p, None])
    dk_p, dv_p = dscores.transpose(-1, -2) @ qp * scale, weights.transpose(-1, -2) @ gp
    if parts is not None:
        dk_p = dk_p + parts[0].sum(1)[..., :d].view(b, heads, p, d)
        dv_p = dv_p + parts[1].sum(1)[..., :d_v].view(b, heads, p, d_v)
    dk[:, :, :p], dv[:, :, :p] = dk_p.to(dk.dtype), dv_p.to(dv.dtype)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, *arguments = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.mark_non_differentiable(lse)
    ctx.arguments = arguments


def _autograd_backward(ctx, grad_out, _grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = _backward_op(grad_out, q, k, v, out, lse, *ctx.arguments)
    return dq, dk, dv, None, None, None, None, None, None


if HAS_TRITON:
    _forward_op = register_triton_op("local_window_attn", _forward, lambda q, k, v, *_: _forward_outputs(q, v))
    _backward_op = register_triton_op(
        "local_window_attn_backward", _backward, lambda grad, q, k, v, *_: _backward_outputs(q, v)
    )
    _forward_op.register_autograd(_autograd_backward, setup_context=_setup_context)


def triton_local_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rows: AxisPlan,
    cols: AxisPlan,
    num_prefix_tokens: int = 0,
    prefix_visible: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """:func:`visattn.ops.local.engine.tiled_local_attn` as fused Triton kernels (CUDA, or CPU interpreted):
    each patch query attends to its window (rows x cols), plus every prefix key if ``prefix_visible``; each
    prefix query to all N tokens. No dropout.

    Args:
        q, k, v: (B, heads, N, d) (v: d_v), N = num_prefix_tokens + H * W, prefix tokens first, patches in
            raster order; fp32, fp16 or bf16, any strides (views of the qkv projection are read in place).
        rows, cols: the window plan of each axis; only its length and :class:`WindowRule` are read.
    Returns:
        (B, heads, N, d_v), a view of a token-major (B, N, heads, d_v) tensor.
    """
    check_triton_runs_on(OP, q.device)
    if q.shape[0] * q.shape[1] > MAX_IMAGE_HEADS:
        raise ValueError(
            f"{OP}: batch x heads must be at most {MAX_IMAGE_HEADS:,} (a CUDA launch grid's second axis), got "
            f"{q.shape[0]} x {q.shape[1]}; split the batch or use backend 'flex'"
        )
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    grid = [rows.length, cols.length]
    out, _ = _forward_op(
        q, k, v, grid, _axis_args(rows.rule), _axis_args(cols.rule), num_prefix_tokens, prefix_visible, scale
    )
    return out
