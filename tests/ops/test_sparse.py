"""sparse (blocked + halo) vs its explicit-mask twin, the block/halo window semantics, prefix tokens."""
from __future__ import annotations

import pytest
import torch

from tests.helpers import assert_rms_close, grads_of
from visattn.ops import sparse_attn
from visattn.ops.sparse import naive_sparse_attn, sparse_mask

# (B, heads, H, W, block_size, halo, head_dim)
CASES = [
    (2, 3, 7, 5, 3, 1, 8),  # partial last blocks on both axes
    (1, 2, 5, 9, 4, 2, 8),
    (2, 1, 12, 10, 8, 3, 16),
    (1, 2, 12, 10, 4, 0, 8),  # no halo: non-overlapping blocks
    (1, 1, 9, 8, 2, 5, 8),  # halo wider than the block
    (2, 2, 4, 11, 8, 3, 8),  # block larger than H
    (2, 1, 1, 6, 2, 1, 8),  # a single row
    (1, 2, 6, 5, 1, 0, 8),  # 1 x 1 blocks, no halo: each query sees itself
]
IDS = [f"B{b}-H{h}-grid{gh}x{gw}-b{bs}-halo{hl}-d{d}" for b, h, gh, gw, bs, hl, d in CASES]


def _qkv(b, heads, gh, gw, d, p=0):
    """q, k, v (B, heads, P + H * W, d): the prefix tokens first, then the patches in raster order."""
    return [torch.randn(b, heads, p + gh * gw, d) for _ in range(3)]


@pytest.mark.parametrize("b,heads,gh,gw,bs,hl,d", CASES, ids=IDS)
def test_matches_reference_fp32(b, heads, gh, gw, bs, hl, d):
    q, k, v = _qkv(b, heads, gh, gw, d)
    out, grads = grads_of(lambda q, k, v: sparse_attn(q, k, v, (gh, gw), bs, hl), q, k, v)
    ref, ref_grads = grads_of(lambda q, k, v: naive_sparse_attn(q, k, v, (gh, gw), bs, hl), q, k, v)
    assert_rms_close(out, ref, 1e-5, "out")
    for name, g, g_ref in zip("qkv", grads, ref_grads):
        assert_rms_close(g, g_ref, 1e-5, f"d{name}")


@pytest.mark.parametrize("b,heads,gh,gw,bs,hl,d", CASES, ids=IDS)
def test_matches_reference_bf16(b, heads, gh, gw, bs, hl, d):
    q, k, v = _qkv(b, heads, gh, gw, d)
    out, grads = grads_of(lambda q, k, v: sparse_attn(q, k, v, (gh, gw), bs, hl), *(x.bfloat16() for x in (q, k, v)))
    ref, ref_grads = grads_of(lambda q, k, v: naive_sparse_attn(q, k, v, (gh, gw), bs, hl), q, k, v)
    assert out.dtype == torch.bfloat16
    assert_rms_close(out, ref, 2e-2, "out")
    for name, g, g_ref in zip("qkv", grads, ref_grads):
        assert_rms_close(g, g_ref, 2e-2, f"d{name}")


@pytest.mark.parametrize(
    "length,block,halo,windows",
    [
        (7, 3, 1, [[0, 1, 2, 3]] * 3 + [[2, 3, 4, 5, 6]] * 3 + [[5, 6]]),
        (5, 2, 0, [[0, 1]] * 2 + [[2, 3]] * 2 + [[4]]),
        (4, 8, 3, [[0, 1, 2, 3]] * 4),
    ],
    ids=["L7-b3-halo1", "L5-b2-halo0", "L4-b8-halo3"],
)
def test_block_plus_halo_cut_at_the_border(length, block, halo, windows):
    """The reference mask itself, checked against windows written out by hand."""
    for grid in ((1, length), (length, 1)):
        allowed = sparse_mask(grid, block, halo)
        assert [row.nonzero().flatten().tolist() for row in allowed] == windows


def test_one_block_without_halo_is_full_attention():
    q, k, v = _qkv(2, 2, 5, 6, 8)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert_rms_close(sparse_attn(q, k, v, (5, 6), 6, 0), ref, 1e-5)


def test_same_input_same_output_bit_for_bit():
    q, k, v = _qkv(2, 2, 9, 7, 8)
    assert torch.equal(sparse_attn(q, k, v, (9, 7), 4, 2), sparse_attn(q, k, v, (9, 7), 4, 2))


def test_scale_and_dropout_are_passed_on():
    q, k, v = _qkv(1, 2, 6, 5, 8)
    grid = (6, 5)
    assert_rms_close(sparse_attn(q, k, v, grid, 2, 1, scale=0.3), naive_sparse_attn(q, k, v, grid, 2, 1, scale=0.3), 1e-5)
    assert not torch.allclose(sparse_attn(q, k, v, grid, 2, 1, dropout_p=0.5), sparse_attn(q, k, v, grid, 2, 1))


@pytest.mark.parametrize(
    "block_size,halo,match",
    [(0, 1, "block_size"), (2.0, 1, "block_size"), (2, -1, "halo"), (2, 1.5, "halo")],
    ids=["block-zero", "block-float", "halo-negative", "halo-float"],
)
def test_bad_options_raise(block_size, halo, match):
    q, k, v = _qkv(1, 1, 4, 4, 8)
    with pytest.raises(ValueError, match=match):
        sparse_attn(q, k, v, (4, 4), block_size, halo)


def test_bad_shapes_raise():
    q, k, v = _qkv(1, 1, 4, 4, 8)
    with pytest.raises(ValueError, match="B, heads, N, d"):
        sparse_attn(*(t.unflatten(2, (4, 4)) for t in (q, k, v)), (4, 4), 2, 1)
    with pytest.raises(ValueError, match="head_dim"):
        sparse_attn(q, k[..., :4], v, (4, 4), 2, 1)
    with pytest.raises(ValueError, match="num_prefix_tokens=1"):
        sparse_attn(q, k, v, (4, 4), 2, 1, num_prefix_tokens=1)


