import pytest
import torch

from tests.helpers import assert_rms_close, grads_of
from visattn import ops
from visattn.ops.backends import force_backend
from visattn.ops.linear import FEATURE_MAPS, blocked, fused_qkv_linear_attn, packed_linear_attn
from visattn.ops.linear.naive import naive_linear_attn
from visattn.ops.linear.plain import KV_CHUNK
from visattn.ops.rope import axial_rope, init_mixed_rope_freqs, mixed_rope

SHAPES = [(1, 1, 5, 4), (2, 3, 37, 8), (1, 2, 130, 16)]  # N not a multiple of any chunk size used below
SHAPE_IDS = [f"B{b}-H{h}-N{n}-d{d}" for b, h, n, d in SHAPES]


def _qkv(shape, dtype=torch.float32):
    return [torch.randn(shape, dtype=dtype) for _ in range(3)]


@pytest.mark.parametrize("feature_map", sorted(FEATURE_MAPS))
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_linear_matches_reference_fp32(shape, causal, feature_map):
    q, k, v = _qkv(shape)
    out, grads = grads_of(lambda q, k, v: ops.linear_attn(q, k, v, feature_map=feature_map, causal=causal, chunk_size=16), q, k, v)
    ref, ref_grads = grads_of(lambda q, k, v: naive_linear_attn(q, k, v, feature_map=feature_map, causal=causal), q, k, v)
    assert_rms_close(out, ref, 1e-5, "out")
    for name, g, g_ref in zip("qkv", grads, ref_grads):
        assert_rms_close(g, g_ref, 1e-5, f"d{name}")


@pytest.mark.parametrize("chunk_size", [1, 7, 64, 1000])
def test_causal_result_independent_of_chunk_size(chunk_size):
    q, k, v = _qkv((2, 2, 50, 8))
    out, grads = grads_of(lambda q, k, v: ops.linear_attn(q, k, v, causal=True, chunk_size=chunk_size), q, k, v)
    ref, ref_grads = grads_of(lambda q, k, v: naive_linear_attn(q, k, v, causal=True), q, k, v)
    assert_rms_close(out, ref, 1e-5, "out")
    for g, g_ref in zip(grads, ref_grads):
        assert_rms_close(g, g_ref, 1e-5, "grad")


def test_causal_chunked_equals_recurrent_steps():
    q, k, v = _qkv((2, 3, 29, 8))
    chunked = ops.linear_attn(q, k, v, causal=True, chunk_size=8)
    state, steps = None, []
    for t in range(q.shape[2]):
        out_t, state = ops.linear_attn_step(q[:, :, t], k[:, :, t], v[:, :, t], state)
        steps.append(out_t)
    assert_rms_close(torch.stack(steps, dim=2), chunked, 1e-5, "recurrent vs chunked")
    assert_rms_close(chunked, naive_linear_attn(q, k, v, causal=True), 1e-5, "chunked vs masked reference")


def test_causal_first_token_sees_only_itself():
    q, k, v = _qkv((1, 1, 6, 4))
    out = ops.linear_attn(q, k, v, causal=True)
    torch.testing.assert_close(out[:, :, 0], v[:, :, 0], rtol=1e-5, atol=1e-6)  # weights normalise to 1 on one key


