"""The ``rope=`` option of the layers: every type that takes it against its naive twin on naively rotated
q and k (outputs and gradients), the grid it follows, the types that refuse it, and how the option reaches a
layer from train.py and visattn-bench."""
from __future__ import annotations

import pytest
import timm
import torch

import visattn
from tests.helpers import assert_rms_close
from visattn.bench.sweep import plan_model_sweep
from visattn.bench.sweep_cli import parse_args as _parse
from visattn.layers import GridAttention, get_attention
from visattn.layers.options import options_per_type, parse_key_values
from visattn.ops.axial.naive import naive_axial_attn
from visattn.ops.backends import force_backend
from visattn.ops.layout import merge_heads, split_qkv
from visattn.ops.linear.naive import naive_linear_attn
from visattn.ops.local.naive import naive_masked_attn
from visattn.ops.longformer import longformer_mask
from visattn.ops.neighborhood import neighborhood_mask
from visattn.ops.rope import naive_apply_rope
from visattn.ops.softmax import naive_softmax_attn
from visattn.ops.sparse import sparse_mask
from visattn.train.attention import resolve_attention
from visattn.train.build import build_optimizer
from visattn.train.config import ConfigError, TrainConfig

DIM, HEADS = 16, 2  # head_dim 8
GRID, PREFIX = (3, 5), 2
# (type, options): every type that takes rope, windows small enough to be windows on the 3 x 5 grid
TYPES = [
    ("softmax", {}),
    ("linear", {"dwconv_kernel": None}),
    ("linear", {}),
    ("neighborhood", {"kernel_size": 3, "tile_size": 2}),
    ("sparse", {"block_size": 2, "halo": 1}),
    ("longformer", {"kernel_size": 3, "tile_size": 2, "num_extra_global_tokens": 1}),
    ("axial", {}),
]
TYPE_IDS = ["softmax", "linear", "linear-dwconv3", "neighborhood", "sparse", "longformer-extra1", "axial"]


def _layer(name, options, rope, grid=GRID):
    layer = get_attention(name)(DIM, num_heads=HEADS, qkv_bias=True, rope=rope, **options)
    layer.set_grid(grid, PREFIX)
    return layer


def _explicit(layer: GridAttention, x: torch.Tensor) -> torch.Tensor:
    """The layer spelled out: projection, q and k turned by explicit rotation matrices (linear: the features
    of its numerator), the mixing as explicit masked scores, the output projection."""
    p, grid = layer.num_prefix_tokens, layer.grid
    q, k, v = split_qkv(layer.qkv(x), HEADS)  # (B, heads, N, d)
    table = layer.rope(grid, p, q)
    if layer.name == "linear":
        out = naive_linear_attn(q, k, v, layer.feature_map, rope=table)
        if layer.dwconv is not None:
            local = layer.dwconv(merge_heads(v)[:, p:].transpose(1, 2).reshape(x.shape[0], DIM, *grid))
            out = merge_heads(out)
            return layer.proj(torch.cat([out[:, :p], out[:, p:] + local.flatten(2).transpose(1, 2)], dim=1))
        return layer.proj(merge_heads(out))
    q, k = naive_apply_rope(q, table), naive_apply_rope(k, table)
    n = q.shape[2]
    if layer.name == "softmax":
        out = naive_softmax_attn(q, k, v)
    elif layer.name == "axial":
        out = naive_axial_attn(q, k, v, grid, p)
    elif layer.name == "longformer":
        extra = layer.num_extra_global_tokens
        eq, ek, ev = layer.extra_qkv(x.shape[0])  # global tokens, not turned
        q, k, v = (torch.cat([t[:, :, :p], e, t[:, :, p:]], dim=2) for t, e in zip((q, k, v), (eq, ek, ev)))
        allowed = longformer_mask(grid, p + extra, layer.local, layer.kernel_size, layer.block_size, layer.halo)
        out = naive_masked_attn(q, k, v, allowed)
        out = torch.cat([out[:, :, :p], out[:, :, p + extra :]], dim=2)
    else:
        allowed = torch.zeros(n, n, dtype=torch.bool)
        allowed[:p] = True  # prefix queries see every token, patches their window
        window = neighborhood_mask(grid, layer.kernel_size) if layer.name == "neighborhood" else sparse_mask(
            grid, layer.block_size, layer.halo
        )
        allowed[p:, p:] = window
        out = naive_masked_attn(q, k, v, allowed)
    return layer.proj(merge_heads(out))


