"""timm integration: the registered visattn ViTs, convert() on stock timm ViTs, and grid delivery.

Every test that takes an attention type runs over visattn.list_attentions(), so a new type is tested
the day it is registered. Models are tiny (dim 32, 2 heads, 8x8 patches) to stay fast on a CPU.
"""
import contextlib
import copy

import pytest
import safetensors.torch
import timm
import torch
import torch.nn as nn
from timm.layers import Attention
from timm.models.vision_transformer import ParallelScalingBlock, VisionTransformer

import visattn
from tests.helpers import assert_rms_close
from visattn.ops.backends import force_backend
from visattn.layers import GridAttention
from visattn.layers.cost import MixingMemory
from visattn.layers.registry import ATTENTION_LAYERS
from visattn.models import MODEL_SHAPES, TIMM_ATTENTION, PatchGridHook, create_model
from visattn.models.convert import CARRIED_MODULES

MODEL_NAMES = list(MODEL_SHAPES)
TIMM_TWINS = {
    "visattn_vit_tiny_patch16": "vit_tiny_patch16_224",
    "visattn_vit_small_patch16": "vit_small_patch16_224",
    "visattn_vit_base_patch16": "vit_base_patch16_224",
}

# Every registered type with its default options, plus linear without its grid-aware locality term.
ATTN_CASES = [pytest.param(name, {}, id=name) for name in visattn.list_attentions()] + [
    pytest.param("linear", {"dwconv_kernel": None}, id="linear-nodwconv")
]

# Grid 8x10 (non-square) at build time; 7x9 for the changed size. Class token plus one register token.
IMG, OTHER_IMG = (64, 80), (56, 72)
TINY = dict(embed_dim=32, depth=2, num_heads=2, patch_size=8, img_size=IMG, num_classes=5, reg_tokens=1)
FP32_TOL = 1e-5


def tiny(attn="linear", attn_kwargs=None, **overrides):
    return timm.create_model("visattn_vit_tiny_patch16", attn=attn, attn_kwargs=attn_kwargs, **{**TINY, **overrides})


def images(size=IMG, batch=2, seed=1):
    return torch.randn(batch, 3, *size, generator=torch.Generator().manual_seed(seed))


def grid_of(size, patch=8):
    return size[0] // patch, size[1] // patch


# Parameters a type leaves unused by design: floor passes V through and never reads q or k.
UNUSED_BY_DESIGN = {"floor": ("q_norm.", "k_norm.")}


def assert_every_parameter_has_grad(model):
    unused = {
        f"blocks.{i}.attn.{prefix}"
        for i, block in enumerate(model.blocks)
        for prefix in UNUSED_BY_DESIGN.get(getattr(block.attn, "name", ""), ())
    }
    for pname, p in model.named_parameters():
        if any(pname.startswith(prefix) for prefix in unused):
            continue
        assert p.grad is not None, f"no gradient for {pname}"
        assert torch.isfinite(p.grad).all(), f"non-finite gradient for {pname}"


def visattn_layers(model):
    return [block.attn for block in model.blocks]


# ---------------------------------------------------------------- registered models at their real shapes


@pytest.mark.parametrize("model_name", MODEL_NAMES)
def test_registered_with_timm_and_default_cfg(model_name):
    assert timm.is_model(model_name) and model_name in timm.list_models("visattn_*")
    cfg = timm.get_pretrained_cfg(model_name).to_dict()
    for key in ("input_size", "num_classes", "first_conv", "classifier", "mean", "std"):
        assert cfg.get(key) is not None, f"{model_name}: pretrained_cfg lacks {key}"
    assert not any(cfg.get(key) for key in ("url", "hf_hub_id", "file")), "no weights are published"

    model = timm.create_model(model_name, device="meta")  # the real shape, without allocating it
    assert model.pretrained_cfg["architecture"] == model_name
    in_chans, height, width = cfg["input_size"]
    assert tuple(model.patch_embed.img_size) == (height, width)
    first_conv = model.get_submodule(cfg["first_conv"])
    assert isinstance(first_conv, nn.Conv2d) and first_conv.in_channels == in_chans
    classifier = model.get_submodule(cfg["classifier"])
    assert classifier.out_features == cfg["num_classes"] == model.num_classes
    assert all(isinstance(layer, GridAttention) for layer in visattn_layers(model))


