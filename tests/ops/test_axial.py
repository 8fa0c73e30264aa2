"""axial vs its explicit-mask twin, and what row-then-column attention must give."""
from __future__ import annotations

import pytest
import torch

from tests.helpers import assert_rms_close, grads_of
from visattn.ops import axial_attn, packed_axial_attn
from visattn.ops.axial.naive import naive_axial_attn

# (B, heads, H, W, prefix tokens, head_dim)
CASES = [
    (1, 1, 7, 5, 0, 8),
    (2, 3, 7, 5, 1, 8),
    (2, 2, 3, 8, 3, 16),
    (1, 2, 3, 8, 0, 8),
    (2, 1, 1, 6, 1, 8),
    (1, 3, 1, 6, 3, 8),
    (2, 2, 6, 1, 0, 8),
    (1, 1, 6, 1, 3, 16),
]
IDS = [f"B{b}-H{h}-grid{gh}x{gw}-p{p}-d{d}" for b, h, gh, gw, p, d in CASES]


def _qkv(b, heads, gh, gw, p, d, dtype=torch.float32):
    n = p + gh * gw
    return [torch.randn(b, heads, n, d, dtype=dtype) for _ in range(3)]


@pytest.mark.parametrize("b,heads,gh,gw,p,d", CASES, ids=IDS)
def test_matches_reference_fp32(b, heads, gh, gw, p, d):
    q, k, v = _qkv(b, heads, gh, gw, p, d)
    out, grads = grads_of(lambda q, k, v: axial_attn(q, k, v, (gh, gw), p), q, k, v)
    ref, ref_grads = grads_of(lambda q, k, v: naive_axial_attn(q, k, v, (gh, gw), p), q, k, v)
    assert_rms_close(out, ref, 1e-5, "out")
    for name, g, g_ref in zip("qkv", grads, ref_grads):
        assert_rms_close(g, g_ref, 1e-5, f"d{name}")


@pytest.mark.parametrize("b,heads,gh,gw,p,d", CASES, ids=IDS)
def test_matches_reference_bf16(b, heads, gh, gw, p, d):
    q, k, v = _qkv(b, heads, gh, gw, p, d)
    out, grads = grads_of(lambda q, k, v: axial_attn(q, k, v, (gh, gw), p), *(t.bfloat16() for t in (q, k, v)))
    ref, ref_grads = grads_of(lambda q, k, v: naive_axial_attn(q, k, v, (gh, gw), p), q, k, v)
    assert out.dtype == torch.bfloat16
    assert_rms_close(out, ref, 2e-2, "out")
    for name, g, g_ref in zip("qkv", grads, ref_grads):
        assert_rms_close(g, g_ref, 2e-2, f"d{name}")


@pytest.mark.parametrize(
    "gh,gw,p", [(4, 3, 0), (4, 3, 2), (1, 5, 1), (5, 1, 0)], ids=["grid4x3-p0", "grid4x3-p2", "grid1x5-p1", "grid5x1-p0"]
)
def test_every_output_sees_every_value(gh, gw, p):
    """Two hops reach the whole grid: d out_t / d v_s != 0 for every pair (t, s)."""
    q, k, v = _qkv(1, 1, gh, gw, p, 4)
    v.requires_grad_(True)
    out = axial_attn(q, k, v, (gh, gw), p)
    for t in range(out.shape[2]):
        (grad_v,) = torch.autograd.grad(out[:, :, t].sum(), v, retain_graph=True)
        reached = grad_v.abs().sum(dim=-1).flatten() > 0  # (N,)
        assert reached.all(), f"output token {t} does not see value tokens {(~reached).nonzero().flatten().tolist()}"


@pytest.mark.parametrize("p", [0, 2], ids=["p0", "p2"])
def test_constant_values_come_back(p):
    """Each softmax averages, so constant values pass both hops unchanged, whatever q and k."""
    q, k, _ = _qkv(2, 3, 5, 4, p, 8)
    constant = torch.randn(8)
    v = constant.expand(2, 3, p + 20, 8)
    torch.testing.assert_close(axial_attn(q, k, v, (5, 4), p), v.expand_as(q), rtol=1e-5, atol=1e-5)


def test_uniform_scores_give_the_grid_mean():
    """q = 0: the row hop gives row means, the column hop averages them into the grid mean."""
    q, k, v = _qkv(2, 2, 3, 7, 0, 8)
    out = axial_attn(torch.zeros_like(q), k, v, (3, 7))
    torch.testing.assert_close(out, v.mean(dim=2, keepdim=True).expand_as(v), rtol=1e-5, atol=1e-5)


def test_scale_and_dropout_are_passed_on():
    q, k, v = _qkv(1, 2, 3, 4, 1, 8)
    assert_rms_close(axial_attn(q, k, v, (3, 4), 1, scale=0.3), naive_axial_attn(q, k, v, (3, 4), 1, scale=0.3), 1e-5)
    assert torch.equal(axial_attn(q, k, v, (3, 4), 1, dropout_p=1.0), torch.zeros_like(q))


