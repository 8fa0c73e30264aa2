"""The convolutional stem: its strides and channels, the PatchEmbed contract it keeps (patch size, grid,
tokens), and models built with it through timm and visattn."""
from __future__ import annotations

import pytest
import timm
import torch
import torch.nn as nn
from timm.layers import PatchEmbed

import visattn  # noqa: F401  (registers visattn_vit_*)
from visattn.layers.patch_embed import ConvPatchEmbed, get_stem, stem_strides
from visattn.models import create_model


@pytest.mark.parametrize("patch, steps, rest", [
    ((4, 4), 2, (1, 1)), ((16, 16), 4, (1, 1)), ((14, 14), 1, (7, 7)), ((4, 8), 2, (1, 2)), ((2, 2), 1, (1, 1)),
])
def test_strides_take_every_shared_factor_of_two_and_leave_the_rest_to_the_last_convolution(patch, steps, rest):
    found, left = stem_strides(patch)
    assert found == [(2, 2)] * steps and left == rest
    product = (2**steps * rest[0], 2**steps * rest[1])
    assert product == patch


def _convs(embed: nn.Module) -> list[nn.Conv2d]:
    return [m for m in embed.proj.modules() if isinstance(m, nn.Conv2d)]


def test_channels_double_up_to_the_width_then_a_1x1_projection():
    embed = ConvPatchEmbed(img_size=64, patch_size=16, in_chans=3, embed_dim=192)
    convs = _convs(embed)
    assert [(c.in_channels, c.out_channels) for c in convs] == [(3, 24), (24, 48), (48, 96), (96, 192), (192, 192)]
    assert [tuple(c.stride) for c in convs] == [(2, 2)] * 4 + [(1, 1)]
    assert [tuple(c.kernel_size) for c in convs] == [(3, 3)] * 4 + [(1, 1)]
    assert sum(isinstance(m, nn.BatchNorm2d) for m in embed.modules()) == 4


@pytest.mark.parametrize("img, patch", [((64, 96), 4), ((56, 28), 14), ((32, 64), (4, 8))])
def test_patch_size_grid_and_tokens_are_those_of_timms_patch_embed(img, patch):
    ours = ConvPatchEmbed(img_size=img, patch_size=patch, embed_dim=32)
    timms = PatchEmbed(img_size=img, patch_size=patch, embed_dim=32)
    assert ours.patch_size == timms.patch_size and ours.grid_size == timms.grid_size
    assert ours.num_patches == timms.num_patches
    x = torch.randn(2, 3, *img)
    assert ours(x).shape == timms(x).shape == (2, timms.num_patches, 32)


def test_a_token_sees_its_own_patch_and_a_rim_of_its_neighbours_only():
    """Changing one pixel moves only the tokens whose receptive field holds it: for patch 4 (two 3x3
    stride-2 convolutions with padding 1, and a 1x1) token j sees pixels 4j-3 .. 4j+3 on each axis (its own
    patch and 3 px before it), so the pixel at (9, 9), in patch (2, 2), moves tokens (2..3) x (2..3)."""
    torch.manual_seed(0)
    embed = ConvPatchEmbed(img_size=32, patch_size=4, embed_dim=8).eval()
    x = torch.randn(1, 3, 32, 32)
    y = x.clone()
    y[0, :, 9, 9] += 1.0
    moved = (embed(x) - embed(y)).abs().sum(-1)[0].reshape(8, 8) > 0
    expected = torch.zeros(8, 8, dtype=torch.bool)
    expected[2:4, 2:4] = True
    assert torch.equal(moved, expected)


def test_a_patch_with_no_factor_of_two_is_one_line():
    with pytest.raises(ValueError, match="stem conv: patch size 5x5 has no factor of 2 shared by both sides"):
        ConvPatchEmbed(img_size=20, patch_size=5)


@pytest.mark.parametrize("name", ["visattn_vit_tiny_patch16", "vit_tiny_patch16_224"])
def test_the_models_take_the_stem_by_name_not_as_embed_layer(name):
    with pytest.raises(ValueError, match=r"choose the patch embedding with stem= \(one of patch, conv\), not embed_layer="):
        create_model(name, embed_layer=ConvPatchEmbed, pretrained=True)


def test_an_unknown_stem_names_the_accepted_ones():
    with pytest.raises(ValueError, match="stem 'cnn' is not one of patch, conv"):
        get_stem("cnn")


@pytest.mark.parametrize("name", ["visattn_vit_tiny_patch16", "vit_tiny_patch16_224"])
def test_models_built_with_the_conv_stem_run_their_attention_on_the_right_grid(name):
    model = create_model(name, attn="axial", stem="conv", img_size=(64, 96), patch_size=8, embed_dim=32, depth=2,
                         num_heads=2, num_classes=5)
    assert isinstance(model.patch_embed, ConvPatchEmbed)
    out = model(torch.randn(2, 3, 64, 96))
    assert out.shape == (2, 5)
    assert model.blocks[0].attn.grid == (8, 12)


def test_timm_create_model_takes_the_stem_by_name():
    model = timm.create_model("visattn_vit_tiny_patch16", attn="linear", stem="conv", img_size=32, patch_size=4,
                              embed_dim=16, depth=1, num_heads=2, num_classes=3)
    assert isinstance(model.patch_embed, ConvPatchEmbed)
    assert type(timm.create_model("visattn_vit_tiny_patch16", img_size=32, patch_size=4, embed_dim=16, depth=1,
                                  num_heads=2).patch_embed) is PatchEmbed


@pytest.mark.parametrize("file_stem, model_stem", [("patch", "conv"), ("conv", "patch")])
def test_weights_of_one_stem_loaded_into_the_other_are_one_line_naming_both(file_stem, model_stem):
    from visattn.models import load_weights

    shape = dict(img_size=32, patch_size=4, embed_dim=16, depth=1, num_heads=2, num_classes=3)
    source = create_model("visattn_vit_tiny_patch16", attn="linear", stem=file_stem, **shape)
    model = create_model("visattn_vit_tiny_patch16", attn="linear", stem=model_stem, **shape)
    with pytest.raises(ValueError, match=f"^the weights are of a model with stem '{file_stem}', the model has stem "
                                         f"'{model_stem}'; build it with stem='{file_stem}'"):
        load_weights(model, source.state_dict())
    same = create_model("visattn_vit_tiny_patch16", attn="axial", stem=file_stem, **shape)
    assert load_weights(same, source.state_dict()).kept_init == []