@pytest.mark.parametrize("model_name", MODEL_NAMES)
def test_registered_shapes_are_timms_vit(model_name):
    ours = timm.create_model(model_name, attn="softmax", device="meta").state_dict()
    theirs = timm.create_model(TIMM_TWINS[model_name], device="meta").state_dict()
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in theirs.items()}


def test_tiny_at_default_cfg_forward_and_reset_classifier():
    model = timm.create_model("visattn_vit_tiny_patch16").eval()
    cfg = model.pretrained_cfg
    x = torch.randn(1, *cfg["input_size"])
    assert model(x).shape == (1, cfg["num_classes"])
    model.reset_classifier(0)
    assert model(x).shape == (1, model.num_features)


@pytest.mark.parametrize("attn, attn_kwargs", ATTN_CASES)
def test_issue_example_builds_at_1024(attn, attn_kwargs):
    model = timm.create_model(
        "visattn_vit_small_patch16", attn=attn, attn_kwargs=attn_kwargs, img_size=1024, num_classes=10, device="meta"
    )
    assert model.patch_embed.grid_size == (64, 64)
    assert model.head.out_features == 10
    assert all(type(layer) is ATTENTION_LAYERS[attn] for layer in visattn_layers(model))


# ---------------------------------------------------------------- every attention type through timm's API


@pytest.mark.parametrize("attn, attn_kwargs", ATTN_CASES)
def test_forward_backward_every_parameter(attn, attn_kwargs):
    model = tiny(attn, attn_kwargs)
    out = model(images())
    assert out.shape == (2, TINY["num_classes"]) and torch.isfinite(out).all()
    out.backward(torch.randn_like(out))
    assert_every_parameter_has_grad(model)
    for layer in visattn_layers(model):
        assert layer.grid == grid_of(IMG) and layer.num_prefix_tokens == 2


@pytest.mark.parametrize("attn, attn_kwargs", ATTN_CASES)
def test_grad_checkpointing_same_output_and_grads(attn, attn_kwargs):
    model = tiny(attn, attn_kwargs)
    x = images()
    out = model(x)
    out.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.set_grad_checkpointing(True)
    out_ckpt = model(x)
    out_ckpt.sum().backward()
    assert_rms_close(out_ckpt, out, FP32_TOL, "output")
    for name, p in model.named_parameters():
        assert_rms_close(p.grad, grads[name], FP32_TOL, name)


@pytest.mark.parametrize("attn, attn_kwargs", ATTN_CASES)
def test_dynamic_img_size_matches_resized_static_model(attn, attn_kwargs):
    """A dynamic model at a new size equals the same weights resized with set_input_size."""
    dynamic = tiny(attn, attn_kwargs, dynamic_img_size=True).eval()
    static = tiny(attn, attn_kwargs).eval()
    static.load_state_dict(dynamic.state_dict())
    static.set_input_size(OTHER_IMG)
    x = images(OTHER_IMG)
    out = dynamic(x)
    assert all(layer.grid == grid_of(OTHER_IMG) for layer in visattn_layers(dynamic))
    assert_rms_close(out, static(x), FP32_TOL, "dynamic vs set_input_size")
    assert dynamic(images(IMG)).shape == out.shape  # back to the build size
    assert all(layer.grid == grid_of(IMG) for layer in visattn_layers(dynamic))


VIT_KEYWORDS = {
    "img_size-int": dict(img_size=64),
    "no_cls-avg-reg4": dict(class_token=False, global_pool="avg", reg_tokens=4),
    "no_embed_class-layerscale-drop_path": dict(no_embed_class=True, init_values=1e-5, drop_path_rate=0.1),
    "map-pool-qk_norm": dict(global_pool="map", qk_norm=True),
    "pre_norm-fc_norm-gray": dict(pre_norm=True, fc_norm=True, in_chans=1),
    "jax-init-patch16": dict(weight_init="jax", patch_size=16, img_size=(128, 160)),
    "dynamic_img_pad": dict(dynamic_img_size=True, dynamic_img_pad=True),
}


