"""Contract tests run on every registered attention layer: a new type is tested the day it is added."""
import sys

import pytest
import torch
import torch.nn as nn
from timm.layers import Attention

import visattn
import visattn.ops as ops
from tests.helpers import assert_rms_close
from visattn.layers import GridAttention, get_attention
from visattn.ops.linear.naive import naive_linear_attn

NAMES = visattn.list_attentions()
DIM, HEADS = 24, 3


def _layer(name, **kwargs):
    return get_attention(name)(DIM, num_heads=HEADS, qkv_bias=True, **kwargs)


def _input(grid, prefix, batch=2):
    return torch.randn(batch, prefix + grid[0] * grid[1], DIM)


@pytest.mark.parametrize("prefix", [0, 1, 3], ids=lambda p: f"p{p}")
@pytest.mark.parametrize("grid", [(5, 7), (6, 4), (1, 9)], ids=lambda g: f"grid{g[0]}x{g[1]}")
@pytest.mark.parametrize("name", NAMES)
def test_forward_backward_every_parameter(name, grid, prefix):
    layer = _layer(name)
    layer.set_grid(grid, prefix)
    x = _input(grid, prefix).requires_grad_(True)
    out = layer(x)
    assert out.shape == x.shape
    assert torch.isfinite(out).all()
    out.square().mean().backward()
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    for pname, p in layer.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, f"{name}: no gradient for {pname}"


@pytest.mark.parametrize("name", NAMES)
def test_same_seed_same_output_bit_for_bit(name):
    outs = []
    for _ in range(2):
        torch.manual_seed(123)
        layer = _layer(name)
        layer.set_grid((4, 6), 1)
        outs.append(layer(_input((4, 6), 1)))
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("name", NAMES)
def test_timm_parameter_names_and_shapes(name):
    reference = Attention(DIM, num_heads=HEADS, qkv_bias=True, qk_norm=True, norm_layer=nn.LayerNorm)
    layer = _layer(name, qk_norm=True, norm_layer=nn.LayerNorm)
    ours = layer.state_dict()
    for key, value in reference.state_dict().items():
        assert key in ours and ours[key].shape == value.shape, f"{name}: {key}"


@pytest.mark.parametrize("qk_norm", [False, True], ids=["plain", "qk_norm"])
def test_softmax_layer_reproduces_timm_attention_exactly(qk_norm):
    norm = nn.LayerNorm if qk_norm else None
    reference = Attention(DIM, num_heads=HEADS, qkv_bias=True, qk_norm=qk_norm, norm_layer=norm)
    layer = _layer("softmax", qk_norm=qk_norm, norm_layer=norm)
    layer.load_state_dict(reference.state_dict())
    x = _input((5, 7), 1)
    assert torch.equal(layer(x), reference(x))
    mask = torch.rand(x.shape[1], x.shape[1]) > 0.3
    mask.fill_diagonal_(True)
    assert torch.equal(layer(x, attn_mask=mask), reference(x, attn_mask=mask))
    assert torch.equal(layer(x, is_causal=True), reference(x, is_causal=True))


GRID_CASES = [(n, {}) for n in NAMES if _layer(n).needs_grid] + [("linear", {"dwconv_kernel": 5})]


@pytest.mark.parametrize("name, options", GRID_CASES, ids=[f"{n}{'-dwconv5' if o else ''}" for n, o in GRID_CASES])
def test_grid_mismatch_raises(name, options):
    layer = _layer(name, **options)
    layer.set_grid((4, 4), 1)
    with pytest.raises(ValueError, match="do not match"):
        layer(_input((4, 5), 1))
    unset = _layer(name, **options)
    with pytest.raises(ValueError, match="grid is not set"):
        unset(_input((4, 4), 0))


@pytest.mark.parametrize("name", NAMES)
def test_unsupported_mask_and_causal_raise(name):
    layer = _layer(name)
    layer.set_grid((3, 3), 0)
    x = _input((3, 3), 0)
    if not layer.supports_attn_mask:
        with pytest.raises(ValueError, match="attn_mask"):
            layer(x, attn_mask=torch.ones(9, 9, dtype=torch.bool))
    if not layer.supports_causal:
        with pytest.raises(ValueError, match="is_causal"):
            layer(x, is_causal=True)


@pytest.mark.parametrize("name", NAMES)
def test_bad_construction_raises(name):
    with pytest.raises(ValueError, match="divisible"):
        get_attention(name)(25, num_heads=3)
    with pytest.raises(ValueError, match="x must be"):
        layer = _layer(name)
        layer.set_grid((2, 2), 0)
        layer(torch.randn(1, 4, DIM + 1))


