"""2D rotary position embedding: the tables against their definition, the relative-position property, the
rotation against its naive twin, and every op fed rotated q and k against its naive twin."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import assert_rms_close, grads_of
from visattn import ops
from visattn.ops.axial.naive import naive_axial_attn
from visattn.ops.backends import force_backend, select_backend
from visattn.ops import rope as rope_module
from visattn.ops.linear import functional as linear_functional
from visattn.ops.linear.naive import naive_linear_attn
from visattn.ops.longformer import naive_longformer_attn
from visattn.ops.neighborhood import naive_neighborhood_attn
from visattn.ops.rope import (
    AXIAL_THETA,
    apply_rope,
    axial_rope,
    check_rope,
    init_mixed_rope_freqs,
    inverse_rope,
    mixed_rope,
    naive_apply_rope,
)
from visattn.ops.softmax import naive_softmax_attn
from visattn.ops.sparse import naive_sparse_attn

MODES = ["axial", "mixed"]


def _table(mode, grid, head_dim, heads, prefix, freqs=None, dtype=torch.float32):
    if mode == "axial":
        return axial_rope(grid, head_dim, prefix, dtype=dtype)
    return mixed_rope(init_mixed_rope_freqs(head_dim, heads, dtype=dtype) if freqs is None else freqs, grid, prefix)


def _angles(table):
    """The angle of every channel pair, (..., N, d / 2), read back from a table."""
    d = table.shape[-1] // 2
    return torch.atan2(table[..., 0:d:2], table[..., d::2])


# ---------------------------------------------------------------------------------------------- tables


def test_axial_table_turns_half_the_pairs_with_the_row_and_half_with_the_column():
    grid, d, p = (4, 6), 16, 2
    table = axial_rope(grid, d, p, dtype=torch.float64)
    assert table.shape == (p + 24, 2 * d)
    freqs = AXIAL_THETA ** (-4 * torch.arange(d // 4, dtype=torch.float64) / d)  # theta^(-4j/d)
    rows, cols = torch.meshgrid(torch.arange(4.0), torch.arange(6.0), indexing="ij")
    angles = torch.cat([rows.reshape(-1, 1) * freqs, cols.reshape(-1, 1) * freqs], dim=-1)  # (H W, d / 2)
    expected = torch.cat([angles.sin().repeat_interleave(2, -1), angles.cos().repeat_interleave(2, -1)], dim=-1)
    torch.testing.assert_close(table[p:], expected, rtol=0, atol=1e-6)  # angles computed in fp32
    torch.testing.assert_close(table[:p], torch.cat([torch.zeros(p, d), torch.ones(p, d)], -1).double())


def test_mixed_table_turns_every_pair_with_row_and_column_frequencies():
    grid, d, heads, p = (3, 5), 8, 2, 1
    freqs = torch.randn(2, heads, d // 2, dtype=torch.float64)
    table = mixed_rope(freqs, grid, p)
    assert table.shape == (heads, p + 15, 2 * d) and table.dtype == torch.float64
    rows, cols = torch.meshgrid(torch.arange(3.0), torch.arange(5.0), indexing="ij")
    expected = rows.reshape(1, -1, 1) * freqs[0, :, None] + cols.reshape(1, -1, 1) * freqs[1, :, None]
    torch.testing.assert_close(table[:, p:, 0:d:2], expected.sin(), rtol=0, atol=1e-5)
    torch.testing.assert_close(table[:, p:, d::2], expected.cos(), rtol=0, atol=1e-5)
    torch.testing.assert_close(_angles(table[:, :p]), torch.zeros(heads, p, d // 2, dtype=torch.float64))


def _matmul_mixed_freqs(freqs, t_x, t_y):
    """timm's get_mixed_freqs before 1.0.31: the angles as matmuls, which autocast runs in bf16."""
    dtype, freqs = freqs.dtype, freqs.float()
    angles = t_x.unsqueeze(-1) @ freqs[0].unsqueeze(-2) + t_y.unsqueeze(-1) @ freqs[1].unsqueeze(-2)
    return torch.cat([angles.sin().repeat_interleave(2, -1), angles.cos().repeat_interleave(2, -1)], -1).to(dtype)