@pytest.mark.parametrize("attn, attn_kwargs", ATTN_CASES)
@pytest.mark.parametrize("keywords", VIT_KEYWORDS.values(), ids=VIT_KEYWORDS.keys())
def test_vit_keywords_pass_through(keywords, attn, attn_kwargs):
    model = tiny(attn, attn_kwargs, **keywords)
    size = (52, 75) if keywords.get("dynamic_img_pad") else model.patch_embed.img_size
    x = torch.randn(2, model.in_chans, *size)
    out = model(x)
    assert out.shape == (2, TINY["num_classes"]) and torch.isfinite(out).all()
    grid = model.patch_embed.dynamic_feat_size(size)
    for layer in visattn_layers(model):
        assert layer.grid == grid and layer.num_prefix_tokens == model.num_prefix_tokens


@pytest.mark.parametrize("attn, attn_kwargs", ATTN_CASES)
def test_forward_features_and_head(attn, attn_kwargs):
    model = tiny(attn, attn_kwargs).eval()
    x = images()
    features = model.forward_features(x)
    h, w = grid_of(IMG)
    assert features.shape == (2, 2 + h * w, TINY["embed_dim"])
    assert model.forward_head(features, pre_logits=True).shape == (2, TINY["embed_dim"])
    assert torch.equal(model.forward_head(features), model(x))


@pytest.mark.parametrize("attn, attn_kwargs", ATTN_CASES)
def test_forward_intermediates(attn, attn_kwargs):
    model = tiny(attn, attn_kwargs).eval()
    x = images()
    final, intermediates = model.forward_intermediates(x, indices=[0, 1])
    h, w = grid_of(IMG)
    assert [t.shape for t in intermediates] == [(2, TINY["embed_dim"], h, w)] * 2
    assert torch.equal(final, model.forward_features(x))
    nlc = model.forward_intermediates(x, indices=1, output_fmt="NLC", intermediates_only=True)
    assert nlc[0].shape == (2, h * w, TINY["embed_dim"])


@pytest.mark.parametrize("attn, attn_kwargs", ATTN_CASES)
def test_features_only(attn, attn_kwargs):
    features = tiny(attn, attn_kwargs, features_only=True, out_indices=(0, 1)).eval()
    h, w = grid_of(IMG)
    assert [f.shape for f in features(images())] == [(2, TINY["embed_dim"], h, w)] * 2


@pytest.mark.parametrize("attn, attn_kwargs", ATTN_CASES)
def test_same_seed_bit_identical(attn, attn_kwargs):
    outs = []
    for _ in range(2):
        torch.manual_seed(7)
        outs.append(tiny(attn, attn_kwargs).eval()(images()))
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("attn, attn_kwargs", ATTN_CASES)
def test_state_dict_save_load_same_output(attn, attn_kwargs, tmp_path):
    model = tiny(attn, attn_kwargs).eval()
    torch.save(model.state_dict(), tmp_path / "model.pth")
    torch.manual_seed(99)
    fresh = tiny(attn, attn_kwargs).eval()
    fresh.load_state_dict(torch.load(tmp_path / "model.pth", weights_only=True))
    x = images()
    assert torch.equal(fresh(x), model(x))


@pytest.mark.parametrize("attn, attn_kwargs", ATTN_CASES)
def test_pretrained_safetensors_file_through_cfg_overlay(attn, attn_kwargs, tmp_path):
    model = tiny(attn, attn_kwargs).eval()
    path = tmp_path / "model.safetensors"
    safetensors.torch.save_file(model.state_dict(), str(path))
    # The overlay states the file's class count; timm keeps the file's head only when it equals the model's.
    overlay = dict(file=str(path), num_classes=TINY["num_classes"])
    torch.manual_seed(99)
    loaded = tiny(attn, attn_kwargs, pretrained=True, pretrained_cfg_overlay=overlay).eval()
    x = images()
    assert torch.equal(loaded(x), model(x))
    new_head = tiny(attn, attn_kwargs, num_classes=3, pretrained=True, pretrained_cfg_overlay=overlay).eval()
    assert torch.equal(new_head.forward_features(x), model.forward_features(x))
    assert new_head(x).shape == (2, 3)