@pytest.mark.parametrize(
    "shape,grid,p",
    [
        ((1, 2, 13, 8), (3, 4), 0),
        ((1, 2, 12, 8), (3, 4), 1),
        ((1, 2, 12, 8), (3, 4), -1),
        ((2, 12, 8), (3, 4), 0),
        ((1, 2, 12, 8), (0, 12), 0),
    ],
    ids=["tokens-vs-grid", "prefix-vs-grid", "negative-prefix", "rank3", "empty-grid"],
)
def test_bad_input_raises(shape, grid, p):
    x = torch.randn(shape)
    with pytest.raises(ValueError):
        axial_attn(x, x, x, grid, p)


def _saved_by_forward(fn, *inputs):
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = fn(*inputs)
    return out, [t for t in saved if t is not None]


def test_training_saves_q_k_v_and_the_row_hop():
    """On the CPU kernels autograd keeps q, k, v, the output (the next layer keeps it anyway), the row
    hop's keys and values (the prefix concatenations) and output, and per-query log-sum-exps: three
    tensors of N tokens of its own, and no column copy."""
    q, k, v = (t.requires_grad_(True) for t in _qkv(1, 2, 6, 5, 1, 8))
    out, saved = _saved_by_forward(lambda q, k, v: axial_attn(q, k, v, (6, 5), 1), q, k, v)
    own = [t for t in saved if not any(t is x for x in (q, k, v)) and t.data_ptr() != out.data_ptr()]
    patches = q[:, :, 1:].numel()
    assert sorted(t.numel() for t in own if t.numel() >= patches) == [patches, patches + 6 * 2 * 8, patches + 6 * 2 * 8]
    assert all(t.numel() >= patches or t.numel() <= 2 * q.shape[2] for t in own)
    out.square().sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_training_under_autocast_recomputes_instead():
    """Elsewhere (autocast, dropout, other devices) the hops are recomputed in the backward pass
    (activation checkpointing): autograd keeps q, k and v only."""
    q, k, v = _qkv(2, 2, 5, 4, 1, 8)

    def autocast_axial(q, k, v):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return axial_attn(q, k, v, (5, 4), 1)

    inputs = tuple(t.clone().requires_grad_(True) for t in (q, k, v))
    _, saved = _saved_by_forward(autocast_axial, *inputs)
    # torch 2.11 and older's non-reentrant checkpoint also saves an empty tensor, which holds no memory
    kept = [t for t in saved if t.numel()]
    assert sorted(map(id, kept)) == sorted(map(id, inputs))
    out, grads = grads_of(autocast_axial, q, k, v)
    ref, ref_grads = grads_of(lambda q, k, v: naive_axial_attn(q, k, v, (5, 4), 1), q, k, v)
    assert_rms_close(out.float(), ref, 2e-2, "out")
    for name, g, g_ref in zip("qkv", grads, ref_grads):
        assert_rms_close(g, g_ref, 2e-2, f"d{name}")


@pytest.mark.parametrize("b,heads,gh,gw,p,d", CASES[:4], ids=IDS[:4])
def test_inference_equals_training_output(b, heads, gh, gw, p, d):
    q, k, v = _qkv(b, heads, gh, gw, p, d)
    with torch.no_grad():
        inferred = axial_attn(q, k, v, (gh, gw), p)
    trained = axial_attn(*(t.requires_grad_(True) for t in (q, k, v)), (gh, gw), p)
    torch.testing.assert_close(inferred, trained.detach(), rtol=0, atol=0)
    merged = inferred.transpose(1, 2).reshape(b, q.shape[2], heads * d)
    assert merged.data_ptr() == inferred.data_ptr()  # token-major: merging the heads is a view


@pytest.mark.parametrize("b,heads,gh,gw,p", [(1, 2, 6, 5, 1), (2, 3, 4, 7, 0), (2, 2, 3, 8, 3)], ids=["B1-H2-grid6x5-p1", "B2-H3-grid4x7-p0", "B2-H2-grid3x8-p3"])
def test_packed_equals_split_heads(b, heads, gh, gw, p):
    """packed_axial_attn on a qkv projection (B, N, 3 C) = the reference on its timm-layout q, k, v; the
    gradient comes back as one (B, N, 3 C) tensor."""
    qkv = torch.randn(b, p + gh * gw, 3 * heads * 8)

    def reference(qkv):
        q, k, v = qkv.unflatten(-1, (3, heads, 8)).permute(2, 0, 3, 1, 4).unbind(0)
        return naive_axial_attn(q, k, v, (gh, gw), p).transpose(1, 2).flatten(2)

    out, (grad,) = grads_of(lambda t: packed_axial_attn(t, heads, (gh, gw), p), qkv)
    ref, (ref_grad,) = grads_of(reference, qkv)
    assert_rms_close(out, ref, 1e-5, "out")
    assert_rms_close(grad, ref_grad, 1e-5, "dqkv")
    assert grad.is_contiguous()
    with torch.no_grad():
        assert_rms_close(packed_axial_attn(qkv, heads, (gh, gw), p), ref, 1e-5, "inference")
    with pytest.raises(ValueError, match="num_heads"):
        packed_axial_attn(qkv[..., 1:], heads, (gh, gw), p)
