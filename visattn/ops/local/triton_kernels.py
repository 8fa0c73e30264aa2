"""The Triton kernels of the local windows (launched by :mod:`visattn.ops.local.triton`).

A program owns one rectangle of the patch grid of one (image, head): a query tile of ``QH x QW`` patch
queries (forward, dq) or a key tile of ``KH x KW`` patch keys (dk, dv), cut from the grid in raster order.
Tokens are read in place through strides: token ``P + y * W + x`` is patch (y, x) after the P prefix
tokens. The window of a query along an axis is computed from its position (:func:`_window`), so a score's
mask is four interval tests, and the key region a query tile reaches (or the query region whose windows
reach a key tile, :func:`_inverse_window`) bounds two nested loops over 2D sub-tiles. Windows grow with
the position along an axis (both their ends), so a rectangle's region runs from the window of its first
cell to the window of its last.

Per axis a window is ``"neighborhood"`` (``BLOCK == 0``; start ``clamp(i - a, 0, L - c)``, width ``c``)
or ``"blocked"`` (``BLOCK`` > 0: the block of i grown by ``a`` on each side, cut at 0 and L).

Softmax runs in base 2 (``qk_scale`` is the score scale times log2 e) with fp32 running maxima, sums and
outputs; the log-sum-exp saved for the backward is in natural units. Under the interpreter (``UPCAST``)
tiles are upcast to fp32 as they are loaded; on a GPU the products take the inputs' dtype.
"""
from __future__ import annotations