@pytest.mark.parametrize("attn, attn_kwargs", ATTN_CASES)
def test_deepcopy_hook_drives_the_copys_layers(attn, attn_kwargs):
    """EMA keeps a deepcopy; its hook must set the grid of the copy's layers, not the original's."""
    model = tiny(attn, attn_kwargs, dynamic_img_size=True).eval()
    model(images(IMG))
    ema = copy.deepcopy(model)
    (hook,) = [h for h in ema.patch_embed._forward_hooks.values() if isinstance(h, PatchGridHook)]
    assert all(a is b for a, b in zip(hook.layers, visattn_layers(ema)))
    x = images(OTHER_IMG)
    assert torch.equal(ema(x), model(x))
    ema(images(IMG))
    assert all(layer.grid == grid_of(IMG) for layer in visattn_layers(ema))
    assert all(layer.grid == grid_of(OTHER_IMG) for layer in visattn_layers(model))


@pytest.mark.compile
@pytest.mark.parametrize("attn, attn_kwargs", ATTN_CASES)
def test_torch_compile_matches_eager(attn, attn_kwargs):
    """Every token of the features, not only the logits (with one block, class-token pooling would never
    see the patch outputs of the last block)."""
    model = tiny(attn, attn_kwargs, depth=1).eval()
    x = images()
    eager = model.forward_features(x)
    torch._dynamo.reset()
    compiled = torch.compile(model.forward_features, fullgraph=True)  # the grid hook and set_grid trace without a graph break
    assert_rms_close(compiled(x), eager, FP32_TOL, "compiled vs eager")


def test_hybrid_one_block_per_type():
    names = visattn.list_attentions()
    model = tiny(names, {"linear": {"dwconv_kernel": 3}}, depth=len(names), dynamic_img_size=True)
    assert [type(layer) for layer in visattn_layers(model)] == [ATTENTION_LAYERS[n] for n in names]
    assert model.blocks[names.index("linear")].attn.dwconv is not None
    out = model(images(OTHER_IMG))
    out.backward(torch.randn_like(out))
    assert_every_parameter_has_grad(model)


# ---------------------------------------------------------------- options and bad input


class RefGridProbe(GridAttention):
    """Records the ref_grid it was built with; mixing passes V through."""

    name = "ref_grid_probe"

    def __init__(self, dim, num_heads=8, qkv_bias=False, qk_norm=False, scale_norm=False, proj_bias=True,
                 attn_drop=0.0, proj_drop=0.0, norm_layer=None, device=None, dtype=None, *, ref_grid=(1, 1)):
        super().__init__(dim, num_heads, qkv_bias, qk_norm, scale_norm, proj_bias, attn_drop, proj_drop, norm_layer,
                         device, dtype)
        self.ref_grid = ref_grid

    def mix(self, q, k, v, grid, attn_mask, is_causal):
        return v

    @classmethod
    def mixing_flops(cls, case):
        return 0

    @classmethod
    def mixing_memory(cls, case):
        return MixingMemory(infer=0, train=0)


def test_ref_grid_defaults_to_the_model_grid(monkeypatch):
    monkeypatch.setitem(ATTENTION_LAYERS, RefGridProbe.name, RefGridProbe)
    assert {layer.ref_grid for layer in visattn_layers(tiny(RefGridProbe.name))} == {grid_of(IMG)}
    given = tiny(RefGridProbe.name, {"ref_grid": (3, 4)})
    assert {layer.ref_grid for layer in visattn_layers(given)} == {(3, 4)}
    assert {layer.ref_grid for layer in visattn_layers(tiny(["floor", RefGridProbe.name]))[1:]} == {grid_of(IMG)}


