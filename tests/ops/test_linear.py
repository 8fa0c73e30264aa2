import pytest
import torch

from tests.helpers import assert_rms_close, grads_of
from visattn import ops
from visattn.ops.linear import FEATURE_MAPS

SHAPES = [(1, 1, 5, 4), (2, 3, 37, 8), (1, 2, 130, 16)]  # N not a multiple of any chunk size used below
SHAPE_IDS = [f"B{b}-H{h}-N{n}-d{d}" for b, h, n, d in SHAPES]


def _qkv(shape, dtype=torch.float32):
    return [torch.randn(shape, dtype=dtype) for _ in range(3)]


@pytest.mark.parametrize("feature_map", sorted(FEATURE_MAPS))
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_linear_matches_reference_fp32(shape, causal, feature_map):
    q, k, v = _qkv(shape)
    out, grads = grads_of(lambda q, k, v: ops.linear(q, k, v, feature_map=feature_map, causal=causal, chunk_size=16), q, k, v)
    ref, ref_grads = grads_of(lambda q, k, v: ops.linear_reference(q, k, v, feature_map=feature_map, causal=causal), q, k, v)
    assert_rms_close(out, ref, 1e-5, "out")
    for name, g, g_ref in zip("qkv", grads, ref_grads):
        assert_rms_close(g, g_ref, 1e-5, f"d{name}")


@pytest.mark.parametrize("chunk_size", [1, 7, 64, 1000])
def test_causal_result_independent_of_chunk_size(chunk_size):
    q, k, v = _qkv((2, 2, 50, 8))
    out, grads = grads_of(lambda q, k, v: ops.linear(q, k, v, causal=True, chunk_size=chunk_size), q, k, v)
    ref, ref_grads = grads_of(lambda q, k, v: ops.linear_reference(q, k, v, causal=True), q, k, v)
    assert_rms_close(out, ref, 1e-5, "out")
    for g, g_ref in zip(grads, ref_grads):
        assert_rms_close(g, g_ref, 1e-5, "grad")


def test_causal_chunked_equals_recurrent_steps():
    q, k, v = _qkv((2, 3, 29, 8))
    chunked = ops.linear(q, k, v, causal=True, chunk_size=8)
    state, steps = None, []
    for t in range(q.shape[2]):
        out_t, state = ops.linear_step(q[:, :, t], k[:, :, t], v[:, :, t], state)
        steps.append(out_t)
    assert_rms_close(torch.stack(steps, dim=2), chunked, 1e-5, "recurrent vs chunked")
    assert_rms_close(chunked, ops.linear_reference(q, k, v, causal=True), 1e-5, "chunked vs masked reference")


def test_causal_first_token_sees_only_itself():
    q, k, v = _qkv((1, 1, 6, 4))
    out = ops.linear(q, k, v, causal=True)
    torch.testing.assert_close(out[:, :, 0], v[:, :, 0], rtol=1e-5, atol=1e-6)  # weights normalise to 1 on one key


def test_constant_values_come_back():
    q, k, _ = _qkv((2, 2, 33, 8))
    v = torch.full((2, 2, 33, 8), 3.5)
    for causal in (False, True):
        torch.testing.assert_close(ops.linear(q, k, v, causal=causal), v, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_bf16_close_to_fp32_reference(causal):
    q, k, v = _qkv((2, 2, 70, 16))
    out = ops.linear(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=causal, chunk_size=16)
    assert out.dtype == torch.bfloat16
    assert_rms_close(out.float(), ops.linear_reference(q, k, v, causal=causal), 2e-2, "bf16")


def test_autocast_bf16_keeps_fp32_sums():
    q, k, v = _qkv((1, 2, 40, 8))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ops.linear(q, k, v)
    assert_rms_close(out.float(), ops.linear_reference(q, k, v), 1e-5, "fp32 inputs under autocast stay fp32")


def test_long_sequence_bf16_is_finite_and_close_to_fp32():
    """65,536 tokens (a 256x256 grid), 6 heads of d=64, under bf16 autocast: an fp16 sum would overflow."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 6, 65536, 64, generator=gen) for _ in range(3))
    expected = ops.linear(q, k, v)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ops.linear(q.bfloat16(), k.bfloat16(), v.bfloat16())
    assert torch.isfinite(out).all()
    assert_rms_close(out.float(), expected, 2e-2, "bf16 at N=65536")


def test_relu_feature_map_guards_a_zero_normalizer():
    q = -torch.ones(1, 1, 4, 2)  # relu(q) = 0: the normalizer is 0 and must not divide by zero
    k, v = torch.randn(1, 1, 4, 2), torch.randn(1, 1, 4, 2)
    out = ops.linear(q, k, v, feature_map="relu")
    assert torch.isfinite(out).all() and torch.count_nonzero(out) == 0


def test_bad_inputs_raise():
    q, k, v = _qkv((1, 2, 8, 4))
    with pytest.raises(ValueError, match="feature_map"):
        ops.linear(q, k, v, feature_map="softplus")
    with pytest.raises(ValueError, match=r"\(B, heads, N, d\)"):
        ops.linear(q[0], k[0], v[0])
    with pytest.raises(ValueError, match="agree"):
        ops.linear(q, k[:, :, :5], v)
    with pytest.raises(ValueError, match="chunk_size"):
        ops.linear(q, k, v, causal=True, chunk_size=0)
