"""The Triton kernels of non-causal linear attention (:mod:`visattn.ops.linear.triton` launches them).

Every kernel reads q, k and v in place from timm's qkv projection (B, N, 3 C), the q columns, then k,
then v, heads of d = C / heads, at any strides; one program handles one image and one head (the grid's
first axis, ``b * heads + h``) and a run of tokens (the second axis). Values are upcast to fp32 right
after each load and every sum over tokens is taken in fp32. A head is padded to ``BLOCK_D`` columns (a
power of two, at least 16, the smallest ``tl.dot`` operand), the padding masked to zero.

The kernels that sum over tokens (:func:`state_kernel`, :func:`grad_query_kernel`,
:func:`grad_key_value_kernel`) write one partial sum per segment of ``SEGMENT`` tokens, and
:func:`sum_partials_kernel` adds the segments in order: no atomics, so the result is the same bit for bit
from run to run.

The state is [S | z] (B, heads, d, d + 1) fp32: S = sum_j (R_j phi(k_j))^T v_j and z = sum_j phi(k_j)
(R the rope turn, the identity without a table). The optional locality term is a depthwise K x K
convolution of v over the patch grid (tokens ``P ..`` in raster order), added to the patch tokens'
outputs; the prefix tokens get none.
"""
from __future__ import annotations

import triton
import triton.language as tl

ELU, RELU = tl.constexpr(0), tl.constexpr(1)  # the FEATURE_MAP constant of the kernels


@triton.jit
def _feature_map(x, FEATURE_MAP: tl.constexpr):
    if FEATURE_MAP == ELU:
        return tl.exp(tl.minimum(x, 0.0)) + tl.maximum(x, 0.0)  # elu(x) + 1, no exp of a large x
    else:
        return tl.maximum(x, 0.0)


@triton.jit
def _feature_map_derivative(phi, FEATURE_MAP: tl.constexpr):
    """phi'(x) from phi(x): exp(x) = phi for x < 0 and 1 above (elu + 1); 1 where positive (relu)."""
    if FEATURE_MAP == ELU:
        return tl.minimum(phi, 1.0)
    else:
        return tl.where(phi > 0.0, 1.0, 0.0)


