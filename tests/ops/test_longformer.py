"""longformer (local windows + global tokens) vs its explicit-mask twin."""
from __future__ import annotations

import pytest
import torch

from tests.helpers import assert_rms_close, grads_of
from visattn.ops import longformer_attn, neighborhood_attn, sparse_attn
from visattn.ops.longformer import longformer_mask, naive_longformer_attn

# (B, heads, H, W, global tokens, local, window options, head_dim)
CASES = [
    (2, 3, 7, 5, 0, "neighborhood", {"kernel_size": 3, "tile_size": 4}, 8),
    (2, 3, 7, 5, 1, "neighborhood", {"kernel_size": 3, "tile_size": 4}, 8),
    (1, 2, 5, 9, 2, "neighborhood", {"kernel_size": 5, "tile_size": 8}, 8),
    (1, 2, 12, 10, 2, "neighborhood", {"kernel_size": 7, "tile_size": 3}, 16),
    (2, 1, 4, 11, 1, "neighborhood", {"kernel_size": 7, "tile_size": 8}, 8),  # k > H
    (2, 3, 7, 5, 0, "sparse", {"block_size": 3, "halo": 1}, 8),
    (2, 3, 7, 5, 1, "sparse", {"block_size": 3, "halo": 1}, 8),
    (1, 2, 5, 9, 2, "sparse", {"block_size": 4, "halo": 2}, 8),
    (1, 2, 12, 10, 2, "sparse", {"block_size": 8, "halo": 3}, 16),
    (2, 1, 4, 11, 1, "sparse", {"block_size": 2, "halo": 0}, 8),
]


def _case_id(b, h, gh, gw, g, local, opts, d):
    if local == "neighborhood":
        window = f"k{opts['kernel_size']}-t{opts['tile_size']}"
    else:
        window = f"b{opts['block_size']}-halo{opts['halo']}"
    return f"B{b}-H{h}-grid{gh}x{gw}-g{g}-{local}-{window}-d{d}"


IDS = [_case_id(*case) for case in CASES]


def _qkv(b, heads, n, d):
    return [torch.randn(b, heads, n, d) for _ in range(3)]


def _reference_options(opts):
    return {key: value for key, value in opts.items() if key != "tile_size"}


@pytest.mark.parametrize("b,heads,gh,gw,g,local,opts,d", CASES, ids=IDS)
def test_matches_reference_fp32(b, heads, gh, gw, g, local, opts, d):
    q, k, v = _qkv(b, heads, g + gh * gw, d)
    out, grads = grads_of(lambda q, k, v: longformer_attn(q, k, v, (gh, gw), g, local, **opts), q, k, v)
    ref, ref_grads = grads_of(
        lambda q, k, v: naive_longformer_attn(q, k, v, (gh, gw), g, local, **_reference_options(opts)), q, k, v
    )
    assert_rms_close(out, ref, 1e-5, "out")
    for name, gr, gr_ref in zip("qkv", grads, ref_grads):
        assert_rms_close(gr, gr_ref, 1e-5, f"d{name}")


@pytest.mark.parametrize("b,heads,gh,gw,g,local,opts,d", CASES, ids=IDS)
def test_matches_reference_bf16(b, heads, gh, gw, g, local, opts, d):
    q, k, v = _qkv(b, heads, g + gh * gw, d)
    out, grads = grads_of(
        lambda q, k, v: longformer_attn(q, k, v, (gh, gw), g, local, **opts), *(x.bfloat16() for x in (q, k, v))
    )
    ref, ref_grads = grads_of(
        lambda q, k, v: naive_longformer_attn(q, k, v, (gh, gw), g, local, **_reference_options(opts)), q, k, v
    )
    assert out.dtype == torch.bfloat16
    assert_rms_close(out, ref, 2e-2, "out")
    for name, gr, gr_ref in zip("qkv", grads, ref_grads):
        assert_rms_close(gr, gr_ref, 2e-2, f"d{name}")


def test_no_global_tokens_is_the_local_op():
    gh, gw = 6, 7
    q, k, v = _qkv(2, 2, gh * gw, 8)
    local_nb = neighborhood_attn(q, k, v, (gh, gw), 3, tile_size=4)
    local_sp = sparse_attn(q, k, v, (gh, gw), 3, 1)
    assert_rms_close(longformer_attn(q, k, v, (gh, gw), 0, "neighborhood", kernel_size=3, tile_size=4), local_nb, 1e-6)
    assert_rms_close(longformer_attn(q, k, v, (gh, gw), 0, "sparse", block_size=3, halo=1), local_sp, 1e-6)


def test_global_tokens_share_the_softmax_with_the_window():
    """A global key with a huge score takes (almost) all the weight of every patch query: one normaliser."""
    gh, gw, d = 5, 4, 8
    q, k, v = _qkv(1, 1, 1 + gh * gw, d)
    q[:, :, 1:] = q[:, :, 1:].abs() + 1.0  # positive patch queries ...
    k[:, :, 0] = 50.0  # ... give the global key a score above 100, the local keys a few units
    out = longformer_attn(q, k, v, (gh, gw), 1, "neighborhood", kernel_size=3)
    torch.testing.assert_close(out[:, :, 1:], v[:, :, :1].expand(-1, -1, gh * gw, -1), rtol=1e-4, atol=1e-4)


def test_mask_rows_and_columns():
    allowed = longformer_mask((3, 4), 2, "sparse", block_size=2, halo=0)
    assert allowed[:2].all() and allowed[:, :2].all()
    assert allowed[2:, 2:].sum(dim=-1).tolist() == [4, 4, 4, 4, 4, 4, 4, 4, 2, 2, 2, 2]


@pytest.mark.parametrize(
    "grid,g,kwargs,match",
    [
        ((5, 4), 1, {"local": "dilated"}, "local"),
        ((5, 4), 1, {"local": "neighborhood", "kernel_size": 2}, "kernel_size"),
        ((5, 4), 1, {"local": "sparse", "halo": -1}, "halo"),
        ((4, 4), 1, {}, "grid"),  # 1 + 16 != 21 tokens
        ((5, 4), -1, {}, "num_global_tokens"),
    ],
    ids=["local-unknown", "k-even", "halo-negative", "grid-mismatch", "g-negative"],
)
def test_bad_input_raises(grid, g, kwargs, match):
    q, k, v = _qkv(1, 1, 21, 8)
    with pytest.raises(ValueError, match=match):
        longformer_attn(q, k, v, grid, g, **kwargs)