def test_constant_values_come_back():
    q, k, _ = _qkv((2, 2, 33, 8))
    v = torch.full((2, 2, 33, 8), 3.5)
    for causal in (False, True):
        torch.testing.assert_close(ops.linear_attn(q, k, v, causal=causal), v, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_bf16_close_to_fp32_reference(causal):
    q, k, v = _qkv((2, 2, 70, 16))
    out = ops.linear_attn(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=causal, chunk_size=16)
    assert out.dtype == torch.bfloat16
    assert_rms_close(out.float(), naive_linear_attn(q, k, v, causal=causal), 2e-2, "bf16")


def test_autocast_bf16_keeps_fp32_sums():
    q, k, v = _qkv((1, 2, 40, 8))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ops.linear_attn(q, k, v)
    assert_rms_close(out.float(), naive_linear_attn(q, k, v), 1e-5, "fp32 inputs under autocast stay fp32")


def test_long_sequence_bf16_is_finite_and_close_to_fp32():
    """65,536 tokens (a 256x256 grid), 6 heads of d=64, under bf16 autocast: an fp16 sum would overflow."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 6, 65536, 64, generator=gen) for _ in range(3))
    expected = ops.linear_attn(q, k, v)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ops.linear_attn(q.bfloat16(), k.bfloat16(), v.bfloat16())
    assert torch.isfinite(out).all()
    assert_rms_close(out.float(), expected, 2e-2, "bf16 at N=65536")


def test_relu_feature_map_guards_a_zero_normalizer():
    q = -torch.ones(1, 1, 4, 2)  # relu(q) = 0: the normalizer is 0 and must not divide by zero
    k, v = torch.randn(1, 1, 4, 2), torch.randn(1, 1, 4, 2)
    out = ops.linear_attn(q, k, v, feature_map="relu")
    assert torch.isfinite(out).all() and torch.count_nonzero(out) == 0


def test_bad_inputs_raise():
    q, k, v = _qkv((1, 2, 8, 4))
    with pytest.raises(ValueError, match="feature_map"):
        ops.linear_attn(q, k, v, feature_map="softplus")
    with pytest.raises(ValueError, match=r"\(B, heads, N, d\)"):
        ops.linear_attn(q[0], k[0], v[0])
    with pytest.raises(ValueError, match="agree"):
        ops.linear_attn(q, k[:, :, :5], v)
    with pytest.raises(ValueError, match="chunk_size"):
        ops.linear_attn(q, k, v, causal=True, chunk_size=0)


# The non-causal op walks the tokens in blocks; a small block makes every test shape span several blocks
# (the last one partial), so the block boundaries are exercised: runs of at most 16 tokens of one image where an
# image exceeds the budget (N=53, N=37, also in an odd batch), runs of whole images where several fit (B=5,
# N=6: two a block).
SMALL_BLOCKS = 16 * 2 * 9  # 16 tokens per block at heads=2, d=8 (work buffers of d + 1 values a head)
BLOCK_SHAPES = [(1, 2, 53, 8), (2, 3, 37, 8), (3, 2, 37, 8), (5, 2, 6, 8)]
BLOCK_IDS = [f"B{b}-H{h}-N{n}-d{d}" for b, h, n, d in BLOCK_SHAPES]


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(blocked, "BLOCK_ELEMENTS", SMALL_BLOCKS)



@pytest.mark.parametrize("feature_map", sorted(FEATURE_MAPS))
@pytest.mark.parametrize("shape", BLOCK_SHAPES, ids=BLOCK_IDS)
def test_noncausal_blocks_match_reference(shape, feature_map, small_blocks):
    q, k, v = _qkv(shape)
    out, grads = grads_of(lambda q, k, v: ops.linear_attn(q, k, v, feature_map=feature_map), q, k, v)
    ref, ref_grads = grads_of(lambda q, k, v: naive_linear_attn(q, k, v, feature_map=feature_map), q, k, v)
    assert_rms_close(out, ref, 1e-5, "out")
    for name, g, g_ref in zip("qkv", grads, ref_grads):
        assert_rms_close(g, g_ref, 1e-5, f"d{name}")


# Each block shape's tokens as a grid after prefix tokens: 53 = 1 + 4 x 13, 37 = 1 + 6 x 6, 6 = 2 + 2 x 2.
BLOCK_GRIDS = {53: ((4, 13), 1), 37: ((6, 6), 1), 6: ((2, 2), 2)}


@pytest.mark.parametrize("per_head", [False, True], ids=["axial-table", "per-head-table"])
@pytest.mark.parametrize("feature_map", sorted(FEATURE_MAPS))
@pytest.mark.parametrize("shape", BLOCK_SHAPES, ids=BLOCK_IDS)
def test_noncausal_blocks_with_rope_match_reference(shape, feature_map, per_head, small_blocks):
    """The blocked path turns the numerator's features block by block, and its backward turns their gradients
    back: outputs and gradients as the naive twin's, with an (N, 2 d) table and a per-head (heads, N, 2 d) one
    (a mixed table's values, as constants)."""
    _, heads, n, d = shape
    grid, prefix = BLOCK_GRIDS[n]
    if per_head:
        table = mixed_rope(init_mixed_rope_freqs(d, heads), grid, prefix).detach()
    else:
        table = axial_rope(grid, d, prefix)
    q, k, v = _qkv(shape)

    def blocked_op(q, k, v):
        with force_backend("linear", "blocked"):
            return ops.linear_attn(q, k, v, feature_map=feature_map, rope=table)

    out, grads = grads_of(blocked_op, q, k, v)
    ref, ref_grads = grads_of(lambda q, k, v: naive_linear_attn(q, k, v, feature_map, rope=table), q, k, v)
    assert_rms_close(out, ref, 1e-5, "out")
    for name, g, g_ref in zip("qkv", grads, ref_grads):
        assert_rms_close(g, g_ref, 1e-5, f"d{name}")


def test_blocked_rope_saves_only_its_inputs_the_state_and_the_table():
    """With a rope table a training step still keeps no feature map, turned feature or output of N tokens."""
    q, k, v = (t.requires_grad_(True) for t in _qkv((1, 2, 65, 8)))
    table = axial_rope((8, 8), 8, 1)
    saved = []
    with force_backend("linear", "blocked"):
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            ops.linear_attn(q, k, v, rope=table)
    assert all(any(t is kept for kept in (q, k, v, table)) or t.numel() <= 2 * 8 * (8 + 1) for t in saved), [
        tuple(t.shape) for t in saved
    ]
    assert sum(t.numel() for t in saved) == 3 * q.numel() + table.numel() + 2 * 8 * (8 + 1)


@pytest.mark.parametrize("shape", BLOCK_SHAPES, ids=BLOCK_IDS)
def test_noncausal_blocks_clamp_the_normalizer_as_the_reference(shape, small_blocks):
    """eps above some normalizers and below others: where phi(q) . z < eps the output divides by eps and
    no gradient flows through the normalizer; both sides of the clamp, across block boundaries."""
    q, k, v = _qkv(shape)
    q = q * 3 - 4  # phi(q) = exp(q) for most entries: normalizers spread over orders of magnitude
    den = (torch.nn.functional.elu(q) + 1) @ (torch.nn.functional.elu(k) + 1).sum(dim=-2).unsqueeze(-1)
    # eps between two neighbouring normalizers near the middle, far from both in relative terms, so that no
    # normalizer sits at the clamp's edge (where rounding would decide which side it falls)
    ranked = den.flatten().sort().values.double()
    gaps = ranked[1:] / ranked[:-1]
    quarter = len(ranked) // 4
    i = quarter + int(torch.argmax(gaps[quarter : 3 * quarter]))  # the widest gap of the middle half
    assert gaps[i] > 1 + 1e-3
    eps = float((ranked[i] * ranked[i + 1]).sqrt())
    assert 0 < float(den.min()) < eps < float(den.max())
    out, grads = grads_of(lambda q, k, v: ops.linear_attn(q, k, v, eps=eps, backend="blocked"), q, k, v)
    ref, ref_grads = grads_of(lambda q, k, v: naive_linear_attn(q, k, v, eps=eps), q, k, v)
    assert_rms_close(out, ref, 1e-5, "out")
    for name, g, g_ref in zip("qkv", grads, ref_grads):
        assert_rms_close(g, g_ref, 1e-5, f"d{name}")


@pytest.mark.parametrize("default_dtype", [torch.float64, torch.bfloat16], ids=["float64", "bfloat16"])
def test_blocked_work_buffers_are_fp32_whatever_the_default_dtype(default_dtype, small_blocks):
    """The token sums are taken in fp32 buffers that name their dtype: another default dtype changes nothing."""
    q, k, v = _qkv((3, 2, 37, 8))
    x, weight = torch.randn(3, 37, 20), torch.randn(48, 20) / 20**0.5
    expected = ops.linear_attn(q, k, v, backend="blocked")
    with torch.no_grad():
        expected_fused = fused_qkv_linear_attn(x, weight, None, 2)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(default_dtype)
    try:
        out = ops.linear_attn(q, k, v, backend="blocked")
        with torch.no_grad():
            fused = fused_qkv_linear_attn(x, weight, None, 2)
    finally:
        torch.set_default_dtype(previous)
    assert out.dtype == fused.dtype == torch.float32
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    torch.testing.assert_close(fused, expected_fused, rtol=0, atol=0)


@pytest.mark.parametrize("name", sorted(FEATURE_MAPS))
def test_fast_feature_map_and_derivative_match_the_definition(name):
    phi = FEATURE_MAPS[name]
    x = torch.cat([torch.randn(1000) * 4, torch.tensor([0.0, -0.0, 30.0, -30.0])]).requires_grad_(True)
    (expected_grad,) = torch.autograd.grad(phi(x).sum(), x)
    x = x.detach()
    out, scratch = torch.empty_like(x), torch.empty_like(x)
    fast = phi.fast_into(x, out, scratch)
    torch.testing.assert_close(fast, phi(x), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(phi.derivative_(fast.clone()), expected_grad, rtol=1e-6, atol=1e-7)
    fast_bf16 = phi.fast_into(x.bfloat16(), torch.empty_like(x), torch.empty_like(x))  # converts into fp32
    torch.testing.assert_close(fast_bf16, phi(x.bfloat16().float()), rtol=1e-6, atol=1e-7)


def _packed(b, n, heads, d, dtype=torch.float32):
    return torch.randn(b, n, 3 * heads * d, dtype=dtype)


def _split(qkv, heads):
    return qkv.unflatten(-1, (3, heads, -1)).permute(2, 0, 3, 1, 4).unbind(0)  # timm's layout


@pytest.mark.parametrize("feature_map", sorted(FEATURE_MAPS))
@pytest.mark.parametrize("b,n,heads", [(1, 53, 2), (2, 37, 3), (5, 6, 2)], ids=["B1-N53-H2", "B2-N37-H3", "B5-N6-H2"])
def test_packed_equals_split_heads(b, n, heads, feature_map, small_blocks):
    qkv = _packed(b, n, heads, 8)

    def split_then_linear(qkv):
        q, k, v = _split(qkv, heads)
        return naive_linear_attn(q, k, v, feature_map=feature_map).transpose(1, 2).flatten(2)

    out, (grad,) = grads_of(lambda t: packed_linear_attn(t, heads, feature_map)[0], qkv)
    ref, (ref_grad,) = grads_of(split_then_linear, qkv)
    assert_rms_close(out, ref, 1e-5, "out")
    assert_rms_close(grad, ref_grad, 1e-5, "dqkv")
    assert grad.shape == qkv.shape and grad.is_contiguous()


def test_packed_bf16_close_to_fp32():
    qkv = _packed(2, 40, 2, 8)
    out, _ = packed_linear_attn(qkv.bfloat16(), 2)
    assert out.dtype == torch.bfloat16
    assert_rms_close(out.float(), packed_linear_attn(qkv, 2)[0], 2e-2, "bf16")


def test_packed_saves_only_its_input_and_the_state():
    """A training step keeps the qkv projection (which the backward pass needs) and the (d, d + 1) state:
    no feature map or output of N tokens."""
    qkv = _packed(1, 64, 2, 8).requires_grad_(True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        packed_linear_attn(qkv, 2)
    assert any(t is qkv for t in saved)
    assert all(t is qkv or t.numel() <= 2 * 8 * (8 + 1) for t in saved), [tuple(t.shape) for t in saved]


def test_packed_values_are_the_projection_values_with_their_gradient():
    """The second output is the values of the projection; a gradient through it (a locality term)
    lands in the value slice of the projection's gradient, added to the attention's."""
    qkv = _packed(2, 30, 2, 8)
    weight = torch.randn(2, 30, 16)

    def through_values(qkv):
        out, values = packed_linear_attn(qkv, 2)
        return out + values * weight

    def reference(qkv):
        q, k, v = _split(qkv, 2)
        return naive_linear_attn(q, k, v).transpose(1, 2).flatten(2) + qkv[..., 32:] * weight

    out, (grad,) = grads_of(through_values, qkv)
    ref, (ref_grad,) = grads_of(reference, qkv)
    assert_rms_close(out, ref, 1e-5, "out")
    assert_rms_close(grad, ref_grad, 1e-5, "dqkv")
    assert torch.equal(packed_linear_attn(qkv, 2)[1], qkv[..., 32:])


def test_packed_bad_shape_raises():
    with pytest.raises(ValueError, match="num_heads"):
        packed_linear_attn(torch.randn(1, 5, 3 * 10), 4)


def _from_input_case(bias=True, norms=False):
    torch.manual_seed(1)
    heads, d, c_in = 3, 8, 20
    weight = torch.randn(3 * heads * d, c_in) / c_in**0.5
    qkv_bias = torch.randn(3 * heads * d) if bias else None
    norm = torch.nn.LayerNorm(d) if norms else None
    return torch.randn(2, 45, c_in), weight, qkv_bias, heads, norm


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("norms", [False, True], ids=["plain", "qk-norm"])
@pytest.mark.parametrize("feature_map", sorted(FEATURE_MAPS))
def test_from_input_equals_projection_then_linear(feature_map, norms, bias, small_blocks):
    x, weight, qkv_bias, heads, norm = _from_input_case(bias, norms)
    q, k, v = _split(torch.nn.functional.linear(x, weight, qkv_bias), heads)
    if norm is not None:
        q, k = norm(q), norm(k)
    expected = naive_linear_attn(q, k, v, feature_map=feature_map).transpose(1, 2).flatten(2)
    with torch.no_grad():
        out = fused_qkv_linear_attn(x, weight, qkv_bias, heads, feature_map, q_norm=norm, k_norm=norm)
    assert_rms_close(out, expected, 1e-5, "out")


@pytest.mark.parametrize("b,n", [(5, 6), (3, 37)], ids=["two-images-a-block", "odd-batch-split-images"])
def test_from_input_blocks_and_kept_values(b, n, small_blocks):
    """Blocks of several whole images and blocks of part of one image: the output, and the values written
    block by block into the kept (B, N, C) tensor, are those of the projection."""
    heads, d, c_in = 2, 8, 20
    x, weight, qkv_bias = torch.randn(b, n, c_in), torch.randn(3 * heads * d, c_in) / c_in**0.5, torch.randn(3 * heads * d)
    projection = torch.nn.functional.linear(x, weight, qkv_bias)
    q, k, v = _split(projection, heads)
    expected = naive_linear_attn(q, k, v).transpose(1, 2).flatten(2)
    with torch.no_grad():
        out, values = fused_qkv_linear_attn(x, weight, qkv_bias, heads, keep_values=True)
    assert len(blocked.token_blocks(b, n, heads * (d + 1), x.device)) > 1
    assert_rms_close(out, expected, 1e-5, "out")
    torch.testing.assert_close(values, projection[..., 2 * heads * d :])


def test_from_input_under_autocast_matches_the_unfused_path():
    x, weight, qkv_bias, heads, _ = _from_input_case()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = fused_qkv_linear_attn(x, weight, qkv_bias, heads)
        q, k, v = _split(torch.nn.functional.linear(x, weight, qkv_bias), heads)
        expected = ops.linear_attn(q, k, v).transpose(1, 2).flatten(2)
    assert out.dtype == expected.dtype == torch.bfloat16
    assert_rms_close(out.float(), expected.float(), 1e-5, "autocast")


def test_from_input_refuses_autograd():
    x, weight, qkv_bias, heads, _ = _from_input_case()
    with pytest.raises(ValueError, match="inference only"):
        fused_qkv_linear_attn(x, weight.requires_grad_(True), qkv_bias, heads)


def _saved_bytes(fn, *inputs) -> int:
    """Bytes of the tensors autograd keeps for the backward of ``fn(*inputs)`` (a view counts whole)."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.untyped_storage().nbytes()) or t, lambda t: t):
        fn(*inputs)
    return sum(saved)


def test_plain_checkpoint_keeps_the_inputs_not_the_feature_maps():
    """The path chosen for training off the CPU: equal to plain (outputs and gradients, exactly: the same
    kernels run again) while autograd keeps only q, k and v, where plain keeps fp32 feature maps of each."""
    q, k, v = (torch.randn(2, 3, 256, 16, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    plain = lambda q, k, v: ops.linear_attn(q, k, v, backend="plain")
    lean = lambda q, k, v: ops.linear_attn(q, k, v, backend="plain_checkpoint")
    out, grads = grads_of(plain, q, k, v)
    out_lean, grads_lean = grads_of(lean, q, k, v)
    assert torch.equal(out, out_lean) and all(torch.equal(a, b) for a, b in zip(grads, grads_lean))
    inputs = 3 * q.untyped_storage().nbytes()
    assert _saved_bytes(lean, q, k, v) <= inputs
    assert _saved_bytes(plain, q, k, v) >= 3 * inputs  # fp32 copies: twice the bytes of each bf16 input, and more


@pytest.mark.parametrize("backend", ["blocked", "plain", "plain_checkpoint"])
def test_fp16_sums_over_65536_tokens_do_not_overflow(backend):
    """phi(k)^T v summed over 65,536 tokens of values near 2 reaches ~2.6e5, past fp16's 65,504: the sums
    run in fp32, so the fp16 result is finite and equals the fp64 sums over the same fp16 inputs to fp16's
    rounding of the result (half an ulp: 2^-11 relative) plus fp32's error in sums of 65,536 positive terms
    (at most about 65,536 * 2^-24 = 2^-8 in the worst case, about sqrt(65,536) * 2^-24 = 2^-16 for blocked or
    pairwise sums, which the matmuls use): rtol 2^-11 + 2^-16."""
    q, k = (torch.rand(1, 1, 65536, 8) for _ in range(2))
    v = 1.5 + torch.rand(1, 1, 65536, 8)
    half = ops.linear_attn(*(t.half() for t in (q, k, v)), backend=backend)
    qd, kd, vd = (t.half().double() for t in (q, k, v))
    phi_q, phi_k = (torch.nn.functional.elu(t) + 1 for t in (qd, kd))  # the sums in fp64 (naive's N x N would not fit)
    reference = (phi_q @ (phi_k.transpose(-2, -1) @ vd)) / (phi_q @ phi_k.sum(-2, keepdim=True).transpose(-2, -1))
    assert half.dtype == torch.float16 and torch.isfinite(half).all()
    torch.testing.assert_close(half.double(), reference, rtol=2**-11 + 2**-16, atol=0)


@pytest.mark.parametrize("n", [37, KV_CHUNK, 2 * KV_CHUNK + 37])
def test_bf16_inference_runs_in_bf16_within_its_roundings(n):
    """bf16 q, k, v without autograd (a tail only, whole chunks only, both): the plain path runs its matmuls in
    bf16. It rounds to bf16 phi(q) and phi(k) (each within 2^-9 of elu + 1, whose sums are at least the
    count of terms), each partial sum of phi(k)^T v, their fp32 total and the normalizer's sums before the
    last two matmuls, the numerator, the normalizer and the quotient: eight roundings, each within
    u = 2^-8 of what it enters, so 8 u in the worst case. With autograd the same call takes the
    fp32 sums: one rounding of the result, 2 u allowing for the rounded inputs' products."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, n, 16, generator=gen).bfloat16() for _ in range(3))
    out = ops.linear_attn(q, k, v, backend="plain")
    qd, kd, vd = (t.double() for t in (q, k, v))
    phi_q, phi_k = (torch.nn.functional.elu(t) + 1 for t in (qd, kd))
    expected = (phi_q @ (phi_k.transpose(-2, -1) @ vd)) / (phi_q @ phi_k.sum(-2, keepdim=True).transpose(-2, -1))
    assert out.dtype == torch.bfloat16
    assert_rms_close(out, expected, 8 * 2**-8, "bf16 path")
    with_grad = ops.linear_attn(q.requires_grad_(True), k, v, backend="plain").detach()
    assert_rms_close(with_grad, expected, 2 * 2**-8, "fp32 sums, rounded once to bf16")
    assert not torch.equal(out, with_grad)

