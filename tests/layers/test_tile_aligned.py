"""The layers' tile-aligned options (``tile_aligned``, ``aligned_tile`` of neighborhood and sparse): the mixing
against the twins' explicit masks, outputs and gradients, on odd non-square grids with prefix tokens; the options
from text, for both types at once. Their cost formulas: tests/layers/test_cost.py."""
from __future__ import annotations

import pytest
import torch

from tests.helpers import assert_rms_close, grads_of
from visattn.layers.options import options_per_type, parse_key_values
from visattn.layers.registry import get_attention
from visattn.ops.local import naive_masked_attn, with_prefix_tokens
from visattn.ops.neighborhood import neighborhood_mask
from visattn.ops.sparse import sparse_mask

DIM, HEADS = 32, 2

LAYERS = [
    ("neighborhood", {"tile_aligned": True, "kernel_size": 5, "aligned_tile": [4, 3]}),
    ("neighborhood", {"tile_aligned": True}),
    ("sparse", {"tile_aligned": True, "halo": 2, "aligned_tile": 3}),
    ("sparse", {"tile_aligned": True, "halo": 0}),
]
LAYER_IDS = ["nb-k5-tile4x3", "nb-default", "sparse-halo2-tile3", "sparse-swin"]


def _allowed(layer) -> torch.Tensor:
    """(N, N) from the twin's mask: prefix rows see every token, patch rows their tile-aligned window."""
    if layer.name == "neighborhood":
        window = neighborhood_mask(layer.grid, layer.kernel_size, aligned_tile=layer.aligned_tile)
    else:
        window = sparse_mask(layer.grid, layer.block_size, layer.halo, aligned_tile=layer.aligned_tile)
    return with_prefix_tokens(window, layer.num_prefix_tokens)


@pytest.mark.parametrize("grid,p", [((13, 11), 2), ((9, 35), 1)], ids=["grid13x11-p2", "grid9x35-p1"])
@pytest.mark.parametrize("name,opts", LAYERS, ids=LAYER_IDS)
def test_mix_matches_the_twin_outputs_and_gradients(name, opts, grid, p):
    layer = get_attention(name)(DIM, HEADS, qkv_bias=True, **opts)
    layer.set_grid(grid, p)
    q, k, v = (torch.randn(2, HEADS, p + grid[0] * grid[1], DIM // HEADS) for _ in range(3))
    out, grads = grads_of(lambda q, k, v: layer.mix(q, k, v, grid=grid, attn_mask=None, is_causal=False), q, k, v)
    ref, ref_grads = grads_of(lambda q, k, v: naive_masked_attn(q, k, v, _allowed(layer)), q, k, v)
    assert_rms_close(out, ref, 1e-5, "out")
    for letter, g, g_ref in zip("qkv", grads, ref_grads):
        assert_rms_close(g, g_ref, 1e-5, f"d{letter}")
    layer(torch.randn(2, p + grid[0] * grid[1], DIM)).square().sum().backward()
    assert all(param.grad is not None for param in layer.parameters())


def test_the_options_change_the_function_and_show():
    exact, aligned = (get_attention("sparse")(DIM, HEADS, tile_aligned=flag) for flag in (False, True))
    aligned.load_state_dict(exact.state_dict())
    for layer in (exact, aligned):
        layer.set_grid((20, 36), 1)
    x = torch.randn(1, 1 + 20 * 36, DIM)
    assert not torch.allclose(exact(x), aligned(x))
    assert "aligned_tile=(8, 16), halo=3" in repr(aligned) and "block_size=8" in repr(exact)


def test_one_flat_option_reaches_both_types():
    """``--attn-kwargs tile_aligned=true,aligned_tile=[4,8]`` for a grid of neighborhood and sparse rows."""
    text = "tile_aligned=true,aligned_tile=[4,8]"
    per_type, unused = options_per_type(["neighborhood", "sparse"], parse_key_values(text))
    assert unused == []
    for name in ("neighborhood", "sparse"):
        assert per_type[name] == {"tile_aligned": True, "aligned_tile": [4, 8]}
        layer = get_attention(name)(DIM, HEADS, **per_type[name])
        assert layer.tile_aligned and layer.aligned_tile == (4, 8)


@pytest.mark.parametrize(
    "opts,match",
    [
        ({"tile_aligned": "yes"}, "tile_aligned must be True or False, got 'yes'"),
        ({"aligned_tile": [8, 0]}, r"aligned_tile must be \(rows, cols\), two integers >= 1 \(or one\), got \[8, 0\]"),
        ({"aligned_tile": 2.5}, "aligned_tile must be"),
    ],
    ids=["flag-text", "tile-zero", "tile-float"],
)
@pytest.mark.parametrize("name", ["neighborhood", "sparse"])
def test_bad_options_raise(name, opts, match):
    with pytest.raises(ValueError, match=match):
        get_attention(name)(DIM, HEADS, **opts)