@pytest.mark.parametrize("timm_angles", ["installed", "matmul"])
def test_mixed_table_angles_stay_fp32_under_autocast(timm_angles, monkeypatch):
    """Under bf16 autocast the table equals the one built without it, with this timm's angles and with the
    matmul form of older releases: on a 64 x 64 grid the angles reach about 90 radians, where bf16's spacing
    is half a radian."""
    if timm_angles == "matmul":
        monkeypatch.setattr(rope_module, "get_mixed_freqs", _matmul_mixed_freqs)
    freqs = init_mixed_rope_freqs(16, 2)  # fp32, as a layer holds them
    with torch.autocast("cpu", dtype=torch.bfloat16):
        table = mixed_rope(freqs, (64, 64), 1)
    torch.testing.assert_close(table, mixed_rope(freqs, (64, 64), 1), rtol=0, atol=0)


def test_mixed_freqs_start_as_rope_mixed_does():
    """Per head, pair j's frequency vector has magnitude 10^(-4 (j mod d/4) / d), the two halves at right angles."""
    d, heads = 16, 3
    freqs = init_mixed_rope_freqs(d, heads, dtype=torch.float64)
    assert freqs.shape == (2, heads, d // 2)
    magnitude = freqs.norm(dim=0)  # (heads, d / 2)
    expected = 10.0 ** (-4 * torch.arange(d // 4, dtype=torch.float64) / d)
    torch.testing.assert_close(magnitude, expected.repeat(heads, 2), rtol=1e-6, atol=0)
    first, second = freqs[..., : d // 4], freqs[..., d // 4 :]
    right_angles = (first * second).sum(0)  # (heads, d / 4): dot products of the two halves' vectors
    torch.testing.assert_close(right_angles, torch.zeros(heads, d // 4, dtype=torch.float64), atol=1e-6, rtol=0)


def test_axial_tables_are_cached_per_grid_prefix_device_dtype_and_inference_mode():
    table = axial_rope((4, 6), 8, 1)
    assert axial_rope((4, 6), 8, 1, device="cpu") is table
    other = axial_rope((6, 4), 8, 1)
    assert other is not table and not torch.equal(other, table)
    assert axial_rope((4, 6), 8, 1) is table, "a second grid must not evict the first"
    assert axial_rope((4, 6), 8, 2) is not table
    assert axial_rope((4, 6), 8, 1, dtype=torch.float64).dtype == torch.float64
    with torch.inference_mode():
        inference = axial_rope((4, 6), 8, 1)
    assert inference is not table and torch.equal(inference, table)


# ------------------------------------------------------------------------- the relative-position property


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(data=st.data())
@pytest.mark.parametrize("mode", MODES)
def test_score_depends_only_on_the_offset(mode, data):
    """R(p) q . R(p + delta) k, for a query at p and a key at p + delta, is q . R(delta) k with R(delta)
    turning pair i by delta_row f_row[i] + delta_col f_col[i]: the same for every p."""
    h = data.draw(st.integers(1, 12), label="H")
    w = data.draw(st.integers(1, 12), label="W")
    d = data.draw(st.sampled_from([4, 8, 16]), label="head_dim")
    heads = data.draw(st.integers(1, 3), label="heads")
    prefix = data.draw(st.integers(0, 2), label="prefix")
    dr = data.draw(st.integers(-(h - 1), h - 1), label="delta_row")
    dc = data.draw(st.integers(-(w - 1), w - 1), label="delta_col")
    rows, cols = st.integers(max(0, -dr), h - 1 - max(0, dr)), st.integers(max(0, -dc), w - 1 - max(0, dc))
    queries = [(data.draw(rows), data.draw(cols)) for _ in range(2)]
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    q, k = (torch.randn(1, heads, 1, d, generator=gen, dtype=torch.float64) for _ in range(2))
    if mode == "axial":
        table = axial_rope((h, w), d, prefix, dtype=torch.float64)
        f = AXIAL_THETA ** (-4 * torch.arange(d // 4, dtype=torch.float64) / d)
        zero = torch.zeros_like(f)
        f_row, f_col = torch.cat([f, zero]), torch.cat([zero, f])  # (d / 2,) for every head
    else:
        freqs = torch.randn(2, heads, d // 2, generator=gen, dtype=torch.float64)  # any learned values
        table = mixed_rope(freqs, (h, w), prefix)
        f_row, f_col = freqs[0], freqs[1]  # (heads, d / 2)
    n = prefix + h * w
    rq, rk = (apply_rope(t.expand(1, heads, n, d), table) for t in (q, k))
    turn = (dr * f_row + dc * f_col).reshape(-1, d // 2)  # (heads or 1, d / 2)
    q0, q1, k0, k1 = q[0, :, 0, 0::2], q[0, :, 0, 1::2], k[0, :, 0, 0::2], k[0, :, 0, 1::2]  # (heads, d / 2)
    expected = (turn.cos() * (q0 * k0 + q1 * k1) + turn.sin() * (q1 * k0 - q0 * k1)).sum(-1)  # (heads,)
    for r, c in queries:
        i, j = prefix + r * w + c, prefix + (r + dr) * w + (c + dc)
        score = (rq[0, :, i] * rk[0, :, j]).sum(-1)
        torch.testing.assert_close(score, expected, rtol=0, atol=1e-5 * (1 + expected.abs().max().item()))


# --------------------------------------------------------------------- the rotation and its naive twin


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("batch", [1, 3], ids=["B1", "B3"])
def test_apply_rope_matches_naive_twin_with_gradients(mode, batch):
    grid, d, heads, p = (3, 5), 8, 2, 2
    x = torch.randn(batch, heads, p + 15, d)
    freqs = init_mixed_rope_freqs(d, heads)

    def run(apply):
        def fn(x, freqs):
            return apply(x, _table(mode, grid, d, heads, p, freqs))

        return fn

    out, grads = grads_of(run(apply_rope), x, freqs)
    ref, ref_grads = grads_of(run(naive_apply_rope), x, freqs)
    assert_rms_close(out, ref, 1e-6, "out")
    for name, g, g_ref in zip(["x", "freqs"], grads, ref_grads):
        if mode == "mixed" or name == "x":
            assert_rms_close(g, g_ref, 1e-6, f"d{name}")
    torch.testing.assert_close(out[:, :, :p], x[:, :, :p], rtol=0, atol=0)  # prefix tokens are not turned
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1))  # a rotation keeps lengths


def test_apply_rope_keeps_the_input_dtype():
    table = axial_rope((2, 3), 8, 0)
    x = torch.randn(1, 1, 6, 8)
    assert apply_rope(x.bfloat16(), table).dtype == torch.bfloat16
    assert_rms_close(apply_rope(x.bfloat16(), table).float(), apply_rope(x, table), 1e-2, "bf16")


# -------------------------------------------------------------- every op on rotated q, k vs its naive twin

GRID, D, HEADS, P = (3, 5), 8, 2, 2


# op name -> (prefix tokens it takes, fast op, naive twin), each on rotated q, k and v (B, h, N, d)
OPS = {
    "softmax": (P, ops.softmax_attn, naive_softmax_attn),
    "neighborhood": (
        P,
        lambda q, k, v: ops.neighborhood_attn(q, k, v, GRID, 3, num_prefix_tokens=P, tile_size=2),
        lambda q, k, v: naive_neighborhood_attn(q, k, v, GRID, 3, num_prefix_tokens=P),
    ),
    "sparse": (
        P,
        lambda q, k, v: ops.sparse_attn(q, k, v, GRID, 2, 1, num_prefix_tokens=P),
        lambda q, k, v: naive_sparse_attn(q, k, v, GRID, 2, 1, num_prefix_tokens=P),
    ),
    "longformer": (
        P,
        lambda q, k, v: ops.longformer_attn(q, k, v, GRID, P, kernel_size=3, tile_size=2),
        lambda q, k, v: naive_longformer_attn(q, k, v, GRID, P, kernel_size=3),
    ),
    "axial": (
        P,
        lambda q, k, v: ops.axial_attn(q, k, v, GRID, P),
        lambda q, k, v: naive_axial_attn(q, k, v, GRID, P),
    ),
}


@pytest.mark.parametrize("batch", [1, 3], ids=["B1", "B3"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("op", OPS)
def test_op_on_rotated_qk_matches_naive_twin(op, mode, batch):
    prefix, fast, naive = OPS[op]
    n = prefix + GRID[0] * GRID[1]
    q, k, v = (torch.randn(batch, HEADS, n, D) for _ in range(3))
    freqs = init_mixed_rope_freqs(D, HEADS)

    def rotated(attn, rotate):
        def fn(q, k, v, freqs):
            table = _table(mode, GRID, D, HEADS, prefix, freqs)
            out = attn(rotate(q, table), rotate(k, table), v)
            return out.reshape(q.shape)

        return fn

    out, grads = grads_of(rotated(fast, apply_rope), q, k, v, freqs)
    ref, ref_grads = grads_of(rotated(naive, naive_apply_rope), q, k, v, freqs)
    assert_rms_close(out, ref, 1e-5, "out")
    for name, g, g_ref in zip(["q", "k", "v", "freqs"], grads, ref_grads):
        if mode == "mixed" or name != "freqs":
            assert_rms_close(g, g_ref, 1e-5, f"d{name}")


@pytest.mark.parametrize("batch", [1, 3], ids=["B1", "B3"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("backend,causal", [("plain", False), ("chunk", True)], ids=["plain", "chunk-causal"])
@pytest.mark.parametrize("feature_map", ["elu", "relu"])
def test_linear_with_rope_matches_naive_twin(feature_map, backend, causal, mode, batch):
    n = P + GRID[0] * GRID[1]
    q, k, v = (torch.randn(batch, HEADS, n, D) for _ in range(3))
    freqs = init_mixed_rope_freqs(D, HEADS)

    def fast(q, k, v, freqs):
        table = _table(mode, GRID, D, HEADS, P, freqs)
        return ops.linear_attn(q, k, v, feature_map, causal=causal, chunk_size=5, backend=backend, rope=table)

    def naive(q, k, v, freqs):
        table = _table(mode, GRID, D, HEADS, P, freqs)
        return naive_linear_attn(q, k, v, feature_map, causal=causal, rope=table)

    out, grads = grads_of(fast, q, k, v, freqs)
    ref, ref_grads = grads_of(naive, q, k, v, freqs)
    assert_rms_close(out, ref, 1e-5, "out")
    for name, g, g_ref in zip(["q", "k", "v", "freqs"], grads, ref_grads):
        if mode == "mixed" or name != "freqs":
            assert_rms_close(g, g_ref, 1e-5, f"d{name}")


def test_linear_rope_turns_the_numerator_and_leaves_the_normalizer():
    """The naive twin, spelled out once more: sum_j (R_i phi(q_i)) . (R_j phi(k_j)) v_j / sum_j phi(q_i) . phi(k_j)."""
    n = P + GRID[0] * GRID[1]
    q, k, v = (torch.randn(2, HEADS, n, D, dtype=torch.float64) for _ in range(3))
    table = axial_rope(GRID, D, P, dtype=torch.float64)
    phi_q, phi_k = (torch.nn.functional.elu(t) + 1 for t in (q, k))
    rq, rk = naive_apply_rope(phi_q, table), naive_apply_rope(phi_k, table)
    numerator = torch.einsum("bhid,bhjd,bhje->bhie", rq, rk, v)
    normalizer = torch.einsum("bhid,bhjd->bhi", phi_q, phi_k)[..., None]
    assert bool((normalizer > 0).all())
    assert_rms_close(naive_linear_attn(q, k, v, rope=table), numerator / normalizer, 1e-12, "naive twin")
    assert_rms_close(ops.linear_attn(q, k, v, rope=table), numerator / normalizer, 1e-5, "op")


def test_linear_rope_of_zero_angles_is_plain_linear_attention():
    n = P + GRID[0] * GRID[1]
    q, k, v = (torch.randn(2, HEADS, n, D) for _ in range(3))
    identity = torch.cat([torch.zeros(n, D), torch.ones(n, D)], dim=-1)
    for causal in (False, True):
        plain = ops.linear_attn(q, k, v, causal=causal)
        assert_rms_close(ops.linear_attn(q, k, v, causal=causal, rope=identity), plain, 1e-6)


def test_linear_rope_runs_blocked_on_the_cpu_unless_the_table_needs_a_gradient(monkeypatch):
    """A constant table (axial, or any table without autograd) takes the blocked path, which keeps no
    feature maps; learned frequencies while training take the plain one, which carries their gradient."""
    q = k = v = torch.randn(1, HEADS, P + 15, D)
    chosen = []

    def recording(*args):
        chosen.append(select_backend(*args))
        return chosen[-1]

    monkeypatch.setattr(linear_functional, "select_backend", recording)
    freqs = init_mixed_rope_freqs(D, HEADS).requires_grad_(True)
    learned = mixed_rope(freqs, GRID, P)
    assert ops.backends.choose_linear_backend(q.device, causal=False) == "blocked"
    assert ops.backends.choose_linear_backend(q.device, causal=False, rope_needs_grad=True) == "plain"
    with force_backend("linear", "blocked"):
        with pytest.raises(ValueError, match="'blocked' takes a constant rope table; .* needs 'plain'"):
            ops.linear_attn(q, k, v, rope=learned)
    with torch.no_grad(), force_backend("linear", "blocked"):  # no gradient taken: a constant here
        ops.linear_attn(q, k, v, rope=learned)
    chosen.clear()
    ops.linear_attn(q, k, v, rope=axial_rope(GRID, D, P))
    ops.linear_attn(q, k, v, rope=learned.detach())
    ops.linear_attn(q, k, v, rope=learned)
    assert chosen == ["blocked", "blocked", "plain"]


# ------------------------------------------------------------------------------------------- bad inputs


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: check_rope("2d", 8, "softmax"), r"softmax: rope must be None, 'axial' or 'mixed', got '2d'"),
        (lambda: check_rope("axial", 6, "softmax"), r"head width divisible by 4, got head_dim=6"),
        (lambda: axial_rope((3, 0), 8), r"grid must be \(H, W\)"),
        (lambda: axial_rope((3, 4), 8, -1), r"num_prefix_tokens must be an integer >= 0"),
        (lambda: mixed_rope(torch.zeros(3, 2, 4), (3, 4)), r"freqs must be \(2, heads, head_dim / 2\)"),
        (
            lambda: apply_rope(torch.zeros(1, 2, 13, 8), axial_rope((3, 4), 8)),
            r"rope must be \(13, 16\) or \(2, 13, 16\)",
        ),
        (lambda: naive_apply_rope(torch.zeros(2, 13, 8), axial_rope((3, 4), 8)), r"must be \(B, heads, N, d\)"),
        (
            lambda: ops.linear_attn(*(torch.zeros(1, 2, 13, 8) for _ in range(3)), rope=torch.zeros(12, 16)),
            r"linear_attn: rope must be \(13, 16\)",
        ),
    ],
    ids=["mode", "head-dim", "grid", "prefix", "freqs-shape", "table-shape", "x-rank", "linear-table"],
)
def test_bad_values_raise_one_line_errors(call, match):
    with pytest.raises(ValueError, match=match) as error:
        call()
    assert "\n" not in str(error.value)


def test_slowest_axial_pair_turns_slower_than_any_grid_here():
    """theta = 100: with d = 64 the slowest pair needs 2 pi 100^(15/16), about 471 cells, for one turn."""
    d = 64
    slowest = AXIAL_THETA ** (-4 * (d // 4 - 1) / d)
    assert 2 * math.pi / slowest > 400
    assert _angles(axial_rope((1, 2), d, 0, dtype=torch.float64))[1, -1].item() == pytest.approx(slowest, rel=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_inverse_table_is_the_transposed_rotation(mode):
    """inverse_rope's turn is R^T: it undoes R, and (R x) . y = x . (R^T y) for every token (R from the
    naive twin's explicit matrices)."""
    table = _table(mode, GRID, D, HEADS, P, dtype=torch.float64).detach()
    x, y = (torch.randn(2, HEADS, P + GRID[0] * GRID[1], D, dtype=torch.float64) for _ in range(2))
    # R^T R = I up to cos^2 + sin^2 - 1: the angles' sines and cosines are rounded in fp32 (2^-24 relative each)
    assert_rms_close(apply_rope(apply_rope(x, table), inverse_rope(table)), x, 2**-22, "R^T R x")
    turned_back = apply_rope(y, inverse_rope(table))
    assert_rms_close((naive_apply_rope(x, table) * y).sum(-1), (x * turned_back).sum(-1), 1e-12, "adjoint")