@triton.jit
def _load_block(ptr, tokens, cols, stride_n, stride_c, mask):
    """The (tokens, cols) block of the (N, .) matrix at ``ptr``, fp32, zero where masked."""
    return tl.load(ptr + tokens[:, None] * stride_n + cols[None, :] * stride_c, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _rope_rows(rope_ptr, tokens, cols, d, stride_rn, stride_rc, mask):
    """(sin, cos) of the tokens' angles, one per column (timm's interleaved [sin | cos] table rows)."""
    at = rope_ptr + tokens[:, None] * stride_rn + cols[None, :] * stride_rc
    sin = tl.load(at, mask=mask, other=0.0).to(tl.float32)
    cos = tl.load(at + d * stride_rc, mask=mask, other=0.0).to(tl.float32)
    return sin, cos


@triton.jit
def _pair_sign(cols):
    """The sign of the partner column (c ^ 1) in a turn: x' = x cos + sign x_partner sin."""
    return tl.where(cols % 2 == 0, -1.0, 1.0)[None, :]


@triton.jit
def _features(ptr, tokens, cols, d, stride_n, stride_c, mask, rope_ptr, stride_rn, stride_rc,
              FEATURE_MAP: tl.constexpr, ROPE: tl.constexpr):
    """(phi(x), R phi(x)) of a block, zero where masked; the turned features come from the partner columns
    c ^ 1, loaded a second time (the same cache lines)."""
    phi = tl.where(mask, _feature_map(_load_block(ptr, tokens, cols, stride_n, stride_c, mask), FEATURE_MAP), 0.0)
    if ROPE:
        partner = _load_block(ptr, tokens, cols ^ 1, stride_n, stride_c, mask)
        partner = tl.where(mask, _feature_map(partner, FEATURE_MAP), 0.0)
        sin, cos = _rope_rows(rope_ptr, tokens, cols, d, stride_rn, stride_rc, mask)
        return phi, phi * cos + _pair_sign(cols) * partner * sin
    else:
        return phi, phi


@triton.jit
def _turn_back(y, y_partner, rope_ptr, tokens, cols, d, stride_rn, stride_rc, mask):
    """R^T y per token (the opposite turn), from y and its partner columns y[:, c ^ 1]."""
    sin, cos = _rope_rows(rope_ptr, tokens, cols, d, stride_rn, stride_rc, mask)
    return y * cos - _pair_sign(cols) * y_partner * sin


@triton.jit
def _load_state(state_ptr, rows, cols, d, mask, ROPE: tl.constexpr):
    """S (BLOCK_D, BLOCK_D), z (BLOCK_D,) of a (d, d + 1) [S | z] matrix, and S with rows r ^ 1 (for the
    turned-back products; S itself without rope)."""
    s = tl.load(state_ptr + rows[:, None] * (d + 1) + cols[None, :], mask=mask, other=0.0)
    z = tl.load(state_ptr + cols * (d + 1) + d, mask=cols < d, other=0.0)
    if ROPE:
        s_partner = tl.load(state_ptr + (rows[:, None] ^ 1) * (d + 1) + cols[None, :], mask=mask, other=0.0)
    else:
        s_partner = s
    return s, z, s_partner


@triton.jit
def _store_state(state_ptr, s, z, rows, cols, d, mask):
    tl.store(state_ptr + rows[:, None] * (d + 1) + cols[None, :], s, mask=mask)
    tl.store(state_ptr + cols * (d + 1) + d, z, mask=cols < d)


@triton.jit
def _grid_position(tokens, n, num_prefix, grid_w):
    """(row, column, is a patch) of each token on the grid (row and column 0 for the others)."""
    is_patch = (tokens >= num_prefix) & (tokens < n)
    patch = tl.where(is_patch, tokens - num_prefix, 0)
    return patch // grid_w, patch % grid_w, is_patch


@triton.jit
def state_kernel(
    qkv_ptr, rope_ptr, partial_ptr,
    N, C, d, H, stride_b, stride_n, stride_c, stride_rh, stride_rn, stride_rc,
    FEATURE_MAP: tl.constexpr, ROPE: tl.constexpr, PRECISION: tl.constexpr,
    SEGMENT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Partial [S | z] of each segment of tokens: partials (B, heads, segments, d, d + 1)."""
    bh, segment = tl.program_id(0), tl.program_id(1)
    b, h = (bh // H).to(tl.int64), bh % H
    k_ptr = qkv_ptr + b * stride_b + (C + h * d) * stride_c
    v_ptr = k_ptr + C * stride_c
    rope_ptr += h * stride_rh
    cols = tl.arange(0, BLOCK_D)
    s = tl.zeros((BLOCK_D, BLOCK_D), dtype=tl.float32)
    z = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for start in range(0, tl.minimum(SEGMENT, N - segment * SEGMENT), BLOCK_N):
        tokens = segment * SEGMENT + start + tl.arange(0, BLOCK_N)
        mask = (tokens < N)[:, None] & (cols < d)[None, :]
        tokens = tokens.to(tl.int64)
        phi, turned = _features(k_ptr, tokens, cols, d, stride_n, stride_c, mask, rope_ptr, stride_rn, stride_rc,
                                FEATURE_MAP, ROPE)
        v = _load_block(v_ptr, tokens, cols, stride_n, stride_c, mask)
        s += tl.dot(tl.trans(turned), v, input_precision=PRECISION)
        z += tl.sum(phi, axis=0)
    square = (cols < d)[:, None] & (cols < d)[None, :]
    partial = partial_ptr + (bh.to(tl.int64) * tl.num_programs(1) + segment) * d * (d + 1)
    _store_state(partial, s, z, cols, cols, d, square)


@triton.jit
def sum_partials_kernel(partial_ptr, out_ptr, R, L, BLOCK_L: tl.constexpr):
    """out (M, L) = the sum over r = 0, 1, .., R - 1 in that order of partials (M, R, L), fp32."""
    m, block = tl.program_id(0).to(tl.int64), tl.program_id(1)
    offs = block * BLOCK_L + tl.arange(0, BLOCK_L)
    mask = offs < L
    acc = tl.zeros((BLOCK_L,), dtype=tl.float32)
    for r in range(0, R):
        acc += tl.load(partial_ptr + (m * R + r) * L + offs, mask=mask, other=0.0)
    tl.store(out_ptr + m * L + offs, acc, mask=mask)


@triton.jit
def output_kernel(
    qkv_ptr, state_ptr, rope_ptr, weight_ptr, bias_ptr, out_ptr,
    N, C, d, H, eps, stride_b, stride_n, stride_c, stride_rh, stride_rn, stride_rc,
    stride_ob, stride_on, stride_oc, stride_wc, stride_wi, stride_wj,
    num_prefix, grid_h, grid_w,
    FEATURE_MAP: tl.constexpr, ROPE: tl.constexpr, KERNEL: tl.constexpr, HAS_BIAS: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """out (B, N, C) = R phi(q) S / max(phi(q) z, eps), plus the K x K depthwise convolution of v over the
    grid (KERNEL > 0) on the patch tokens, each tap a shifted block of v (neighbouring rows in cache)."""
    bh, block = tl.program_id(0), tl.program_id(1)
    b, h = (bh // H).to(tl.int64), bh % H
    q_ptr = qkv_ptr + b * stride_b + h * d * stride_c
    rope_ptr += h * stride_rh
    cols = tl.arange(0, BLOCK_D)
    tokens = block * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (tokens < N)[:, None] & (cols < d)[None, :]
    tokens = tokens.to(tl.int64)
    square = (cols < d)[:, None] & (cols < d)[None, :]
    s, z, _ = _load_state(state_ptr + bh.to(tl.int64) * d * (d + 1), cols, cols, d, square, False)
    phi, turned = _features(q_ptr, tokens, cols, d, stride_n, stride_c, mask, rope_ptr, stride_rn, stride_rc,
                            FEATURE_MAP, ROPE)
    num = tl.dot(turned, s, input_precision=PRECISION)
    den = tl.sum(phi * z[None, :], axis=1)
    out = num / tl.maximum(den, eps)[:, None]
    if KERNEL > 0:
        v_at = q_ptr + 2 * C * stride_c + tokens[:, None] * stride_n + cols[None, :] * stride_c
        channel = weight_ptr + (h * d + cols) * stride_wc
        row, col, is_patch = _grid_position(tokens, N, num_prefix, grid_w)
        for tap in range(KERNEL * KERNEL):  # a loop, not unrolled: one shifted block in registers at a time
            # tap (i, j) reads the token (i - K // 2) rows and (j - K // 2) columns away
            di, dj = tap // KERNEL - KERNEL // 2, tap % KERNEL - KERNEL // 2
            inside = is_patch & (row + di >= 0) & (row + di < grid_h) & (col + dj >= 0) & (col + dj < grid_w)
            shifted = tl.load(v_at + (di * grid_w + dj) * stride_n, mask=inside[:, None] & (cols < d)[None, :],
                              other=0.0).to(tl.float32)
            weight = tl.load(channel + (di + KERNEL // 2) * stride_wi + (dj + KERNEL // 2) * stride_wj, mask=cols < d,
                             other=0.0).to(tl.float32)
            out += shifted * weight[None, :]
        if HAS_BIAS:
            bias = tl.load(bias_ptr + h * d + cols, mask=cols < d, other=0.0).to(tl.float32)
            out += tl.where((tokens >= num_prefix)[:, None], bias[None, :], 0.0)
    at = out_ptr + b * stride_ob + tokens[:, None] * stride_on + (h * d + cols[None, :]) * stride_oc
    tl.store(at, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def grad_query_kernel(
    qkv_ptr, state_ptr, rope_ptr, grad_out_ptr, grad_qkv_ptr, partial_ptr,
    N, C, d, H, eps, stride_b, stride_n, stride_c, stride_rh, stride_rn, stride_rc,
    stride_gb, stride_gn, stride_gc, stride_db, stride_dn, stride_dc,
    FEATURE_MAP: tl.constexpr, ROPE: tl.constexpr, PRECISION: tl.constexpr,
    SEGMENT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """dq, and the segment's partial d[S | z] (B, heads, segments, d, d + 1).

    With [num, den] = phi(q) [S, z] (num from R phi(q)), out = num / max(den, eps) and the output gradient g:
    g_num = g / max(den, eps), g_den = -(g_num . num) / max(den, eps) where the clamp passes (0 elsewhere);
    dphi(q) = R^T (g_num S^T) + g_den z^T, dS = (R phi(q))^T g_num, dz = phi(q)^T g_den.
    """
    bh, segment = tl.program_id(0), tl.program_id(1)
    b, h = (bh // H).to(tl.int64), bh % H
    q_ptr = qkv_ptr + b * stride_b + h * d * stride_c
    g_ptr = grad_out_ptr + b * stride_gb + h * d * stride_gc
    dq_ptr = grad_qkv_ptr + b * stride_db + h * d * stride_dc
    rope_ptr += h * stride_rh
    cols = tl.arange(0, BLOCK_D)
    square = (cols < d)[:, None] & (cols < d)[None, :]
    s, z, s_partner = _load_state(state_ptr + bh.to(tl.int64) * d * (d + 1), cols, cols, d, square, ROPE)
    grad_s = tl.zeros((BLOCK_D, BLOCK_D), dtype=tl.float32)
    grad_z = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for start in range(0, tl.minimum(SEGMENT, N - segment * SEGMENT), BLOCK_N):
        tokens = segment * SEGMENT + start + tl.arange(0, BLOCK_N)
        mask = (tokens < N)[:, None] & (cols < d)[None, :]
        tokens = tokens.to(tl.int64)
        phi, turned = _features(q_ptr, tokens, cols, d, stride_n, stride_c, mask, rope_ptr, stride_rn, stride_rc,
                                FEATURE_MAP, ROPE)
        g = _load_block(g_ptr, tokens, cols, stride_gn, stride_gc, mask)
        num = tl.dot(turned, s, input_precision=PRECISION)
        den = tl.sum(phi * z[None, :], axis=1)
        clamped = tl.maximum(den, eps)
        g_num = g / clamped[:, None]
        g_den = tl.where(den >= eps, -tl.sum(g_num * num, axis=1) / clamped, 0.0)
        grad_phi = tl.dot(g_num, tl.trans(s), input_precision=PRECISION)
        if ROPE:
            partner = tl.dot(g_num, tl.trans(s_partner), input_precision=PRECISION)
            grad_phi = _turn_back(grad_phi, partner, rope_ptr, tokens, cols, d, stride_rn, stride_rc, mask)
        grad_phi += g_den[:, None] * z[None, :]
        dq = grad_phi * _feature_map_derivative(phi, FEATURE_MAP)
        tl.store(dq_ptr + tokens[:, None] * stride_dn + cols[None, :] * stride_dc,
                 dq.to(grad_qkv_ptr.dtype.element_ty), mask=mask)
        grad_s += tl.dot(tl.trans(turned), g_num, input_precision=PRECISION)
        grad_z += tl.sum(phi * g_den[:, None], axis=0)
    partial = partial_ptr + (bh.to(tl.int64) * tl.num_programs(1) + segment) * d * (d + 1)
    _store_state(partial, grad_s, grad_z, cols, cols, d, square)


@triton.jit  # kept whole past 60 lines: a kernel reads as one program
def grad_key_value_kernel(
    qkv_ptr, grad_state_ptr, rope_ptr, weight_ptr, grad_out_ptr, grad_qkv_ptr, conv_partial_ptr,
    N, C, d, H, stride_b, stride_n, stride_c, stride_rh, stride_rn, stride_rc,
    stride_gb, stride_gn, stride_gc, stride_db, stride_dn, stride_dc, stride_wc, stride_wi, stride_wj,
    num_prefix, grid_h, grid_w,
    FEATURE_MAP: tl.constexpr, ROPE: tl.constexpr, KERNEL: tl.constexpr, PRECISION: tl.constexpr,
    SEGMENT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_TAPS: tl.constexpr,
):
    """dk = phi'(k) (R^T (v dS^T) + dz), dv = (R phi(k)) dS, with d[S | z] reduced; with the convolution
    (KERNEL > 0), dv gains the transposed convolution of the output gradient, and the segment's partial
    weight and bias gradients go to conv_partials (B, segments, C, K * K + 1): each tap's sum of v times the
    output gradient of the token it reaches, and the sum of the patch tokens' output gradients."""
    bh, segment = tl.program_id(0), tl.program_id(1)
    b, h = (bh // H).to(tl.int64), bh % H
    k_ptr = qkv_ptr + b * stride_b + (C + h * d) * stride_c
    v_ptr = k_ptr + C * stride_c
    dk_ptr = grad_qkv_ptr + b * stride_db + (C + h * d) * stride_dc
    dv_ptr = dk_ptr + C * stride_dc
    g_ptr = grad_out_ptr + b * stride_gb + h * d * stride_gc
    rope_ptr += h * stride_rh
    cols = tl.arange(0, BLOCK_D)
    square = (cols < d)[:, None] & (cols < d)[None, :]
    grad_state_ptr += bh.to(tl.int64) * d * (d + 1)
    grad_s, grad_z, grad_s_partner = _load_state(grad_state_ptr, cols, cols, d, square, ROPE)
    taps = tl.arange(0, BLOCK_TAPS)
    grad_weight = tl.zeros((BLOCK_TAPS, BLOCK_D), dtype=tl.float32)
    grad_bias = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for start in range(0, tl.minimum(SEGMENT, N - segment * SEGMENT), BLOCK_N):
        tokens = segment * SEGMENT + start + tl.arange(0, BLOCK_N)
        mask = (tokens < N)[:, None] & (cols < d)[None, :]
        tokens = tokens.to(tl.int64)
        phi, turned = _features(k_ptr, tokens, cols, d, stride_n, stride_c, mask, rope_ptr, stride_rn, stride_rc,
                                FEATURE_MAP, ROPE)
        v = _load_block(v_ptr, tokens, cols, stride_n, stride_c, mask)
        dv = tl.dot(turned, grad_s, input_precision=PRECISION)
        grad_phi = tl.dot(v, tl.trans(grad_s), input_precision=PRECISION)
        if ROPE:
            partner = tl.dot(v, tl.trans(grad_s_partner), input_precision=PRECISION)
            grad_phi = _turn_back(grad_phi, partner, rope_ptr, tokens, cols, d, stride_rn, stride_rc, mask)
        dk = (grad_phi + grad_z[None, :]) * _feature_map_derivative(phi, FEATURE_MAP)
        if KERNEL > 0:
            g_at = g_ptr + tokens[:, None] * stride_gn + cols[None, :] * stride_gc
            channel = weight_ptr + (h * d + cols) * stride_wc
            row, col, is_patch = _grid_position(tokens, N, num_prefix, grid_w)
            for tap in range(KERNEL * KERNEL):  # a loop, not unrolled: one shifted block in registers at a time
                # the patch whose tap (i, j) reads this token: (K // 2 - i) rows and (K // 2 - j) columns away
                di, dj = KERNEL // 2 - tap // KERNEL, KERNEL // 2 - tap % KERNEL
                inside = is_patch & (row + di >= 0) & (row + di < grid_h) & (col + dj >= 0) & (col + dj < grid_w)
                g = tl.load(g_at + (di * grid_w + dj) * stride_gn, mask=inside[:, None] & (cols < d)[None, :],
                            other=0.0).to(tl.float32)
                weight = tl.load(channel + (KERNEL // 2 - di) * stride_wi + (KERNEL // 2 - dj) * stride_wj,
                                 mask=cols < d, other=0.0).to(tl.float32)
                dv += g * weight[None, :]
                grad_weight += tl.where(taps[:, None] == tap, tl.sum(v * g, axis=0)[None, :], 0.0)
                # the centre tap reads each patch token's own gradient
                grad_bias += tl.where(tap == KERNEL * KERNEL // 2, tl.sum(g, axis=0), 0.0)
        at = tokens[:, None] * stride_dn + cols[None, :] * stride_dc
        tl.store(dk_ptr + at, dk.to(grad_qkv_ptr.dtype.element_ty), mask=mask)
        tl.store(dv_ptr + at, dv.to(grad_qkv_ptr.dtype.element_ty), mask=mask)
    if KERNEL > 0:
        width = KERNEL * KERNEL + 1
        partial = conv_partial_ptr + ((b * tl.num_programs(1) + segment) * C + h * d) * width
        tap_mask = (taps < KERNEL * KERNEL)[:, None] & (cols < d)[None, :]
        tl.store(partial + cols[None, :] * width + taps[:, None], grad_weight, mask=tap_mask)
        tl.store(partial + cols * width + KERNEL * KERNEL, grad_bias, mask=cols < d)