def test_options_reach_the_layer():
    model = tiny("linear", {"feature_map": "relu", "dwconv_kernel": 5})
    assert all(layer.feature_map == "relu" and layer.dwconv.kernel_size == (5, 5) for layer in visattn_layers(model))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(attn="no_such_attention"), "unknown attention"),
        (dict(attn=["linear"]), "depth=2"),
        (dict(attn=["linear", "softmax", "floor"]), "depth=2"),
        (dict(attn=["linear", 3]), "list of names"),
        (dict(attn="linear", attn_kwargs={"no_such_option": 1}), "unknown option"),
        (dict(attn="linear", attn_kwargs={"num_heads": 4}), "unknown option"),
        (dict(attn=["linear", "softmax"], attn_kwargs={"dwconv_kernel": 3}), "under the type's name"),
        (dict(attn=["linear", "softmax"], attn_kwargs={"linear": 3}), "under the type's name"),
        (dict(attn="linear", attn_layer=Attention), "attn="),
        (dict(attn="timm", attn_kwargs={"dwconv_kernel": 3}), "timm's Attention, which takes no attention options"),
        (dict(attn=["timm", "linear"]), "unknown attention 'timm'"),
    ],
    ids=["unknown-name", "list-too-short", "list-too-long", "list-not-names", "unknown-option",
         "contract-arg-as-option", "hybrid-flat-options", "hybrid-options-not-dict", "attn_layer", "timm-with-options",
         "timm-per-block"],
)
def test_bad_input_raises_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        tiny(**kwargs)


@pytest.mark.parametrize("model_name", ["visattn_vit_tiny_patch16", "vit_tiny_patch16_224"])
def test_attn_timm_is_the_stock_timm_vit(model_name):
    """attn="timm" keeps timm's own Attention: the model timm builds, weight for weight and output for output."""
    assert TIMM_ATTENTION not in visattn.list_attentions()  # a reserved name, never a registered type
    torch.manual_seed(3)
    model = create_model(model_name, attn=TIMM_ATTENTION, **TINY).eval()
    torch.manual_seed(3)
    stock = VisionTransformer(**TINY).eval()
    assert all(type(block.attn) is Attention for block in model.blocks)
    assert not any(isinstance(module, GridAttention) for module in model.modules())
    assert not model.patch_embed._forward_hooks  # no grid hook: nothing needs the grid
    assert model.state_dict().keys() == stock.state_dict().keys()
    with torch.no_grad():
        assert torch.equal(model(images()), stock(images()))


@pytest.mark.parametrize("attn, attn_kwargs", ATTN_CASES)
def test_patch_drop_needs_gridless_attention(attn, attn_kwargs):
    needs_grid = any(layer.needs_grid for layer in visattn_layers(tiny(attn, attn_kwargs)))
    if needs_grid:
        with pytest.raises(ValueError, match="patch_drop_rate"):
            tiny(attn, attn_kwargs, patch_drop_rate=0.5)
    else:
        model = tiny(attn, attn_kwargs, patch_drop_rate=0.5).train()
        features = model.forward_features(images())
        assert features.shape[1] < 2 + grid_of(IMG)[0] * grid_of(IMG)[1]  # patches were dropped
        model.forward_head(features).sum().backward()


@pytest.mark.parametrize("attn", visattn.list_attentions())
def test_timm_attn_layer_carries_only_gridless_layers(attn):
    """timm's attn_layer= builds the layer but cannot tell it the grid: layers that need it refuse to run."""
    model = timm.create_model("vit_small_patch16_224", attn_layer=ATTENTION_LAYERS[attn], **TINY)
    if model.blocks[0].attn.needs_grid:
        with pytest.raises(ValueError, match="grid is not set"):
            model(images())
    else:
        assert model(images()).shape == (2, TINY["num_classes"])


# ---------------------------------------------------------------- convert() on stock timm ViTs

STOCK = dict(embed_dim=32, depth=2, num_heads=2, patch_size=8, img_size=IMG, num_classes=5)
STOCK_VARIANTS = {
    "cls": dict(),
    "cls-reg4-no_embed_class": dict(reg_tokens=4, no_embed_class=True),
    "no_cls-avg": dict(class_token=False, global_pool="avg"),
    "dynamic-qk_norm-scale_norm": dict(dynamic_img_size=True, qk_norm=True, scale_attn_norm=True),
}


