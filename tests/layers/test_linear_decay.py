"""The linear layer's ``decay`` option: the layer against an fp64 twin built on the naive op, the rates'
initialisation and parametrisation, its validation, how the option travels from train.py and visattn-bench,
and its cost formulas against the FLOP counter."""
import copy

import pytest
import timm
import torch

import visattn
from tests.helpers import assert_rms_close
from tests.bench.test_bench import _counted_flops, _tiny_model
from visattn.bench.flops import ViTShape, estimate_memory, vit_flops
from visattn.bench.sweep_cli import parse_args as parse_bench_args
from visattn.layers import attention_options, get_attention
from visattn.layers.cost import CostCase, TokenLayout
from visattn.layers.decay import initial_decay_rates
from visattn.ops.layout import merge_heads, split_qkv
from visattn.ops.linear.naive_decay import naive_decayed_linear_attn
from visattn.train.cli import resolve_config

DIM, HEADS = 24, 3  # head width 8: rope turns pairs of channels on two axes


def _layer(**options):
    return get_attention("linear")(DIM, num_heads=HEADS, qkv_bias=True, **options)


def _naive_twin_output(layer, x, grid, prefix):
    """The layer's forward spelled out in fp64 with the naive op: the explicit N x N decay."""
    twin = copy.deepcopy(layer).double()
    q, k, v = split_qkv(twin.qkv(x.double()), HEADS)
    rope = None if twin.rope is None else twin.rope(grid, prefix, q)
    out = naive_decayed_linear_attn(q, k, v, twin.spatial_decay(), grid, prefix, rope=rope)
    merged = merge_heads(out)
    if twin.dwconv is not None:
        image = merge_heads(v)[:, prefix:].transpose(1, 2).reshape(x.shape[0], DIM, *grid)
        local = twin.dwconv(image).flatten(2).transpose(1, 2)
        merged = torch.cat([merged[:, :prefix], merged[:, prefix:] + local], dim=1)
    return twin, twin.proj(merged)


@pytest.mark.parametrize("rope", [None, "mixed"], ids=["no-rope", "rope-mixed"])
@pytest.mark.parametrize("dwconv_kernel", [None, 3], ids=["no-dwconv", "dwconv3"])
@pytest.mark.parametrize("grid, prefix, batch", [((5, 7), 0, 1), ((6, 4), 2, 3)], ids=["grid5x7-p0-B1", "grid6x4-p2-B3"])
def test_layer_matches_its_naive_twin_with_gradients(grid, prefix, batch, dwconv_kernel, rope):
    torch.manual_seed(0)
    layer = _layer(decay=[0.6, 0.95], dwconv_kernel=dwconv_kernel, rope=rope)
    layer.set_grid(grid, prefix)
    x = torch.randn(batch, prefix + grid[0] * grid[1], DIM)
    twin, expected = _naive_twin_output(layer, x, grid, prefix)
    out = layer(x)
    assert_rms_close(out, expected, 1e-5, "out")
    cotangent = torch.randn_like(out)
    out.backward(cotangent)
    expected.backward(cotangent.double())
    for (name, p), (_, p_twin) in zip(layer.named_parameters(), twin.named_parameters()):
        assert p.grad is not None and p.grad.abs().sum() > 0, name
        assert_rms_close(p.grad, p_twin.grad, 1e-4, f"d{name}")


def test_initial_rates():
    rmt = initial_decay_rates(6, True)
    torch.testing.assert_close(rmt, 1 - 2 ** -(2 + 4 * torch.arange(6, dtype=torch.float64) / 6))
    assert rmt[0] == 0.75
    pair = initial_decay_rates(3, (0.5, 0.9))
    torch.testing.assert_close(pair, torch.tensor([0.5, 1 - (0.5 * 0.1) ** 0.5, 0.9], dtype=torch.float64))
    assert initial_decay_rates(1, (0.5, 0.9)).tolist() == [0.5]
    layer = _layer(decay=True)
    torch.testing.assert_close(layer.spatial_decay(), initial_decay_rates(HEADS, True).float())


