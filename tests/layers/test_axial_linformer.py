"""The axial and linformer layers: contract, gradients, grid handling, and equality with their ops."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from timm.models.vision_transformer import Block

from tests.helpers import TRITON_ON_CPU, assert_rms_close
from visattn import get_attention, ops
from visattn.layers import GridAttention
from visattn.layers.axial import AxialAttention
from visattn.layers.linformer import LinformerAttention
from visattn.ops.backends import force_backend
from visattn.ops.linformer import area_pooling_projection

DIM, HEADS = 24, 3
OPTIONS = {"axial": {}, "linformer": {"k": 6, "ref_grid": (4, 4)}}
GRIDS = [((4, 4), 0), ((7, 5), 1), ((3, 8), 3), ((1, 6), 1), ((6, 1), 0)]
GRID_IDS = [f"grid{g[0]}x{g[1]}-p{p}" for g, p in GRIDS]


def _layer(name: str, grid, p, **kwargs) -> nn.Module:
    layer = get_attention(name)(DIM, num_heads=HEADS, **OPTIONS[name], **kwargs)
    layer.set_grid(grid, p)
    return layer


def test_registry_names():
    assert get_attention("axial") is AxialAttention
    assert get_attention("linformer") is LinformerAttention


@pytest.mark.parametrize("name", OPTIONS)
@pytest.mark.parametrize("grid,p", GRIDS, ids=GRID_IDS)
def test_forward_backward(name, grid, p):
    layer = _layer(name, grid, p, qkv_bias=True)
    x = torch.randn(2, p + grid[0] * grid[1], DIM, requires_grad=True)
    out = layer(x)
    assert out.shape == x.shape
    assert torch.isfinite(out).all()
    out.square().mean().backward()
    for param_name, param in layer.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, f"no gradient for {param_name}"
    assert x.grad.abs().sum(dim=-1).gt(0).all(), "some input token does not influence the output"


@pytest.mark.parametrize("name", OPTIONS)
@pytest.mark.parametrize("grid,p", GRIDS, ids=GRID_IDS)
def test_layer_equals_op(name, grid, p):
    layer = _layer(name, grid, p, qkv_bias=True)
    x = torch.randn(2, p + grid[0] * grid[1], DIM)
    b, n, _ = x.shape
    q, k, v = layer.qkv(x).reshape(b, n, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)  # (B, heads, N, d)
    if name == "axial":
        mixed = ops.axial_attn(q, k, v, grid, p)
    else:
        proj_k, proj_v = (ops.resample_projection(w, (4, 4), grid) for w in (layer.proj_k, layer.proj_v))
        mixed = ops.linformer_attn(q, k, v, proj_k, proj_v, p)
    expected = layer.proj(mixed.transpose(1, 2).reshape(b, n, DIM))
    assert_rms_close(layer(x), expected, 1e-5)


@pytest.mark.parametrize("name", OPTIONS)
def test_grid_mismatch_raises(name):
    layer = get_attention(name)(DIM, num_heads=HEADS, **OPTIONS[name])
    x = torch.randn(1, 17, DIM)
    with pytest.raises(ValueError, match="grid is not set"):
        layer(x)
    layer.set_grid((4, 4), 0)
    with pytest.raises(ValueError, match="do not match"):
        layer(x)
    layer.set_grid((4, 4), 1)
    assert layer(x).shape == x.shape


@pytest.mark.parametrize("name", OPTIONS)
def test_timm_block_contract(name):
    """Built by timm's Block with its keywords (qk_norm, scale_norm, dropout), weights named like timm's."""
    block = Block(
        DIM, HEADS, qkv_bias=True, qk_norm=True, scale_attn_norm=True, proj_drop=0.1, attn_drop=0.1,
        attn_layer=get_attention(name),
    )
    block.attn.set_grid((3, 4), 1)
    x = torch.randn(2, 13, DIM)
    block.eval()
    assert torch.isfinite(block(x)).all()
    assert {"qkv.weight", "qkv.bias", "proj.weight", "q_norm.weight", "norm.weight"} <= set(dict(block.attn.named_parameters()))


@pytest.mark.parametrize("name", OPTIONS)
def test_attn_drop_only_in_training(name):
    layer = _layer(name, (3, 4), 1, attn_drop=0.5)
    x = torch.randn(2, 13, DIM)
    plain = _layer(name, (3, 4), 1)
    plain.load_state_dict(layer.state_dict())
    layer.eval()
    torch.testing.assert_close(layer(x), plain(x))
    layer.train()
    assert not torch.allclose(layer(x), plain(x))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["fp64", "bf16"])
def test_linformer_any_grid_and_dtype(dtype):
    # k > Hr * Wr is accepted
    layer = LinformerAttention(DIM, num_heads=HEADS, k=20, ref_grid=(4, 4), dtype=dtype)
    assert layer.proj_k.shape == (20, 4, 4) and layer.proj_k.dtype == dtype
    for grid, p in [((9, 7), 1), ((2, 3), 0)]:
        layer.set_grid(grid, p)
        x = torch.randn(1, p + grid[0] * grid[1], DIM, dtype=dtype)
        out = layer(x)
        assert out.dtype == dtype and torch.isfinite(out).all()
        out.float().square().mean().backward()
        assert layer.proj_k.grad is not None and layer.proj_v.grad is not None


def test_linformer_init_and_reset_are_area_pooling():
    layer = LinformerAttention(DIM, num_heads=HEADS, k=6, ref_grid=(5, 3))
    pooled = area_pooling_projection(6, (5, 3))
    assert torch.equal(layer.proj_k, pooled) and torch.equal(layer.proj_v, pooled)
    with torch.no_grad():
        layer.proj_k.normal_()
        layer.proj_v.zero_()
    layer.reset_parameters()
    assert torch.equal(layer.proj_k, pooled) and torch.equal(layer.proj_v, pooled)


@pytest.mark.parametrize(
    "options",
    [{"k": 0}, {"k": 2.5}, {"ref_grid": (0, 4)}, {"ref_grid": (4,)}],
    ids=["k0", "k-float", "ref-grid-zero", "ref-grid-1d"],
)
def test_linformer_bad_options_raise(options):
    with pytest.raises(ValueError):
        LinformerAttention(DIM, num_heads=HEADS, **options)


def _generic_path(layer: nn.Module) -> nn.Module:
    """The same layer forced onto the base class's projection: qkv for all tokens, then mix()."""
    layer.project_and_mix = lambda *args: GridAttention.project_and_mix(layer, *args)
    return layer