from visattn.ops.triton_support import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

    # (globals a kernel reads must be constexpr)
    LOG2E = tl.constexpr(1.4426950408889634)
    # the running maximum starts finite: a row whose first key tiles are all masked then keeps weight 0
    NO_SCORE = tl.constexpr(-1.0e30)

    @triton.jit
    def _window(i, L, a, c, BLOCK: tl.constexpr):
        """[lo, hi): the keys queries ``i`` see along an axis of length L."""
        if BLOCK == 0:
            lo = tl.minimum(tl.maximum(i - a, 0), L - c)
            hi = lo + c
        else:
            start = i // BLOCK * BLOCK
            lo = tl.maximum(start - a, 0)
            hi = tl.minimum(start + BLOCK + a, L)
        return lo, hi

    @triton.jit
    def _inverse_window(k0, k1, L, a, c, BLOCK: tl.constexpr):
        """[first, end): the queries whose windows meet the keys [k0, k1] along an axis of length L."""
        if BLOCK == 0:
            first = tl.where(k0 < c, 0, k0 - c + 1 + a)
            last = tl.where(k1 >= L - c, L - 1, tl.minimum(k1 + a, L - 1))
        else:
            first = tl.maximum(k0 - a, 0) // BLOCK * BLOCK
            last = tl.minimum((tl.minimum(k1 + a, L - 1) // BLOCK + 1) * BLOCK, L) - 1
        return first, last + 1

    @triton.jit
    def _load(base, tok, ok, stride_n, stride_d, DIM: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr):
        """(len(tok), BLOCK_D) rows ``tok`` of one (image, head); zeros where not ``ok`` or past DIM."""
        d = tl.arange(0, BLOCK_D)
        ptrs = base + tok.to(tl.int64)[:, None] * stride_n + d[None, :] * stride_d
        x = tl.load(ptrs, mask=ok[:, None] & (d[None, :] < DIM), other=0.0)
        if UPCAST:
            x = x.to(tl.float32)
        return x

    @triton.jit
    def _store(base, tok, ok, stride_n, stride_d, x, DIM: tl.constexpr, BLOCK_D: tl.constexpr):
        d = tl.arange(0, BLOCK_D)
        ptrs = base + tok.to(tl.int64)[:, None] * stride_n + d[None, :] * stride_d
        tl.store(ptrs, x.to(base.dtype.element_ty), mask=ok[:, None] & (d[None, :] < DIM))

    @triton.jit
    def _cells(y0, x0, H, W, P, TH: tl.constexpr, TW: tl.constexpr):
        """The TH x TW cells from (y0, x0) in raster order: rows, columns, tokens, inside the grid."""
        i = tl.arange(0, TH * TW)
        y, x = y0 + i // TW, x0 + i % TW
        return y, x, P + y * W + x, (y < H) & (x < W)

    @triton.jit
    def _query_windows(q_rows, q_cols, H, W, row_a, row_c, col_a, col_c, ROW_BLOCK: tl.constexpr,
                       COL_BLOCK: tl.constexpr):
        """The windows of queries (rows, cols) along both axes; queries past the grid take the edge cell's."""
        row_lo, row_hi = _window(tl.minimum(q_rows, H - 1), H, row_a, row_c, ROW_BLOCK)
        col_lo, col_hi = _window(tl.minimum(q_cols, W - 1), W, col_a, col_c, COL_BLOCK)
        return row_lo, row_hi, col_lo, col_hi

    @triton.jit
    def _softmax_step(q, k, v, seen, m_i, l_i, acc, qk_scale, PRECISION: tl.constexpr):
        """One key tile of the online softmax (base 2): the running maximum, sum and output of each query."""
        s = tl.where(seen, tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha, p = tl.exp2(m_i - m_new), tl.exp2(s - m_new[:, None])
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        return m_new, l_i * alpha + tl.sum(p, 1), acc

    @triton.jit
    def window_forward_kernel(
        q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr,
        sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, son, sod,
        heads, N, H, W, P, row_a, row_c, col_a, col_c, qk_scale,
        DIM: tl.constexpr, DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
        ROW_BLOCK: tl.constexpr, COL_BLOCK: tl.constexpr, PREFIX_VISIBLE: tl.constexpr, BLOCK_P: tl.constexpr,
        QH: tl.constexpr, QW: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr, UPCAST: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """Output and log-sum-exp of one query tile's patch queries over their windows (and the prefix
        keys when PREFIX_VISIBLE), in one online softmax over the tile's key region."""
        tile, bh = tl.program_id(0), tl.program_id(1)
        b, h = (bh // heads).to(tl.int64), (bh % heads).to(tl.int64)
        tiles_w = tl.cdiv(W, QW)
        y0, x0 = tile // tiles_w * QH, tile % tiles_w * QW
        q_rows, q_cols, q_tok, q_ok = _cells(y0, x0, H, W, P, QH, QW)
        k_base, v_base = k_ptr + b * skb + h * skh, v_ptr + b * svb + h * svh
        q = _load(q_ptr + b * sqb + h * sqh, q_tok, q_ok, sqn, sqd, DIM, BLOCK_D, UPCAST)
        m_i = tl.full([QH * QW], NO_SCORE, tl.float32)
        l_i = tl.zeros([QH * QW], tl.float32)
        acc = tl.zeros([QH * QW, BLOCK_DV], tl.float32)
        if PREFIX_VISIBLE:
            for p0 in range(0, P, BLOCK_P):  # the prefix keys: one extra key tile
                k_tok = p0 + tl.arange(0, BLOCK_P)
                k_ok = k_tok < P
                k = _load(k_base, k_tok, k_ok, skn, skd, DIM, BLOCK_D, UPCAST)
                v = _load(v_base, k_tok, k_ok, svn, svd, DIM_V, BLOCK_DV, UPCAST)
                m_i, l_i, acc = _softmax_step(q, k, v, k_ok[None, :], m_i, l_i, acc, qk_scale, PRECISION)
        row_lo, row_hi, col_lo, col_hi = _query_windows(q_rows, q_cols, H, W, row_a, row_c, col_a, col_c, ROW_BLOCK,
                                                        COL_BLOCK)
        region_y0, region_y1 = tl.min(row_lo), tl.max(row_hi)
        region_x0, region_x1 = tl.min(col_lo), tl.max(col_hi)
        for ky in range(region_y0, region_y1, KH):
            for kx in range(region_x0, region_x1, KW):
                k_rows, k_cols, k_tok, _ = _cells(ky, kx, H, W, P, KH, KW)
                k_ok = (k_rows < region_y1) & (k_cols < region_x1)
                k = _load(k_base, k_tok, k_ok, skn, skd, DIM, BLOCK_D, UPCAST)
                v = _load(v_base, k_tok, k_ok, svn, svd, DIM_V, BLOCK_DV, UPCAST)
                seen = (row_lo[:, None] <= k_rows[None, :]) & (k_rows[None, :] < row_hi[:, None]) & k_ok[None, :]
                seen = seen & (col_lo[:, None] <= k_cols[None, :]) & (k_cols[None, :] < col_hi[:, None])
                m_i, l_i, acc = _softmax_step(q, k, v, seen, m_i, l_i, acc, qk_scale, PRECISION)
        l_i = tl.where(q_ok, l_i, 1.0)
        _store(o_ptr + b * sob + h * soh, q_tok, q_ok, son, sod, acc / l_i[:, None], DIM_V, BLOCK_DV)
        tl.store(lse_ptr + bh.to(tl.int64) * N + q_tok, (m_i + tl.log2(l_i)) / LOG2E, mask=q_ok)

    @triton.jit
    def window_dq_kernel(
        q_ptr, k_ptr, v_ptr, o_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, dk_part_ptr, dv_part_ptr,
        sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, son, sod, sdob, sdoh, sdon, sdod,
        sdqb, sdqh, sdqn, sdqd,
        heads, N, H, W, P, row_a, row_c, col_a, col_c, qk_scale, scale, part_tiles,
        DIM: tl.constexpr, DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
        ROW_BLOCK: tl.constexpr, COL_BLOCK: tl.constexpr, PREFIX_VISIBLE: tl.constexpr, BLOCK_P: tl.constexpr,
        QH: tl.constexpr, QW: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr, UPCAST: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """dq of one query tile's patch queries, their ``delta = rowsum(dO * O)``, and this tile's share of
        the prefix keys' dk and dv (when PREFIX_VISIBLE), each written once: the caller sums the shares over
        the tiles, in order. Scores are recomputed from the saved log-sum-exp."""
        tile, bh = tl.program_id(0), tl.program_id(1)
        b, h = (bh // heads).to(tl.int64), (bh % heads).to(tl.int64)
        tiles_w = tl.cdiv(W, QW)
        y0, x0 = tile // tiles_w * QH, tile % tiles_w * QW
        q_rows, q_cols, q_tok, q_ok = _cells(y0, x0, H, W, P, QH, QW)
        k_base, v_base = k_ptr + b * skb + h * skh, v_ptr + b * svb + h * svh
        q = _load(q_ptr + b * sqb + h * sqh, q_tok, q_ok, sqn, sqd, DIM, BLOCK_D, UPCAST)
        do = _load(do_ptr + b * sdob + h * sdoh, q_tok, q_ok, sdon, sdod, DIM_V, BLOCK_DV, UPCAST)
        o = _load(o_ptr + b * sob + h * soh, q_tok, q_ok, son, sod, DIM_V, BLOCK_DV, UPCAST)
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
        tl.store(delta_ptr + bh.to(tl.int64) * N + q_tok, delta, mask=q_ok)
        lse = tl.load(lse_ptr + bh.to(tl.int64) * N + q_tok, mask=q_ok, other=0.0) * LOG2E
        dq = tl.zeros([QH * QW, BLOCK_D], tl.float32)
        if PREFIX_VISIBLE:
            part = (bh.to(tl.int64) * part_tiles + tile) * P
            for p0 in range(0, P, BLOCK_P):
                k_tok = p0 + tl.arange(0, BLOCK_P)
                k_ok = k_tok < P
                k = _load(k_base, k_tok, k_ok, skn, skd, DIM, BLOCK_D, UPCAST)
                v = _load(v_base, k_tok, k_ok, svn, svd, DIM_V, BLOCK_DV, UPCAST)
                s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
                p = tl.where(q_ok[:, None] & k_ok[None, :], tl.exp2(s - lse[:, None]), 0.0)
                dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
                ds = (p * (dp - delta[:, None])).to(q.dtype)
                dq += tl.dot(ds, k, input_precision=PRECISION)
                dk_part = tl.dot(tl.trans(ds), q, input_precision=PRECISION) * scale
                dv_part = tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PRECISION)
                _store(dk_part_ptr + part * BLOCK_D, k_tok, k_ok, BLOCK_D, 1, dk_part, BLOCK_D, BLOCK_D)
                _store(dv_part_ptr + part * BLOCK_DV, k_tok, k_ok, BLOCK_DV, 1, dv_part, BLOCK_DV, BLOCK_DV)
        row_lo, row_hi, col_lo, col_hi = _query_windows(q_rows, q_cols, H, W, row_a, row_c, col_a, col_c, ROW_BLOCK,
                                                        COL_BLOCK)
        region_y0, region_y1 = tl.min(row_lo), tl.max(row_hi)
        region_x0, region_x1 = tl.min(col_lo), tl.max(col_hi)
        for ky in range(region_y0, region_y1, KH):
            for kx in range(region_x0, region_x1, KW):
                k_rows, k_cols, k_tok, _ = _cells(ky, kx, H, W, P, KH, KW)
                k_ok = (k_rows < region_y1) & (k_cols < region_x1)
                k = _load(k_base, k_tok, k_ok, skn, skd, DIM, BLOCK_D, UPCAST)
                v = _load(v_base, k_tok, k_ok, svn, svd, DIM_V, BLOCK_DV, UPCAST)
                s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
                seen = (row_lo[:, None] <= k_rows[None, :]) & (k_rows[None, :] < row_hi[:, None]) & q_ok[:, None]
                seen = seen & (col_lo[:, None] <= k_cols[None, :]) & (k_cols[None, :] < col_hi[:, None]) & k_ok[None, :]
                p = tl.where(seen, tl.exp2(s - lse[:, None]), 0.0)
                dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
                ds = (p * (dp - delta[:, None])).to(q.dtype)
                dq += tl.dot(ds, k, input_precision=PRECISION)
        _store(dq_ptr + b * sdqb + h * sdqh, q_tok, q_ok, sdqn, sdqd, dq * scale, DIM, BLOCK_D)

    @triton.jit
    def window_dkdv_kernel(
        q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
        sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sdob, sdoh, sdon, sdod,
        sdkb, sdkh, sdkn, sdkd, sdvb, sdvh, sdvn, sdvd,
        heads, N, H, W, P, row_a, row_c, col_a, col_c, qk_scale, scale,
        DIM: tl.constexpr, DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
        ROW_BLOCK: tl.constexpr, COL_BLOCK: tl.constexpr, BLOCK_P: tl.constexpr,
        QH: tl.constexpr, QW: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr, UPCAST: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """dk and dv of one key tile's patch keys: from the prefix queries (which see every key) and from
        the queries whose windows meet the tile (its inverse neighbourhood), in sub-tiles of QH x QW."""
        tile, bh = tl.program_id(0), tl.program_id(1)
        b, h = (bh // heads).to(tl.int64), (bh % heads).to(tl.int64)
        tiles_w = tl.cdiv(W, KW)
        y0, x0 = tile // tiles_w * KH, tile % tiles_w * KW
        k_rows, k_cols, k_tok, k_ok = _cells(y0, x0, H, W, P, KH, KW)
        q_base, do_base = q_ptr + b * sqb + h * sqh, do_ptr + b * sdob + h * sdoh
        k = _load(k_ptr + b * skb + h * skh, k_tok, k_ok, skn, skd, DIM, BLOCK_D, UPCAST)
        v = _load(v_ptr + b * svb + h * svh, k_tok, k_ok, svn, svd, DIM_V, BLOCK_DV, UPCAST)
        stats = bh.to(tl.int64) * N
        dk = tl.zeros([KH * KW, BLOCK_D], tl.float32)
        dv = tl.zeros([KH * KW, BLOCK_DV], tl.float32)
        for p0 in range(0, P, BLOCK_P):  # the prefix queries: one extra query tile
            q_tok = p0 + tl.arange(0, BLOCK_P)
            q_ok = q_tok < P
            q = _load(q_base, q_tok, q_ok, sqn, sqd, DIM, BLOCK_D, UPCAST)
            do = _load(do_base, q_tok, q_ok, sdon, sdod, DIM_V, BLOCK_DV, UPCAST)
            lse = tl.load(lse_ptr + stats + q_tok, mask=q_ok, other=0.0) * LOG2E
            delta = tl.load(delta_ptr + stats + q_tok, mask=q_ok, other=0.0)
            s = tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale  # (keys, queries)
            p = tl.where(k_ok[:, None] & q_ok[None, :], tl.exp2(s - lse[None, :]), 0.0)
            dv += tl.dot(p.to(do.dtype), do, input_precision=PRECISION)
            dp = tl.dot(v, tl.trans(do), input_precision=PRECISION)
            dk += tl.dot((p * (dp - delta[None, :])).to(q.dtype), q, input_precision=PRECISION)
        first_y, end_y = _inverse_window(y0, tl.minimum(y0 + KH, H) - 1, H, row_a, row_c, ROW_BLOCK)
        first_x, end_x = _inverse_window(x0, tl.minimum(x0 + KW, W) - 1, W, col_a, col_c, COL_BLOCK)
        for qy in range(first_y, end_y, QH):
            for qx in range(first_x, end_x, QW):
                q_rows, q_cols, q_tok, _ = _cells(qy, qx, H, W, P, QH, QW)
                q_ok = (q_rows < end_y) & (q_cols < end_x)
                q = _load(q_base, q_tok, q_ok, sqn, sqd, DIM, BLOCK_D, UPCAST)
                do = _load(do_base, q_tok, q_ok, sdon, sdod, DIM_V, BLOCK_DV, UPCAST)
                lse = tl.load(lse_ptr + stats + q_tok, mask=q_ok, other=0.0) * LOG2E
                delta = tl.load(delta_ptr + stats + q_tok, mask=q_ok, other=0.0)
                s = tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale  # (keys, queries)
                row_lo, row_hi, col_lo, col_hi = _query_windows(q_rows, q_cols, H, W, row_a, row_c, col_a, col_c,
                                                                ROW_BLOCK, COL_BLOCK)
                seen = (row_lo[None, :] <= k_rows[:, None]) & (k_rows[:, None] < row_hi[None, :]) & k_ok[:, None]
                seen = seen & (col_lo[None, :] <= k_cols[:, None]) & (k_cols[:, None] < col_hi[None, :]) & q_ok[None, :]
                p = tl.where(seen, tl.exp2(s - lse[None, :]), 0.0)
                dv += tl.dot(p.to(do.dtype), do, input_precision=PRECISION)
                dp = tl.dot(v, tl.trans(do), input_precision=PRECISION)
                dk += tl.dot((p * (dp - delta[None, :])).to(q.dtype), q, input_precision=PRECISION)
        _store(dk_ptr + b * sdkb + h * sdkh, k_tok, k_ok, sdkn, sdkd, dk * scale, DIM, BLOCK_D)
        _store(dv_ptr + b * sdvb + h * sdvh, k_tok, k_ok, sdvn, sdvd, dv, DIM_V, BLOCK_DV)

    @triton.jit
    def prefix_rows_kernel(
        q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, part_ptr, part_max_ptr, part_sum_ptr,
        sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sdob, sdoh, sdon, sdod,
        heads, N, P, qk_scale,
        DIM: tl.constexpr, DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
        BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, SEGMENT: tl.constexpr, BACKWARD: tl.constexpr,
        UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    ):
        """BLOCK_P prefix queries over one segment of SEGMENT keys (they see all N tokens; segments keep a
        GPU busy where P rows alone would not). Forward: the segment's running maximum, sum and unnormalised
        output (base 2), merged by the caller. BACKWARD: the segment's share of the prefix queries' dq,
        unscaled, summed by the caller."""
        segment, bh = tl.program_id(0), tl.program_id(2)
        b, h = (bh // heads).to(tl.int64), (bh % heads).to(tl.int64)
        q_tok = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
        q_ok = q_tok < P
        k_base, v_base = k_ptr + b * skb + h * skh, v_ptr + b * svb + h * svh
        q = _load(q_ptr + b * sqb + h * sqh, q_tok, q_ok, sqn, sqd, DIM, BLOCK_D, UPCAST)
        part = (bh.to(tl.int64) * tl.num_programs(0) + segment) * P
        start = segment * SEGMENT
        end = tl.minimum(start + SEGMENT, N)
        if BACKWARD:
            do = _load(do_ptr + b * sdob + h * sdoh, q_tok, q_ok, sdon, sdod, DIM_V, BLOCK_DV, UPCAST)
            lse = tl.load(lse_ptr + bh.to(tl.int64) * N + q_tok, mask=q_ok, other=0.0) * LOG2E
            delta = tl.load(delta_ptr + bh.to(tl.int64) * N + q_tok, mask=q_ok, other=0.0)
            dq = tl.zeros([BLOCK_P, BLOCK_D], tl.float32)
            for j in range(start, end, BLOCK_N):
                k_tok = j + tl.arange(0, BLOCK_N)
                k_ok = k_tok < end
                k = _load(k_base, k_tok, k_ok, skn, skd, DIM, BLOCK_D, UPCAST)
                v = _load(v_base, k_tok, k_ok, svn, svd, DIM_V, BLOCK_DV, UPCAST)
                s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
                p = tl.where(q_ok[:, None] & k_ok[None, :], tl.exp2(s - lse[:, None]), 0.0)
                dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
                dq += tl.dot((p * (dp - delta[:, None])).to(q.dtype), k, input_precision=PRECISION)
            _store(part_ptr + part * BLOCK_D, q_tok, q_ok, BLOCK_D, 1, dq, BLOCK_D, BLOCK_D)
        else:
            m_i = tl.full([BLOCK_P], NO_SCORE, tl.float32)
            l_i = tl.zeros([BLOCK_P], tl.float32)
            acc = tl.zeros([BLOCK_P, BLOCK_DV], tl.float32)
            for j in range(start, end, BLOCK_N):
                k_tok = j + tl.arange(0, BLOCK_N)
                k_ok = k_tok < end
                k = _load(k_base, k_tok, k_ok, skn, skd, DIM, BLOCK_D, UPCAST)
                v = _load(v_base, k_tok, k_ok, svn, svd, DIM_V, BLOCK_DV, UPCAST)
                s = tl.where(k_ok[None, :], tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                alpha, p = tl.exp2(m_i - m_new), tl.exp2(s - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, 1)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
                m_i = m_new
            _store(part_ptr + part * BLOCK_DV, q_tok, q_ok, BLOCK_DV, 1, acc, BLOCK_DV, BLOCK_DV)
            tl.store(part_max_ptr + part + q_tok, m_i, mask=q_ok)
            tl.store(part_sum_ptr + part + q_tok, l_i, mask=q_ok)