def test_rates_stay_between_0_and_1_and_extremes_still_run():
    layer = _layer(decay=True, dwconv_kernel=None)
    layer.set_grid((4, 5), 1)
    with torch.no_grad():
        layer.spatial_decay.logit.copy_(torch.tensor([-200.0, 0.0, 200.0]))  # fp32 rounds these to 0 and 1
    rates = layer.spatial_decay()
    assert rates.tolist() == [0.0, 0.5, 1.0]
    x = torch.randn(2, 21, DIM, requires_grad=True)
    layer(x).sum().backward()
    assert torch.isfinite(x.grad).all() and torch.isfinite(layer.spatial_decay.logit.grad).all()
    with torch.no_grad():
        layer.spatial_decay.logit.uniform_(-10, 10)
    assert ((layer.spatial_decay() > 0) & (layer.spatial_decay() < 1)).all()


def test_decay_off_adds_nothing():
    for off in (None, False):
        layer = _layer(decay=off, dwconv_kernel=None)
        assert layer.spatial_decay is None and not layer.needs_grid
        assert set(layer.state_dict()) == set(_layer(dwconv_kernel=None).state_dict())
    assert _layer(decay=True, dwconv_kernel=None).needs_grid


@pytest.mark.parametrize("bad", [[0.5], [0.0, 0.5], [0.5, 1.0], "yes", 2, [0.5, True], {"first": 0.5}])
def test_bad_decay_raises_one_line(bad):
    with pytest.raises(ValueError, match=r"^linear: decay must be None \(off\), True .* got ") as info:
        _layer(decay=bad)
    assert "\n" not in str(info.value)


def test_decay_is_not_causal():
    layer = _layer(decay=True, dwconv_kernel=None)
    layer.set_grid((2, 3), 0)
    with pytest.raises(ValueError, match="is_causal=True cannot be combined with decay"):
        layer(torch.randn(1, 6, DIM), is_causal=True)


def test_the_option_travels_from_train_and_bench():
    config, _, _ = resolve_config(["--attn", "linear", "--attn-kwargs", "decay=[0.8, 0.95]"])
    assert config.attn_kwargs == {"decay": [0.8, 0.95]}
    model = timm.create_model(config.model, **config.model_kwargs_for_timm(num_classes=3))
    rates = [block.attn.spatial_decay() for block in model.blocks]
    assert all(r[0].item() == pytest.approx(0.8) and r[-1].item() == pytest.approx(0.95) for r in rates)
    bench = parse_bench_args(["--attn", "linear", "--attn-kwargs", "decay=true", "--device", "cpu"])
    assert bench.attn_kwargs == {"linear": {"decay": True}}


def test_convert_a_timm_vit_with_decay():
    model = visattn.convert(timm.create_model("vit_tiny_patch16_224", img_size=(64, 48), num_classes=4), "linear", decay=True)
    assert all(block.attn.spatial_decay is not None for block in model.blocks)
    out = model(torch.randn(2, 3, 64, 48))
    assert out.shape == (2, 4) and torch.isfinite(out).all()


def test_model_flops_match_flop_counter():
    """Non-square grid, class token plus two register tokens, the locality term on."""
    img = (64, 96)
    model = _tiny_model("linear", img, decay=True)
    shape = ViTShape.from_model(model)
    options = attention_options("linear", {"decay": True}, shape.grid(img))
    assert vit_flops(shape, img, "linear", options) == _counted_flops(model, img, backward=False)


def test_memory_estimate_grows_linearly_in_tokens():
    layer = get_attention("linear")
    options = layer.type_options() | {"decay": True}
    small, large = (
        layer.mixing_memory(CostCase(TokenLayout(g, 1), 6, 64, options, 4)) for g in ((32, 32), (64, 64))
    )
    plain = layer.mixing_memory(CostCase(TokenLayout((64, 64), 1), 6, 64, layer.type_options(), 4))
    assert large.infer > plain.infer and large.train > plain.train
    assert large.train / small.train == pytest.approx(4, rel=0.01) and large.infer / small.infer < 4
    shape = ViTShape(64, 2, 2, 256, (16, 16), 3, 1, 10)
    assert estimate_memory(shape, (256, 256), "linear", options, 2, True, 4, 10**5, device="cpu") > estimate_memory(
        shape, (256, 256), "linear", layer.type_options(), 2, True, 4, 10**5, device="cpu"
    )