def _output_and_grads(fn, layer, x, cotangent):
    x = x.detach().clone().requires_grad_(True)
    params = [param for _, param in layer.named_parameters()]
    out = fn(x)
    grads = torch.autograd.grad(out, [x, *params], cotangent)
    return out.detach(), grads


@pytest.mark.parametrize("batch", [1, 3], ids=["B1", "B3"])
@pytest.mark.parametrize("rope", ["axial", "mixed"])
@pytest.mark.parametrize("name,options", TYPES, ids=TYPE_IDS)
def test_layer_with_rope_matches_its_naive_twin(name, options, rope, batch):
    layer = _layer(name, options, rope)
    x = torch.randn(batch, PREFIX + GRID[0] * GRID[1], DIM)
    cotangent = torch.randn(x.shape)
    out, grads = _output_and_grads(layer, layer, x, cotangent)
    ref, ref_grads = _output_and_grads(lambda x: _explicit(layer, x), layer, x, cotangent)
    assert_rms_close(out, ref, 1e-5, "out")
    names = ["x"] + [param_name for param_name, _ in layer.named_parameters()]
    assert ("rope.freqs" in names) == (rope == "mixed")
    for param_name, g, g_ref in zip(names, grads, ref_grads):
        assert_rms_close(g, g_ref, 1e-5, f"d{param_name}")
    with torch.no_grad():  # the inference paths (linear's fused projection is not taken with rope)
        assert_rms_close(layer(x), ref, 1e-5, "inference")


@pytest.mark.parametrize("name,options", TYPES, ids=TYPE_IDS)
def test_rope_changes_the_output_and_follows_the_grid(name, options):
    """Rope acts (the output differs from the same weights without it), and the same layer runs at another
    grid, matching its twin there: the tables come from the live grid."""
    torch.manual_seed(0)
    layer = _layer(name, options, "axial")
    plain = _layer(name, options, None)
    plain.load_state_dict(layer.state_dict())
    x = torch.randn(2, PREFIX + GRID[0] * GRID[1], DIM)
    assert not torch.allclose(layer(x), plain(x), atol=1e-4)
    for grid in [(5, 3), (4, 6)]:
        layer.set_grid(grid, PREFIX)
        x = torch.randn(2, PREFIX + grid[0] * grid[1], DIM)
        with torch.no_grad():
            assert_rms_close(layer(x), _explicit(layer, x), 1e-5, f"grid {grid}")


