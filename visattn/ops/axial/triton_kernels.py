"""The Triton kernels of axial attention (:mod:`visattn.ops.axial.triton` launches them).

Every kernel takes q, k, v and its outputs (B, heads, N, d) at any strides, so that the launcher passes
views of the qkv projection, read in place, and token-major outputs. One program of
:func:`line_forward_kernel` or :func:`line_backward_kernel` owns one line (a row in the row hop, a column
in the column hop) of one image and head (the grid's axes: ``b * heads + h``, then the line): it loads the
line's keys and values (at most 256 tokens) and the prefix keys and values as two tiles, then walks the
line's queries in blocks of ``BLOCK_Q``; the softmax over [prefix keys, line keys] is exact in one step
(both tiles are whole), with fp32 sums and a base-2 log-sum-exp kept for the backward.
:func:`prefix_forward_kernel` and :func:`prefix_backward_kernel`, one program per image and head, finish
the prefix tokens from the lines' partials, summed in a fixed order.

Tiles are upcast to fp32 right after each load, or with LOW_PRECISION (fp16/bf16 on a GPU) kept in their
dtype for ``tl.dot``; a line, the prefix tokens and a head are padded to ``BLOCK_L``, ``BLOCK_P`` and
``BLOCK_D`` (powers of two, at least 16, the smallest ``tl.dot`` operand), the padding masked. No atomics:
every value is written by one program, so the result is deterministic.
"""
from __future__ import annotations