def stock(variant, **overrides):
    return timm.create_model("vit_small_patch16_224", **{**STOCK, **STOCK_VARIANTS[variant], **overrides})


@pytest.mark.parametrize("variant", STOCK_VARIANTS)
def test_convert_softmax_leaves_outputs_unchanged(variant):
    model = stock(variant).eval()
    assert all(block.attn.fused_attn for block in model.blocks)  # timm's default path: fused SDPA, as ours
    x = images()
    expected = model(x)
    expected_intermediates = model.forward_intermediates(x, indices=[0, 1], intermediates_only=True)
    assert visattn.convert(model, "softmax") is model
    assert torch.equal(model(x), expected)
    intermediates = model.forward_intermediates(x, indices=[0, 1], intermediates_only=True)
    for got, want in zip(intermediates, expected_intermediates):
        assert torch.equal(got, want)


@pytest.mark.parametrize("attn, attn_kwargs", ATTN_CASES)
@pytest.mark.parametrize("variant", STOCK_VARIANTS)
def test_convert_keeps_every_weight(variant, attn, attn_kwargs):
    model = stock(variant)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    old_modules = [{name: getattr(block.attn, name) for name in CARRIED_MODULES} for block in model.blocks]
    visattn.convert(model, attn, **attn_kwargs)
    after = model.state_dict()
    for key, value in before.items():
        assert torch.equal(after[key], value), key
    assert all(key.split(".")[2] == "attn" for key in set(after) - set(before)), "only attention parameters are new"
    for block, old in zip(model.blocks, old_modules):
        assert all(getattr(block.attn, name) is module for name, module in old.items())


@pytest.mark.parametrize("attn, attn_kwargs", ATTN_CASES)
@pytest.mark.parametrize("variant", STOCK_VARIANTS)
def test_converted_model_through_timm_api(variant, attn, attn_kwargs):
    model = visattn.convert(stock(variant), attn, **attn_kwargs)
    size = OTHER_IMG if model.dynamic_img_size else IMG
    out = model(images(size))
    assert out.shape == (2, STOCK["num_classes"])
    out.backward(torch.randn_like(out))
    assert_every_parameter_has_grad(model)
    h, w = grid_of(size)
    for layer in visattn_layers(model):
        assert layer.grid == (h, w) and layer.num_prefix_tokens == model.num_prefix_tokens
    intermediates = model.forward_intermediates(images(size), indices=1, intermediates_only=True)
    assert intermediates[0].shape == (2, STOCK["embed_dim"], h, w)
    model.reset_classifier(3)
    assert model(images(size)).shape == (2, 3)


@pytest.mark.parametrize("attn, attn_kwargs", ATTN_CASES)
def test_convert_round_trip_to_softmax(attn, attn_kwargs):
    """stock -> attn -> softmax is the stock model again, unless attn added weights (then convert refuses)."""
    model = stock("cls-reg4-no_embed_class").eval()
    x = images()
    expected = model(x)
    visattn.convert(model, attn, **attn_kwargs)
    converted_out = model(x)
    if any(n.split(".")[0] not in CARRIED_MODULES for n, _ in model.blocks[0].attn.named_parameters()):
        with pytest.raises(ValueError, match="cannot carry over"):
            visattn.convert(model, "softmax")
        assert torch.equal(model(x), converted_out)  # a refused convert changes nothing
    else:
        visattn.convert(model, "softmax")
        assert torch.equal(model(x), expected)
    hooks = [h for h in model.patch_embed._forward_hooks.values() if isinstance(h, PatchGridHook)]
    assert len(hooks) == 1 and hooks[0].layers == visattn_layers(model)


def test_convert_hybrid_list_with_per_type_options():
    model = visattn.convert(stock("cls"), ["linear", "softmax"], linear={"dwconv_kernel": 3})
    assert [layer.name for layer in visattn_layers(model)] == ["linear", "softmax"]
    assert model.blocks[0].attn.dwconv is not None
    model(images()).sum().backward()