def test_registry_lists_and_rejects():
    assert {"softmax", "linear", "floor"} <= set(NAMES)
    with pytest.raises(ValueError, match="valid: softmax"):
        visattn.get_attention("flash")


def test_linear_dwconv_locality_uses_the_grid():
    layer = _layer("linear", dwconv_kernel=3)
    layer.set_grid((4, 5), 1)
    x = _input((4, 5), 1)
    plain = _layer("linear", dwconv_kernel=None)
    assert not plain.needs_grid
    plain.load_state_dict(layer.state_dict(), strict=False)
    with torch.no_grad():
        layer.dwconv.weight.zero_()
        layer.dwconv.bias.zero_()
    torch.testing.assert_close(layer(x), plain(x))  # a zero convolution adds nothing
    with pytest.raises(ValueError, match="dwconv_kernel"):
        _layer("linear", dwconv_kernel=2)
    with pytest.raises(ValueError, match="cannot be combined"):
        layer(x, is_causal=True)


def test_linear_causal_layer_matches_reference():
    layer = _layer("linear", dwconv_kernel=None)
    x = _input((3, 4), 1)
    B, N, _ = x.shape
    q, k, v = layer.qkv(x).reshape(B, N, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4).unbind(0)
    expected = layer.proj(naive_linear_attn(q, k, v, causal=True).transpose(1, 2).reshape(B, N, DIM))
    torch.testing.assert_close(layer(x, is_causal=True), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dwconv_kernel", [3, None], ids=["dwconv3", "no-dwconv"])
@pytest.mark.parametrize("qk_norm", [False, True], ids=["plain", "qk_norm"])
@pytest.mark.parametrize("prefix", [0, 1], ids=["p0", "p1"])
def test_linear_fused_paths_equal_the_generic_path(prefix, qk_norm, dwconv_kernel):
    """Inference fuses the projection with the mixing, training runs on the packed projection; both give
    the generic qkv -> mix result (locality term included), and training the same gradients."""
    norm = nn.LayerNorm if qk_norm else None
    layer = _layer("linear", qk_norm=qk_norm, norm_layer=norm, dwconv_kernel=dwconv_kernel)
    generic = _layer("linear", qk_norm=qk_norm, norm_layer=norm, dwconv_kernel=dwconv_kernel)
    generic.load_state_dict(layer.state_dict())
    generic.project_and_mix = lambda *args: GridAttention.project_and_mix(generic, *args)
    for module in (layer, generic):
        module.set_grid((5, 7), prefix)
    x = _input((5, 7), prefix)
    with torch.no_grad():
        assert_rms_close(layer(x), generic(x), 1e-5, "inference")
    cotangent = torch.randn(x.shape)
    outs = []
    for module in (layer, generic):
        xg = x.clone().requires_grad_(True)
        out = module(xg)
        out.backward(cotangent)
        outs.append((out.detach(), xg.grad, [p.grad for p in module.parameters()]))
    assert_rms_close(outs[0][0], outs[1][0], 1e-5, "training")
    assert_rms_close(outs[0][1], outs[1][1], 1e-5, "dx")
    for g, g_ref in zip(outs[0][2], outs[1][2]):
        assert_rms_close(g, g_ref, 1e-5, "dparam")


@pytest.mark.parametrize("prefix", [0, 2], ids=["p0", "p2"])
def test_linear_locality_term_is_the_depthwise_convolution_of_v(prefix):
    """Every path of the layer adds conv(v) over the grid to the patch outputs (never to the prefix
    tokens), spelled out here on its own q, k, v."""
    grid = (4, 5)
    layer = _layer("linear", dwconv_kernel=3)
    layer.set_grid(grid, prefix)
    x = _input(grid, prefix)
    b, n, _ = x.shape
    q, k, v = layer.qkv(x).reshape(b, n, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
    mixed = naive_linear_attn(q, k, v).transpose(1, 2).reshape(b, n, DIM)
    v_img = v[:, :, prefix:].transpose(2, 3).reshape(b, DIM, *grid)  # (B, heads * d, H, W)
    local = layer.dwconv(v_img).flatten(2).transpose(1, 2)  # (B, H * W, C)
    expected = layer.proj(torch.cat([mixed[:, :prefix], mixed[:, prefix:] + local], dim=1)).detach()
    assert_rms_close(layer(x), expected, 1e-5, "training path")
    with torch.no_grad():
        assert_rms_close(layer(x), expected, 1e-5, "inference path")


def test_a_type_without_cost_formulas_cannot_be_built():
    class NoCost(GridAttention):
        name = "no_cost"

        def mix(self, q, k, v, grid, attn_mask, is_causal):
            return v

    with pytest.raises(TypeError, match="mixing_flops, mixing_memory"):
        NoCost(8, num_heads=2)


# name -> [(type options, the op's name in the layer's module, the op called as the layer's mix should call it)];
# floor has no op: its mixing is the identity
PUBLIC_OPS = {
    "softmax": [({}, "softmax_attn", lambda layer, q, k, v, grid, p: ops.softmax_attn(q, k, v))],
    "linear": [
        (
            {"dwconv_kernel": None},
            "linear_attn",
            lambda layer, q, k, v, grid, p: ops.linear_attn(q, k, v, feature_map="elu", chunk_size=64),
        ),
        (
            {"dwconv_kernel": None, "decay": True},
            "decayed_linear_attn",
            lambda layer, q, k, v, grid, p: ops.decayed_linear_attn(q, k, v, layer.spatial_decay(), grid, p),
        ),
    ],
    "axial": [({}, "axial_attn", lambda layer, q, k, v, grid, p: ops.axial_attn(q, k, v, grid, num_prefix_tokens=p))],
    "linformer": [
        (
            {"k": 8, "ref_grid": (4, 4)},
            "linformer_attn",
            lambda layer, q, k, v, grid, p: ops.linformer_attn(
                q, k, v, *(ops.resample_projection(e, (4, 4), grid) for e in (layer.proj_k, layer.proj_v)),
                num_prefix_tokens=p,
            ),
        )
    ],
    "neighborhood": [
        (
            {"kernel_size": 3, "tile_size": 2},
            "neighborhood_attn",
            lambda layer, q, k, v, grid, p: ops.neighborhood_attn(q, k, v, grid, 3, num_prefix_tokens=p, tile_size=2),
        )
    ],
    "sparse": [
        (
            {"block_size": 2, "halo": 1},
            "sparse_attn",
            lambda layer, q, k, v, grid, p: ops.sparse_attn(q, k, v, grid, 2, 1, num_prefix_tokens=p),
        )
    ],
    "longformer": [
        (
            {"local": "sparse", "block_size": 2, "halo": 1},
            "longformer_attn",
            lambda layer, q, k, v, grid, p: ops.longformer_attn(q, k, v, grid, p, "sparse", block_size=2, halo=1),
        )
    ],
}
PUBLIC_OP_CASES = [(name, *case) for name, cases in PUBLIC_OPS.items() for case in cases]


def test_every_type_but_floor_names_its_public_op():
    assert set(PUBLIC_OPS) == set(NAMES) - {"floor"}


@pytest.mark.parametrize("grad", [False, True], ids=["infer", "train"])
@pytest.mark.parametrize(
    "name,options,op_name,expected", PUBLIC_OP_CASES, ids=[f"{c[0]}-{c[2]}" for c in PUBLIC_OP_CASES]
)
def test_mix_runs_the_public_op(name, options, op_name, expected, grad, monkeypatch):
    """The layer's mixing is one call of its public op (what the op's tests and benchmarks exercise), on
    (B, heads, N, d) with the grid and prefix tokens: a spy in the layer's module sees the call, and the
    output is the op's own on the same q, k, v, bit for bit. A 5 x 7 grid with 2 prefix tokens."""
    grid, p = (5, 7), 2
    layer = _layer(name, **options)
    layer.set_grid(grid, p)
    module = sys.modules[type(layer).__module__]
    public_op = getattr(module, op_name)
    assert public_op is getattr(ops, op_name)
    calls = []

    def spy(*args, **kwargs):
        calls.append(args)
        return public_op(*args, **kwargs)

    monkeypatch.setattr(module, op_name, spy)
    q, k, v = (torch.randn(2, HEADS, p + grid[0] * grid[1], DIM // HEADS, requires_grad=grad) for _ in range(3))
    with torch.set_grad_enabled(grad):
        out = layer.mix(q, k, v, grid=grid, attn_mask=None, is_causal=False)
        assert len(calls) == 1 and all(a is b for a, b in zip(calls[0][:3], (q, k, v)))
        assert torch.equal(out, expected(layer, q, k, v, grid, p))
