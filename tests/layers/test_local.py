"""The 2D local attention layers: neighborhood, sparse, longformer."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from tests.helpers import assert_rms_close
from visattn.layers.longformer import LongformerAttention
from visattn.layers.neighborhood import NeighborhoodAttention
from visattn.layers.registry import get_attention
from visattn.layers.sparse import SparseAttention
from visattn.ops.local.naive import naive_masked_attn
from visattn.ops.longformer import longformer_mask
from visattn.ops.neighborhood import neighborhood_mask
from visattn.ops.sparse import sparse_mask

DIM, HEADS = 32, 2

# (name, type options)
LAYERS = [
    ("neighborhood", {"kernel_size": 3}),
    ("neighborhood", {"kernel_size": 5, "tile_size": 3}),
    ("sparse", {"block_size": 3, "halo": 1}),
    ("longformer", {"local": "neighborhood", "kernel_size": 3}),
    ("longformer", {"local": "sparse", "block_size": 3, "halo": 1, "num_extra_global_tokens": 2}),
    ("longformer", {"local": "neighborhood", "kernel_size": 5, "num_extra_global_tokens": 1}),
]
LAYER_IDS = [name + "".join(f"-{key}{value}" for key, value in opts.items()) for name, opts in LAYERS]
PREFIX = [0, 1, 2]
GRID = (5, 7)


def _layer(name, opts, grid=GRID, num_prefix_tokens=0, **timm_kwargs):
    layer = get_attention(name)(DIM, HEADS, qkv_bias=True, **timm_kwargs, **opts)
    layer.set_grid(grid, num_prefix_tokens)
    return layer


def _x(p, grid=GRID, batch=2):
    return torch.randn(batch, p + grid[0] * grid[1], DIM)


def test_registered_under_their_names():
    assert get_attention("neighborhood") is NeighborhoodAttention
    assert get_attention("sparse") is SparseAttention
    assert get_attention("longformer") is LongformerAttention


@pytest.mark.parametrize("p", PREFIX, ids=[f"p{p}" for p in PREFIX])
@pytest.mark.parametrize("name,opts", LAYERS, ids=LAYER_IDS)
def test_forward_backward(name, opts, p):
    layer = _layer(name, opts, num_prefix_tokens=p, qk_norm=True, norm_layer=nn.LayerNorm)
    x = _x(p).requires_grad_(True)
    out = layer(x)
    assert out.shape == x.shape
    assert torch.isfinite(out).all()
    out.square().mean().backward()
    assert torch.isfinite(x.grad).all()
    for param_name, param in layer.named_parameters():
        assert param.grad is not None, f"{param_name} got no gradient"
        assert torch.isfinite(param.grad).all(), f"{param_name}: non-finite gradient"


def _expected_mix(layer, q, k, v):
    """The layer's mixing spelled out as one explicit (N, N) mask on its own q, k, v."""
    p, grid = layer.num_prefix_tokens, layer.grid
    n_patch = grid[0] * grid[1]
    if isinstance(layer, LongformerAttention):
        extra = layer.num_extra_global_tokens
        if extra:
            qkv = layer.qkv(layer.global_tokens).reshape(extra, 3, HEADS, DIM // HEADS).permute(1, 2, 0, 3)
            eq, ek, ev = layer.q_norm(qkv[0]), layer.k_norm(qkv[1]), qkv[2]  # (heads, E, d)

            def insert(t, e):  # the learned tokens go right after the prefix tokens
                return torch.cat([t[:, :, :p], e.expand(t.shape[0], -1, -1, -1), t[:, :, p:]], dim=2)

            q, k, v = insert(q, eq), insert(k, ek), insert(v, ev)
        allowed = longformer_mask(grid, p + extra, layer.local, layer.kernel_size, layer.block_size, layer.halo)
        out = naive_masked_attn(q, k, v, allowed)
        return torch.cat([out[:, :, :p], out[:, :, p + extra :]], dim=2)
    allowed = torch.zeros(p + n_patch, p + n_patch, dtype=torch.bool)
    allowed[:p] = True  # prefix tokens see everything
    if isinstance(layer, NeighborhoodAttention):
        allowed[p:, p:] = neighborhood_mask(grid, layer.kernel_size)
    else:
        allowed[p:, p:] = sparse_mask(grid, layer.block_size, layer.halo)
    return naive_masked_attn(q, k, v, allowed)


@pytest.mark.parametrize("p", PREFIX, ids=[f"p{p}" for p in PREFIX])
@pytest.mark.parametrize("name,opts", LAYERS, ids=LAYER_IDS)
def test_mix_matches_explicit_mask(name, opts, p):
    layer = _layer(name, opts, num_prefix_tokens=p, qk_norm=True, norm_layer=nn.LayerNorm)
    seen = {}
    mix = layer.mix

    def spy(q, k, v, **kwargs):
        seen.update(q=q, k=k, v=v, out=mix(q, k, v, **kwargs))
        return seen["out"]

    layer.mix = spy
    with torch.no_grad():
        layer(_x(p))
        expected = _expected_mix(layer, seen["q"], seen["k"], seen["v"])
    assert_rms_close(seen["out"], expected, 1e-5, "mix")


@pytest.mark.parametrize(
    "name,opts,patches_see_prefix",
    [
        ("neighborhood", {"kernel_size": 3}, False),
        ("sparse", {"block_size": 3, "halo": 1}, False),
        ("longformer", {"kernel_size": 3}, True),
    ],
    ids=["neighborhood", "sparse", "longformer"],
)
def test_who_sees_the_prefix_tokens(name, opts, patches_see_prefix):
    """The class token gathers from every patch in all three; only longformer's patches read it back."""
    p = 1
    layer = _layer(name, opts, num_prefix_tokens=p)
    x = _x(p, batch=1).requires_grad_(True)
    out = layer(x)
    (grad_cls_from_patches,) = torch.autograd.grad(out[:, p:].sum(), x, retain_graph=True)
    (grad_from_cls,) = torch.autograd.grad(out[:, 0].sum(), x)
    assert (grad_from_cls[0].abs().sum(dim=-1) > 0).all(), "the class token must see every token"
    assert bool(grad_cls_from_patches[0, 0].abs().sum() > 0) == patches_see_prefix


def test_extra_global_tokens_keep_the_token_count_and_change_the_output():
    p = 1
    layer = _layer("longformer", {"kernel_size": 3, "num_extra_global_tokens": 2}, num_prefix_tokens=p)
    assert layer.global_tokens.shape == (2, DIM)
    x = _x(p)
    out = layer(x)
    assert out.shape == x.shape
    with torch.no_grad():
        layer.global_tokens.mul_(100.0)
    assert not torch.allclose(layer(x), out)


@pytest.mark.parametrize("name,opts", LAYERS, ids=LAYER_IDS)
def test_grid_mismatch_raises(name, opts):
    layer = _layer(name, opts, grid=(4, 4), num_prefix_tokens=1)
    with pytest.raises(ValueError, match="do not match"):
        layer(_x(1, grid=(5, 4)))
    unset = get_attention(name)(DIM, HEADS, **opts)
    with pytest.raises(ValueError, match="grid is not set"):
        unset(_x(0))


@pytest.mark.parametrize("name,opts", LAYERS[:3] + LAYERS[4:5], ids=LAYER_IDS[:3] + LAYER_IDS[4:5])
def test_attn_drop_acts_in_training_only(name, opts):
    layer = _layer(name, opts, num_prefix_tokens=1, attn_drop=0.5)
    x = _x(1)
    layer.eval()
    reference = _layer(name, opts, num_prefix_tokens=1)
    reference.load_state_dict(layer.state_dict())
    reference.eval()
    torch.testing.assert_close(layer(x), reference(x))
    layer.train()
    assert not torch.allclose(layer(x), reference(x))


@pytest.mark.parametrize("name", ["neighborhood", "sparse", "longformer"])
def test_causal_and_mask_are_refused(name):
    layer = _layer(name, {}, num_prefix_tokens=1)
    with pytest.raises(ValueError, match="is_causal"):
        layer(_x(1), is_causal=True)
    with pytest.raises(ValueError, match="attn_mask"):
        layer(_x(1), attn_mask=torch.ones(36, 36, dtype=torch.bool))


@pytest.mark.parametrize(
    "name,opts,match",
    [
        ("neighborhood", {"kernel_size": 4}, "kernel_size"),
        ("neighborhood", {"tile_size": 0}, "tile_size"),
        ("sparse", {"block_size": 0}, "block_size"),
        ("sparse", {"halo": -1}, "halo"),
        ("longformer", {"local": "axial"}, "local"),
        ("longformer", {"num_extra_global_tokens": -1}, "num_extra_global_tokens"),
    ],
    ids=[
        "nb-k-even", "nb-tile-zero", "sparse-block-zero", "sparse-halo-negative", "lf-local-unknown", "lf-extra-negative"
    ],
)
def test_bad_options_raise(name, opts, match):
    with pytest.raises(ValueError, match=match):
        get_attention(name)(DIM, HEADS, **opts)
