import pytest
import torch

from tests.helpers import assert_rms_close, grads_of
from visattn import ops
from visattn.ops.softmax import naive_softmax_attn


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("shape", [(1, 1, 5, 4), (2, 3, 37, 8)], ids=["B1-H1-N5-d4", "B2-H3-N37-d8"])
def test_softmax_matches_reference(shape, causal):
    q, k, v = (torch.randn(shape) for _ in range(3))
    out, grads = grads_of(lambda q, k, v: ops.softmax_attn(q, k, v, is_causal=causal), q, k, v)
    ref, ref_grads = grads_of(lambda q, k, v: naive_softmax_attn(q, k, v, is_causal=causal), q, k, v)
    assert_rms_close(out, ref, 1e-5, "out")
    for g, g_ref in zip(grads, ref_grads):
        assert_rms_close(g, g_ref, 1e-5, "grad")


def test_softmax_bf16_close_to_fp32():
    q, k, v = (torch.randn(2, 2, 40, 16) for _ in range(3))
    out = ops.softmax_attn(q.bfloat16(), k.bfloat16(), v.bfloat16())
    assert_rms_close(out.float(), naive_softmax_attn(q, k, v), 2e-2, "bf16")


def test_softmax_rejects_bad_shapes():
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(ValueError, match="agree"):
        ops.softmax_attn(q, q[:, :1], q)