def _gated_block_attention():
    model = stock("cls")
    model.blocks[0].attn = Attention(STOCK["embed_dim"], num_heads=2, qkv_bias=True, gated=True)
    return model


def _narrow_block_attention():
    model = stock("cls")
    model.blocks[1].attn = Attention(STOCK["embed_dim"], num_heads=2, attn_head_dim=8)
    return model


@pytest.mark.parametrize(
    "make_model, match",
    [
        (lambda: nn.Sequential(nn.Conv2d(3, 8, 3)), "VisionTransformer"),
        (lambda: stock("cls", features_only=True, out_indices=(0, 1)), "VisionTransformer"),
        (lambda: stock("cls", attn_layer="diff"), "DiffAttention is not supported"),
        (lambda: stock("cls", block_fn=ParallelScalingBlock), "block 0"),
        (_gated_block_attention, "gated"),
        (_narrow_block_attention, "cannot carry over"),
        (lambda: stock("cls", patch_drop_rate=0.5), "patch_drop_rate"),
    ],
    ids=["not-a-vit", "features-wrapper", "diff-attention", "parallel-block", "gated", "attn_head_dim", "patch-drop"],
)
def test_convert_unsupported_raises_value_error(make_model, match):
    model = make_model()
    with pytest.raises(ValueError, match=match):
        visattn.convert(model, "linear", dwconv_kernel=3)


def test_convert_patch_drop_with_gridless_attention():
    model = visattn.convert(stock("cls", patch_drop_rate=0.5), "softmax").train()
    model(images()).sum().backward()


# Grid 17x19 with a class token and a register: the local types' windows cover a small part of it, so they
# run their tiled (gathered) path, not the dense one that short grids take; rope turns q and k, decay weights
# linear attention's keys by distance.
PRODUCTION_IMG = (136, 152)
PRODUCTION_CASES = [pytest.param(name, {"rope": "axial"}, id=f"{name}-rope") for name in visattn.list_attentions()] + [
    pytest.param("linear", {"decay": True, "dwconv_kernel": None}, id="linear-decay"),
    pytest.param("softmax", {"rope": "mixed"}, id="softmax-rope-mixed"),
]


# What the ops choose inside a compiled graph (visattn.ops.backends), where the local types run their
# tiled path on this grid as in eager
COMPILED_PATHS = {"linear": "plain", "projected_linear": "split", "axial": "sdpa", "decayed_linear": "autograd"}


@pytest.mark.compile
@pytest.mark.parametrize("attn, attn_kwargs", PRODUCTION_CASES)
def test_fullgraph_compiles_forward_and_backward_on_the_production_paths(attn, attn_kwargs):
    """``torch.compile(fullgraph=True)`` traces every type's training step as one graph (a graph break
    raises) on a grid where the paths of real images run, and the compiled gradients equal eager ones."""
    if attn in ("floor", "linformer") and "rope" in attn_kwargs:
        attn_kwargs = {}  # floor reads neither q nor k; linformer's projected keys have no position to turn
    model = tiny(attn, attn_kwargs, depth=1, img_size=PRODUCTION_IMG)
    x = images(PRODUCTION_IMG)

    def step(x):
        return model.forward_features(x).square().mean()

    # eager on the paths a compiled graph takes (on the CPU, eager training prefers its cache-blocked ones)
    with contextlib.ExitStack() as paths:
        for op, name in COMPILED_PATHS.items():
            paths.enter_context(force_backend(op, name))
        eager = torch.autograd.grad(step(x), [p for p in model.parameters() if p.requires_grad], allow_unused=True)
    # every case compiles the same code object: without a reset the cases add up to dynamo's recompile limit
    torch._dynamo.reset()
    compiled_step = torch.compile(step, fullgraph=True, backend="aot_eager")
    compiled = torch.autograd.grad(compiled_step(x), [p for p in model.parameters() if p.requires_grad], allow_unused=True)
    for e, c in zip(eager, compiled):
        assert (e is None) == (c is None)
        if e is not None:
            assert_rms_close(c, e, FP32_TOL, "grad")