from visattn.ops.triton_support import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _load(ptr, tokens, mask_t, offs_d, mask_d, s_n, s_d, LOW_PRECISION: tl.constexpr = False):
        """The (tokens, BLOCK_D) tile of a (N, d) slice, zero where masked: in fp32, or with
        LOW_PRECISION in its own dtype (fp16/bf16 on a GPU: a tile that only enters tl.dot takes half
        the registers)."""
        ptrs = ptr + tokens[:, None] * s_n + offs_d[None, :] * s_d
        tile = tl.load(ptrs, mask=mask_t[:, None] & mask_d[None, :], other=0.0)
        if not LOW_PRECISION:
            tile = tile.to(tl.float32)
        return tile

    @triton.jit
    def _store(ptr, tile, tokens, mask_t, offs_d, mask_d, s_n, s_d):
        ptrs = ptr + tokens[:, None] * s_n + offs_d[None, :] * s_d
        tl.store(ptrs, tile.to(ptr.dtype.element_ty), mask=mask_t[:, None] & mask_d[None, :])

    @triton.jit
    def _mm(a, b, like_ptr, LOW_PRECISION: tl.constexpr):
        """a @ b summed in fp32; with LOW_PRECISION (fp16/bf16 inputs on a GPU) the operands in the
        inputs' dtype, as the tensor cores take them; else in fp32 at full precision."""
        if LOW_PRECISION:
            result = tl.dot(a.to(like_ptr.dtype.element_ty), b.to(like_ptr.dtype.element_ty))
        else:
            result = tl.dot(a, b, input_precision="ieee")
        return result

    @triton.jit
    def _scores(q, k, mask_k, scale_log2e, like_ptr, LOW_PRECISION: tl.constexpr):
        """Scores q k^T times scale * log2(e) (base-2 softmax), -inf at masked keys."""
        s = _mm(q, tl.trans(k), like_ptr, LOW_PRECISION) * scale_log2e
        return tl.where(mask_k[None, :], s, float("-inf"))

    @triton.jit
    def line_forward_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, part_out_ptr, part_lse_ptr,
        sq_b, sq_h, sq_n, sq_d, sk_b, sk_h, sk_n, sk_d, sv_b, sv_h, sv_n, sv_d, so_b, so_h, so_n, so_d,
        heads, length, p, num_lines, seq_step, elem_step, head_dim, scale_log2e,
        HAS_PREFIX: tl.constexpr, ROWS: tl.constexpr, LOW_PRECISION: tl.constexpr,
        BLOCK_Q: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        """One line of one image and head: patch token ``p + line * seq_step + i * elem_step`` for
        i < length (rows: seq_step W, elem_step 1; columns: 1, W). Queries q, keys k, values v (rows:
        v; columns: the row hop's output). Writes out (rows: ``v_rows``, also its prefix values; columns:
        the output) and lse (B * heads, H * W); rows also the prefix queries' partials over the row."""
        # int64 offsets throughout: a batch of qkv projections can span more than 2**31 elements
        bh, line = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
        b, h = bh // heads, bh % heads
        q_ptr += b * sq_b + h * sq_h
        k_ptr += b * sk_b + h * sk_h
        v_ptr += b * sv_b + h * sv_h
        out_ptr += b * so_b + h * so_h
        offs_l = tl.arange(0, BLOCK_L).to(tl.int64)
        offs_p = tl.arange(0, BLOCK_P).to(tl.int64)
        offs_d = tl.arange(0, BLOCK_D).to(tl.int64)
        mask_l, mask_p, mask_d = offs_l < length, offs_p < p, offs_d < head_dim
        patches_l = line * seq_step + offs_l * elem_step
        k_line = _load(k_ptr, p + patches_l, mask_l, offs_d, mask_d, sk_n, sk_d, LOW_PRECISION)
        v_line = _load(v_ptr, p + patches_l, mask_l, offs_d, mask_d, sv_n, sv_d, LOW_PRECISION)
        if HAS_PREFIX:
            k_pre = _load(k_ptr, offs_p, mask_p, offs_d, mask_d, sk_n, sk_d, LOW_PRECISION)
            v_pre = _load(v_ptr, offs_p, mask_p, offs_d, mask_d, sv_n, sv_d, LOW_PRECISION)
        for start in range(0, length, BLOCK_Q):
            offs_q = start + tl.arange(0, BLOCK_Q).to(tl.int64)
            mask_q = offs_q < length
            patches_q = line * seq_step + offs_q * elem_step
            q = _load(q_ptr, p + patches_q, mask_q, offs_d, mask_d, sq_n, sq_d, LOW_PRECISION)
            s = _scores(q, k_line, mask_l, scale_log2e, q_ptr, LOW_PRECISION)
            m = tl.max(s, axis=1)
            if HAS_PREFIX:
                s_pre = _scores(q, k_pre, mask_p, scale_log2e, q_ptr, LOW_PRECISION)
                m = tl.maximum(m, tl.max(s_pre, axis=1))
            probs = tl.exp2(s - m[:, None])
            total = tl.sum(probs, axis=1)
            acc = _mm(probs, v_line, v_ptr, LOW_PRECISION)
            if HAS_PREFIX:
                probs_pre = tl.exp2(s_pre - m[:, None])
                total += tl.sum(probs_pre, axis=1)
                acc += _mm(probs_pre, v_pre, v_ptr, LOW_PRECISION)
            _store(out_ptr, acc / total[:, None], p + patches_q, mask_q, offs_d, mask_d, so_n, so_d)
            tl.store(lse_ptr + bh * num_lines * length + patches_q, m + tl.log2(total), mask=mask_q)
        if ROWS and HAS_PREFIX:
            # v_rows keeps v at the prefix tokens (the first row writes them)
            _store(out_ptr, v_pre, offs_p, mask_p & (line == 0), offs_d, mask_d, so_n, so_d)
            _prefix_queries_over_row(
                q_ptr, k_line, v_line, mask_l, offs_p, mask_p, offs_d, mask_d, sq_n, sq_d,
                part_out_ptr + ((bh * num_lines + line) * p) * head_dim,
                part_lse_ptr + (bh * num_lines + line) * p, head_dim, scale_log2e, v_ptr, LOW_PRECISION,
            )

    @triton.jit
    def _prefix_queries_over_row(
        q_ptr, k_line, v_line, mask_l, offs_p, mask_p, offs_d, mask_d, sq_n, sq_d,
        part_out_ptr, part_lse_ptr, head_dim, scale_log2e, like_ptr, LOW_PRECISION: tl.constexpr,
    ):
        """The prefix queries' softmax over one row's keys: its normalised output (P, d) and base-2
        log-sum-exp (P,), fp32, for :func:`prefix_forward_kernel` to merge."""
        q_pre = _load(q_ptr, offs_p, mask_p, offs_d, mask_d, sq_n, sq_d, LOW_PRECISION)
        s = _scores(q_pre, k_line, mask_l, scale_log2e, q_ptr, LOW_PRECISION)
        m = tl.max(s, axis=1)
        probs = tl.exp2(s - m[:, None])
        total = tl.sum(probs, axis=1)
        out = _mm(probs, v_line, like_ptr, LOW_PRECISION) / total[:, None]
        _store(part_out_ptr, out, offs_p, mask_p, offs_d, mask_d, head_dim, 1)
        tl.store(part_lse_ptr + offs_p, m + tl.log2(total), mask=mask_p)

    @triton.jit
    def prefix_forward_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, lse_pre_ptr, part_out_ptr, part_lse_ptr,
        sq_b, sq_h, sq_n, sq_d, sk_b, sk_h, sk_n, sk_d, sv_b, sv_h, sv_n, sv_d, so_b, so_h, so_n, so_d,
        heads, p, num_rows, head_dim, scale_log2e,
        LOW_PRECISION: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        """The prefix queries of one image and head: softmax over the prefix keys, merged with every
        row's partial (:func:`_prefix_queries_over_row`) by log-sum-exp, rows in order. Writes their
        output tokens and their base-2 log-sum-exp (B * heads, P)."""
        bh = tl.program_id(0).to(tl.int64)
        b, h = bh // heads, bh % heads
        offs_p, offs_d = tl.arange(0, BLOCK_P).to(tl.int64), tl.arange(0, BLOCK_D).to(tl.int64)
        mask_p, mask_d = offs_p < p, offs_d < head_dim
        q_pre = _load(q_ptr + b * sq_b + h * sq_h, offs_p, mask_p, offs_d, mask_d, sq_n, sq_d, LOW_PRECISION)
        k_pre = _load(k_ptr + b * sk_b + h * sk_h, offs_p, mask_p, offs_d, mask_d, sk_n, sk_d, LOW_PRECISION)
        v_pre = _load(v_ptr + b * sv_b + h * sv_h, offs_p, mask_p, offs_d, mask_d, sv_n, sv_d, LOW_PRECISION)
        s = _scores(q_pre, k_pre, mask_p, scale_log2e, q_ptr, LOW_PRECISION)
        m = tl.max(s, axis=1)
        probs = tl.exp2(s - m[:, None])
        total = tl.sum(probs, axis=1)
        acc = _mm(probs, v_pre, v_ptr, LOW_PRECISION)
        for row in range(0, num_rows):
            part = (bh * num_rows + row) * p
            part_lse = tl.load(part_lse_ptr + part + offs_p, mask=mask_p, other=0.0)
            part_out = _load(part_out_ptr + part * head_dim, offs_p, mask_p, offs_d, mask_d, head_dim, 1)
            m_new = tl.maximum(m, part_lse)
            keep, weight = tl.exp2(m - m_new), tl.exp2(part_lse - m_new)
            acc = acc * keep[:, None] + part_out * weight[:, None]
            total = total * keep + weight
            m = m_new
        _store(out_ptr + b * so_b + h * so_h, acc / total[:, None], offs_p, mask_p, offs_d, mask_d, so_n, so_d)
        tl.store(lse_pre_ptr + bh * p + offs_p, m + tl.log2(total), mask=mask_p)

    @triton.jit  # kept whole past 60 lines: a kernel reads as one program
    def line_backward_kernel(
        q_ptr, k_ptr, v_ptr, do_ptr, o_ptr, lse_ptr, delta_ptr, dq_ptr, dk_ptr, dv_ptr,
        part_dk_ptr, part_dv_ptr, grad_ptr, lse_pre_ptr, part_dq_ptr,
        sq_b, sq_h, sq_n, sq_d, sk_b, sk_h, sk_n, sk_d, sv_b, sv_h, sv_n, sv_d,
        sdo_b, sdo_h, sdo_n, sdo_d, so_b, so_h, so_n, so_d, sg_b, sg_h, sg_n, sg_d,
        sdq_b, sdq_h, sdq_n, sdq_d, sdk_b, sdk_h, sdk_n, sdk_d, sdv_b, sdv_h, sdv_n, sdv_d,
        heads, length, p, num_lines, line_offset, num_all_lines, seq_step, elem_step, head_dim, scale,
        scale_log2e,
        HAS_PREFIX: tl.constexpr, ROWS: tl.constexpr, LOW_PRECISION: tl.constexpr,
        BLOCK_Q: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        """The backward of one line's hop (lines as in :func:`line_forward_kernel`); do is the hop's output
        gradient (columns: the op's; rows: ``v_rows``'s), o the op's output.

        Columns write dq, dk of the patches and dv = the gradient of ``v_rows`` with, in delta, its row
        sums with ``v_rows`` (the row hop's softmax-backward term). Rows read delta, add dq and dk to
        what the columns wrote, add the prefix queries' share of the row keys' gradients and write dv;
        they leave the prefix queries' dq over the row in part_dq. Both leave the line's share of the
        prefix keys' and values' gradients in part_dk, part_dv (line ``line_offset + line``).

        One function of about 90 lines: the line's gradient accumulators live across the query loop."""
        bh, line = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
        b, h = bh // heads, bh % heads
        q_ptr += b * sq_b + h * sq_h
        k_ptr += b * sk_b + h * sk_h
        v_ptr += b * sv_b + h * sv_h
        do_ptr += b * sdo_b + h * sdo_h
        o_ptr += b * so_b + h * so_h
        dq_ptr += b * sdq_b + h * sdq_h
        dk_ptr += b * sdk_b + h * sdk_h
        dv_ptr += b * sdv_b + h * sdv_h
        offs_l = tl.arange(0, BLOCK_L).to(tl.int64)
        offs_p = tl.arange(0, BLOCK_P).to(tl.int64)
        offs_d = tl.arange(0, BLOCK_D).to(tl.int64)
        mask_l, mask_p, mask_d = offs_l < length, offs_p < p, offs_d < head_dim
        tokens_l = p + line * seq_step + offs_l * elem_step
        k_line = _load(k_ptr, tokens_l, mask_l, offs_d, mask_d, sk_n, sk_d, LOW_PRECISION)
        v_line = _load(v_ptr, tokens_l, mask_l, offs_d, mask_d, sv_n, sv_d, LOW_PRECISION)
        dk_line = tl.zeros((BLOCK_L, BLOCK_D), dtype=tl.float32)
        dv_line = tl.zeros((BLOCK_L, BLOCK_D), dtype=tl.float32)
        if HAS_PREFIX:
            k_pre = _load(k_ptr, offs_p, mask_p, offs_d, mask_d, sk_n, sk_d, LOW_PRECISION)
            v_pre = _load(v_ptr, offs_p, mask_p, offs_d, mask_d, sv_n, sv_d, LOW_PRECISION)
            dk_pre = tl.zeros((BLOCK_P, BLOCK_D), dtype=tl.float32)
            dv_pre = tl.zeros((BLOCK_P, BLOCK_D), dtype=tl.float32)
        lse_ptr += bh * num_lines * length
        delta_ptr += bh * num_lines * length
        for start in range(0, length, BLOCK_Q):
            offs_q = start + tl.arange(0, BLOCK_Q).to(tl.int64)
            mask_q = offs_q < length
            patches_q = line * seq_step + offs_q * elem_step
            q = _load(q_ptr, p + patches_q, mask_q, offs_d, mask_d, sq_n, sq_d, LOW_PRECISION)
            do = _load(do_ptr, p + patches_q, mask_q, offs_d, mask_d, sdo_n, sdo_d)
            lse = tl.load(lse_ptr + patches_q, mask=mask_q, other=float("inf"))  # no weight past the line
            if ROWS:
                delta = tl.load(delta_ptr + patches_q, mask=mask_q, other=0.0)
            else:
                delta = tl.sum(do * _load(o_ptr, p + patches_q, mask_q, offs_d, mask_d, so_n, so_d), axis=1)
            probs = tl.exp2(_scores(q, k_line, mask_l, scale_log2e, q_ptr, LOW_PRECISION) - lse[:, None])
            ds = probs * (_mm(do, tl.trans(v_line), v_ptr, LOW_PRECISION) - delta[:, None])
            dv_line += _mm(tl.trans(probs), do, v_ptr, LOW_PRECISION)
            dk_line += _mm(tl.trans(ds), q, q_ptr, LOW_PRECISION)
            dq = _mm(ds, k_line, k_ptr, LOW_PRECISION)
            if HAS_PREFIX:
                probs_pre = tl.exp2(_scores(q, k_pre, mask_p, scale_log2e, q_ptr, LOW_PRECISION) - lse[:, None])
                ds_pre = probs_pre * (_mm(do, tl.trans(v_pre), v_ptr, LOW_PRECISION) - delta[:, None])
                dv_pre += _mm(tl.trans(probs_pre), do, v_ptr, LOW_PRECISION)
                dk_pre += _mm(tl.trans(ds_pre), q, q_ptr, LOW_PRECISION)
                dq += _mm(ds_pre, k_pre, k_ptr, LOW_PRECISION)
            dq = dq * scale
            if ROWS:
                dq += _load(dq_ptr, p + patches_q, mask_q, offs_d, mask_d, sdq_n, sdq_d)
            _store(dq_ptr, dq, p + patches_q, mask_q, offs_d, mask_d, sdq_n, sdq_d)
        if ROWS and HAS_PREFIX:
            dk_line, dv_line = _prefix_queries_backward_over_row(
                q_ptr, k_line, v_line, mask_l, dk_line, dv_line, grad_ptr + b * sg_b + h * sg_h,
                o_ptr, lse_pre_ptr + bh * p, part_dq_ptr + ((bh * num_lines + line) * p) * head_dim,
                offs_p, mask_p, offs_d, mask_d, sq_n, sq_d, sg_n, sg_d, so_n, so_d, head_dim, scale,
                scale_log2e, LOW_PRECISION,
            )
        dk_line = dk_line * scale
        if ROWS:
            dk_line += _load(dk_ptr, tokens_l, mask_l, offs_d, mask_d, sdk_n, sdk_d)
        else:  # the row hop's softmax-backward term, from the exact (fp32) gradient of v_rows
            tl.store(delta_ptr + tokens_l - p, tl.sum(dv_line * v_line, axis=1), mask=mask_l)
        _store(dk_ptr, dk_line, tokens_l, mask_l, offs_d, mask_d, sdk_n, sdk_d)
        _store(dv_ptr, dv_line, tokens_l, mask_l, offs_d, mask_d, sdv_n, sdv_d)
        if HAS_PREFIX:
            part = ((bh * num_all_lines + line_offset + line) * p) * head_dim
            _store(part_dk_ptr + part, dk_pre * scale, offs_p, mask_p, offs_d, mask_d, head_dim, 1)
            _store(part_dv_ptr + part, dv_pre, offs_p, mask_p, offs_d, mask_d, head_dim, 1)

    @triton.jit
    def _prefix_queries_backward_over_row(
        q_ptr, k_line, v_line, mask_l, dk_line, dv_line, grad_ptr, o_ptr, lse_pre_ptr, part_dq_ptr,
        offs_p, mask_p, offs_d, mask_d, sq_n, sq_d, sg_n, sg_d, so_n, so_d, head_dim, scale, scale_log2e,
        LOW_PRECISION: tl.constexpr,
    ):
        """The prefix queries' softmax over one row's keys (values v), backward: returns the row keys'
        and values' gradients with their share added (dk not yet scaled) and leaves the prefix
        queries' dq over the row in part_dq (P, d), fp32."""
        q_pre = _load(q_ptr, offs_p, mask_p, offs_d, mask_d, sq_n, sq_d, LOW_PRECISION)
        do_pre = _load(grad_ptr, offs_p, mask_p, offs_d, mask_d, sg_n, sg_d)
        delta = tl.sum(do_pre * _load(o_ptr, offs_p, mask_p, offs_d, mask_d, so_n, so_d), axis=1)
        lse = tl.load(lse_pre_ptr + offs_p, mask=mask_p, other=float("inf"))
        probs = tl.exp2(_scores(q_pre, k_line, mask_l, scale_log2e, q_ptr, LOW_PRECISION) - lse[:, None])
        ds = probs * (_mm(do_pre, tl.trans(v_line), q_ptr, LOW_PRECISION) - delta[:, None])
        dv_line += _mm(tl.trans(probs), do_pre, q_ptr, LOW_PRECISION)
        dk_line += _mm(tl.trans(ds), q_pre, q_ptr, LOW_PRECISION)
        dq = _mm(ds, k_line, q_ptr, LOW_PRECISION) * scale
        _store(part_dq_ptr, dq, offs_p, mask_p, offs_d, mask_d, head_dim, 1)
        return dk_line, dv_line

    @triton.jit
    def prefix_backward_kernel(
        q_ptr, k_ptr, v_ptr, grad_ptr, o_ptr, lse_pre_ptr, part_dq_ptr, part_dk_ptr, part_dv_ptr,
        dq_ptr, dk_ptr, dv_ptr,
        sq_b, sq_h, sq_n, sq_d, sk_b, sk_h, sk_n, sk_d, sv_b, sv_h, sv_n, sv_d,
        sg_b, sg_h, sg_n, sg_d, so_b, so_h, so_n, so_d,
        sdq_b, sdq_h, sdq_n, sdq_d, sdk_b, sdk_h, sdk_n, sdk_d, sdv_b, sdv_h, sdv_n, sdv_d,
        heads, p, num_rows, num_all_lines, head_dim, scale, scale_log2e,
        LOW_PRECISION: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        """dq, dk, dv of the prefix tokens of one image and head: the prefix queries' softmax over the
        prefix keys, backward, plus the lines' partials summed in order (rows, then columns)."""
        bh = tl.program_id(0).to(tl.int64)
        b, h = bh // heads, bh % heads
        offs_p, offs_d = tl.arange(0, BLOCK_P).to(tl.int64), tl.arange(0, BLOCK_D).to(tl.int64)
        mask_p, mask_d = offs_p < p, offs_d < head_dim
        q = _load(q_ptr + b * sq_b + h * sq_h, offs_p, mask_p, offs_d, mask_d, sq_n, sq_d, LOW_PRECISION)
        k = _load(k_ptr + b * sk_b + h * sk_h, offs_p, mask_p, offs_d, mask_d, sk_n, sk_d)
        v = _load(v_ptr + b * sv_b + h * sv_h, offs_p, mask_p, offs_d, mask_d, sv_n, sv_d)
        do = _load(grad_ptr + b * sg_b + h * sg_h, offs_p, mask_p, offs_d, mask_d, sg_n, sg_d)
        delta = tl.sum(do * _load(o_ptr + b * so_b + h * so_h, offs_p, mask_p, offs_d, mask_d, so_n, so_d), axis=1)
        lse = tl.load(lse_pre_ptr + bh * p + offs_p, mask=mask_p, other=float("inf"))
        probs = tl.exp2(_scores(q, k, mask_p, scale_log2e, q_ptr, LOW_PRECISION) - lse[:, None])
        ds = probs * (_mm(do, tl.trans(v), q_ptr, LOW_PRECISION) - delta[:, None])
        dq = _mm(ds, k, q_ptr, LOW_PRECISION) * scale
        dk = _mm(tl.trans(ds), q, q_ptr, LOW_PRECISION) * scale
        dv = _mm(tl.trans(probs), do, q_ptr, LOW_PRECISION)
        for row in range(0, num_rows):
            part = ((bh * num_rows + row) * p) * head_dim
            dq += _load(part_dq_ptr + part, offs_p, mask_p, offs_d, mask_d, head_dim, 1)
        for line in range(0, num_all_lines):
            part = ((bh * num_all_lines + line) * p) * head_dim
            dk += _load(part_dk_ptr + part, offs_p, mask_p, offs_d, mask_d, head_dim, 1)
            dv += _load(part_dv_ptr + part, offs_p, mask_p, offs_d, mask_d, head_dim, 1)
        _store(dq_ptr + b * sdq_b + h * sdq_h, dq, offs_p, mask_p, offs_d, mask_d, sdq_n, sdq_d)
        _store(dk_ptr + b * sdk_b + h * sdk_h, dk, offs_p, mask_p, offs_d, mask_d, sdk_n, sdk_d)
        _store(dv_ptr + b * sdv_b + h * sdv_h, dv, offs_p, mask_p, offs_d, mask_d, sdv_n, sdv_d)