@pytest.mark.parametrize("grid,p", GRIDS, ids=GRID_IDS)
def test_linformer_projecting_the_input_equals_the_generic_path(grid, p):
    """Without a key norm the layer projects x along the tokens before the key and value projections;
    outputs and every gradient match the generic qkv -> mix path."""
    x = torch.randn(2, p + grid[0] * grid[1], DIM)
    results = []
    for make in (lambda layer: layer, _generic_path):
        torch.manual_seed(0)
        layer = make(_layer("linformer", grid, p, qkv_bias=True))
        with torch.no_grad():
            layer.proj_k.normal_()  # not the pooled initialisation, whose rows all sum to 1
        xg = x.clone().requires_grad_(True)
        out = layer(xg)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)))
        results.append((out.detach(), xg.grad, {n: t.grad for n, t in layer.named_parameters()}))
    (fast, dx_fast, grads_fast), (generic, dx_generic, grads_generic) = results
    assert_rms_close(fast, generic, 1e-5, "out")
    assert_rms_close(dx_fast, dx_generic, 1e-5, "dx")
    for name, grad in grads_generic.items():
        assert_rms_close(grads_fast[name], grad, 1e-5, f"d{name}")


def test_linformer_under_autocast_projects_in_its_dtype_and_leaves_fp64_alone():
    """Under bf16 autocast the projected keys and values are bf16, a qkv bias included (an fp32 bias would
    promote them), and equal the generic path's; an fp64 layer is left in fp64, as autocast leaves it."""
    grid, p = (4, 6), 1
    x = torch.randn(2, p + grid[0] * grid[1], DIM)
    layer = _layer("linformer", grid, p, qkv_bias=True)
    keys_seen = []
    original = ops.linformer.project_keys_values
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(
                "visattn.layers.linformer.project_keys_values",
                lambda *args: keys_seen.append(original(*args)) or keys_seen[-1],
            )
            out = layer(x)
        generic = _generic_path(layer)(x)
    assert [t.dtype for t in keys_seen[0]] == [torch.bfloat16, torch.bfloat16]
    # both in bf16 (8 significant bits) from the same inputs, their roundings apart: 2^-8 x a few
    assert_rms_close(out.float(), generic.float(), 4 * 2**-8, "autocast: projected first vs generic")
    layer64 = _layer("linformer", grid, p, qkv_bias=True).double()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer64(x.double()).dtype == torch.float64


@TRITON_ON_CPU
@pytest.mark.parametrize("rope", [None, "axial"], ids=["projection", "rope"])
def test_axial_triton_path_equals_sdpa(rope):
    """The layer on the Triton kernels, forced (interpreted on the CPU), against the same layer on SDPA,
    by both of its routes: on the qkv projection itself, which the kernels read in place, and on q, k, v
    split and turned by rope. Outputs and every parameter's gradient."""
    layer = _layer("axial", (7, 5), 1, qkv_bias=True, rope=rope)
    x = torch.randn(2, 36, DIM)
    results = []
    for backend in ("sdpa", "triton"):
        layer.zero_grad()
        with force_backend("axial", backend):
            out = layer(x)
        out.square().mean().backward()
        results.append((out.detach(), [param.grad.clone() for param in layer.parameters()]))
    (expected, expected_grads), (out, grads) = results
    assert_rms_close(out, expected, 1e-5, "out")
    for (name, _), grad, expected_grad in zip(layer.named_parameters(), grads, expected_grads):
        assert_rms_close(grad, expected_grad, 1e-5, f"d{name}")