def test_axial_tables_are_shared_by_layers_and_forwards():
    first, second = _layer("softmax", {}, "axial"), _layer("neighborhood", {"kernel_size": 3}, "axial")
    like = torch.zeros(1, HEADS, PREFIX + 15, DIM // HEADS)
    assert first.rope(GRID, PREFIX, like) is second.rope(GRID, PREFIX, like)
    assert first.rope((5, 3), PREFIX, like) is not first.rope(GRID, PREFIX, like)


def test_rope_needs_the_grid_even_for_softmax():
    layer = get_attention("softmax")(DIM, num_heads=HEADS, rope="axial")
    with pytest.raises(ValueError, match="grid is not set"):
        layer(torch.randn(1, 15, DIM))
    assert not get_attention("softmax")(DIM, num_heads=HEADS).needs_grid  # without rope it needs none


@pytest.mark.parametrize(
    "name, rope, match",
    [
        ("softmax", "2d", r"softmax: rope must be None, 'axial' or 'mixed', got '2d'"),
        ("axial", True, r"axial: rope must be None, 'axial' or 'mixed', got True"),
        ("linformer", "axial", r"linformer: rope='axial' is not supported: its projected keys mix all patch positions"),
        ("floor", "mixed", r"floor: rope must be None: this type scores no query against a key"),
    ],
    ids=["unknown", "not-a-name", "linformer", "floor"],
)
def test_bad_rope_values_raise_one_line_errors(name, rope, match):
    with pytest.raises(ValueError, match=match) as error:
        get_attention(name)(DIM, num_heads=HEADS, rope=rope)
    assert "\n" not in str(error.value)


def test_rope_needs_head_width_divisible_by_4():
    with pytest.raises(ValueError, match="head width divisible by 4, got head_dim=6"):
        get_attention("softmax")(12, num_heads=2, rope="axial")


def test_linear_packed_projection_path_refuses_rope():
    layer = _layer("linear", {}, "axial")
    x = torch.randn(1, PREFIX + 15, DIM)
    with force_backend("projected_linear", "packed"):
        with pytest.raises(ValueError, match="does not rotate; rope needs 'split'"):
            layer(x)


# ------------------------------------------------------------------ from train.py and visattn-bench to a layer


def test_every_type_that_scores_keys_lists_rope():
    takes = {name for name in visattn.list_attentions() if "rope" in get_attention(name).type_options()}
    assert takes == set(visattn.list_attentions()) - {"floor"}


def test_attn_kwargs_text_reaches_the_layers():
    per_type, unused = options_per_type(["softmax", "floor", "axial"], parse_key_values("rope=axial"))
    assert per_type == {"softmax": {"rope": "axial"}, "floor": {}, "axial": {"rope": "axial"}} and unused == []
    model = timm.create_model(
        "visattn_vit_tiny_patch16", attn=["softmax", "axial"],
        attn_kwargs={name: per_type[name] for name in ("softmax", "axial")},
        img_size=48, num_classes=3, depth=2, pos_embed="none", dynamic_img_size=True,
    )
    layers = [block.attn for block in model.blocks]
    assert all(layer.rope is not None and layer.rope.mode == "axial" for layer in layers)
    for size in [(48, 48), (32, 64)]:  # any image size: the tables follow the grid
        assert model(torch.randn(1, 3, *size)).shape == (1, 3)


def test_train_config_routes_rope_and_refuses_bad_values():
    config = TrainConfig(attn="softmax", attn_kwargs={"rope": "mixed"})
    assert resolve_attention(config) == [] and config.attn_kwargs == {"rope": "mixed"}
    floor = TrainConfig(attn="floor", attn_kwargs={"rope": "mixed"})
    assert resolve_attention(floor) == ["attn_kwargs: rope dropped: not an option of floor"]
    with pytest.raises(ConfigError, match="neighborhood: unknown option"):
        resolve_attention(TrainConfig(attn="softmax", attn_kwargs={"neighborhood": {"rope": "axial", "x": 1}}))



@pytest.mark.parametrize("opt_kwargs", [{}, {"layer_decay": 0.75}], ids=["plain", "layer_decay"])
def test_mixed_rope_frequencies_are_kept_out_of_weight_decay(opt_kwargs):
    model = timm.create_model(
        "visattn_vit_tiny_patch16", attn="softmax", attn_kwargs={"rope": "mixed"}, img_size=32, patch_size=8, depth=2,
        embed_dim=32, num_heads=2, num_classes=3,
    )
    optimizer = build_optimizer(TrainConfig(weight_decay=0.05, opt_kwargs=opt_kwargs), model)
    decay = {id(p): group["weight_decay"] for group in optimizer.param_groups for p in group["params"]}
    parameters = dict(model.named_parameters())
    assert len(decay) == len(parameters)  # every parameter in exactly one group
    assert [decay[id(parameters[f"blocks.{i}.attn.rope.freqs"])] for i in range(2)] == [0.0, 0.0]
    assert decay[id(parameters["pos_embed"])] == 0.0 and decay[id(parameters["blocks.0.norm1.weight"])] == 0.0
    assert decay[id(parameters["blocks.0.attn.qkv.weight"])] == 0.05
    scales = {group.get("lr_scale", 1.0) for group in optimizer.param_groups}
    assert (len(scales) > 1) == ("layer_decay" in opt_kwargs)


def test_layer_decay_settings_without_layer_decay_are_refused():
    model = timm.create_model("visattn_vit_tiny_patch16", attn="softmax", img_size=32, patch_size=8, depth=1, embed_dim=32, num_heads=2)
    config = TrainConfig(opt_kwargs={"layer_decay_min_scale": 0.1})
    with pytest.raises(ConfigError, match="^opt_kwargs: layer_decay_min_scale without layer_decay has no effect; "):
        build_optimizer(config, model)

def test_bench_command_line_takes_rope_and_checks_it_before_measuring():
    common = ["--attn-kwargs", "rope=axial", "--sizes", "32", "--model", "visattn_vit_tiny_patch16"]
    args = _parse(["--attn", "softmax", "floor", *common])
    assert args.attn_kwargs == {"softmax": {"rope": "axial"}, "floor": {}}
    plan_model_sweep(args)  # builds every model on the meta device
    args = _parse(["--attn", "linformer", *common])
    with pytest.raises(ValueError, match="linformer: rope='axial' is not supported"):
        plan_model_sweep(args)
