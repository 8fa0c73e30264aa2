"""visattn.tiled: the tile layout by hand, merging against its loop twin, one tile equal to the model itself, a
model without blocks whose merged map is known by hand, tiled models against running each tile alone, and bad
arguments."""
from __future__ import annotations

import json

import pytest
import timm
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file
from timm.models.vision_transformer import VisionTransformer

from tests.helpers import grads_of
from visattn.models import create_model
from visattn.predict import load_trained_model
from visattn.tiled import (
    MERGES,
    AxisTiles,
    TiledViT,
    cut_tiles,
    merge_tiles,
    naive_merge_tiles,
    tile_layout,
    tiled_features,
    tiled_forward,
)

PATCH = 4
TINY = dict(patch_size=PATCH, embed_dim=16, depth=1, num_heads=2, num_classes=5)


def _vit(img_size=16, **kwargs) -> VisionTransformer:
    return VisionTransformer(img_size=img_size, **{**TINY, **kwargs}).eval()


# Models whose heads pool differently: class token, average without class token but with register tokens,
# attention pooling, and a visattn model (its layers need the grid of each tile).
MODELS = {
    "token": lambda size: _vit(size),
    "avg-reg": lambda size: _vit(size, class_token=False, global_pool="avg", reg_tokens=2),
    "map": lambda size: _vit(size, global_pool="map"),
    "visattn-axial": lambda size: create_model("visattn_vit_tiny_patch16", attn="axial", img_size=size, **TINY).eval(),
}


def _per_tile_reference(model, images, tile, overlap, merge):
    """The model run on each tile alone, cut by hand from the pixel boxes, merged by the loop twin."""
    layout = tile_layout(tuple(images.shape[-2:]), tile, overlap, (PATCH, PATCH))
    features = torch.stack(
        [model.forward_features(images[:, :, top:top + h, left:left + w]) for top, left, h, w in layout.boxes()], dim=1
    )  # (B, tiles, P + h * w, C)
    prefix_count = model.num_prefix_tokens
    grid = naive_merge_tiles(features[:, :, prefix_count:], layout, merge)
    tokens = torch.cat([features[:, :, :prefix_count].mean(dim=1), grid.flatten(1, 2)], dim=1)
    return grid, model.forward_head(tokens)


# ---------------------------------------------------------------------------------------------------
# The layout


@pytest.mark.parametrize(
    "length, size, stride, starts",
    [(7, 3, 2, (0, 2, 4)), (5, 4, 2, (0, 1)), (6, 4, 2, (0, 2)), (10, 3, 3, (0, 3, 6, 7)), (4, 4, 1, (0,))],
    ids=["exact", "last-moved-back", "two", "overlap-0-last-moved-back", "one"],
)
def test_tiles_start_every_stride_and_the_last_ends_at_the_edge(length, size, stride, starts):
    assert AxisTiles.cover(length, size, stride).starts == starts


def test_layout_in_pixels_of_a_non_square_image():
    layout = tile_layout((24, 20), 16, 8, (PATCH, PATCH))
    assert layout.grid == (6, 5) and layout.tile_grid == (4, 4) and layout.tile_counts == (2, 2)
    assert layout.boxes() == [(0, 0, 16, 16), (0, 4, 16, 16), (8, 0, 16, 16), (8, 4, 16, 16)]
    images = torch.randn(2, 3, 24, 20)
    tiles = cut_tiles(images, layout)  # (B * tiles, C, 16, 16), row-major within each image
    expected = [images[b, :, top:top + h, left:left + w] for b in range(2) for top, left, h, w in layout.boxes()]
    assert torch.equal(tiles, torch.stack(expected))


@pytest.mark.parametrize("merge", MERGES)
@settings(max_examples=25, deadline=None)
@given(
    rows=st.tuples(st.integers(1, 6), st.integers(0, 3), st.integers(0, 3)),
    cols=st.tuples(st.integers(1, 6), st.integers(0, 3), st.integers(0, 3)),
    batch=st.integers(1, 2),
)
def test_merge_equals_its_loop_twin_with_gradients(merge, rows, cols, batch):
    """Tile size t, overlap o < t and extra length e >= 0 per axis, drawn in patches."""
    (th, oh, eh), (tw, ow, ew) = rows, cols
    oh, ow = min(oh, th - 1), min(ow, tw - 1)
    layout = tile_layout(((th + eh) * PATCH, (tw + ew) * PATCH), (th * PATCH, tw * PATCH), (oh * PATCH, ow * PATCH),
                         (PATCH, PATCH))
    tokens = torch.randn(batch, layout.num_tiles, th * tw, 3, dtype=torch.float64)
    out, grads = grads_of(lambda t: merge_tiles(t, layout, merge), tokens)
    ref, ref_grads = grads_of(lambda t: naive_merge_tiles(t, layout, merge), tokens)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grads[0], ref_grads[0], rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------------
# One tile is the model itself


@pytest.mark.parametrize("merge", MERGES)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_one_tile_equals_the_wrapped_model_exactly(name, merge):
    model = MODELS[name]((16, 24))  # non-square: 4 x 6 patches
    images = torch.randn(2, 3, 16, 24)
    with torch.inference_mode():
        assert torch.equal(TiledViT(model, merge=merge)(images), model(images))
        tokens = model.forward_features(images)[:, model.num_prefix_tokens:]  # (B, 4 * 6, C)
        nhwc = TiledViT(model, merge=merge, features_only=True, output_fmt="NHWC")(images)
        nchw = TiledViT(model, merge=merge, features_only=True)(images)
    assert torch.equal(nhwc, tokens.reshape(2, 4, 6, -1))
    assert torch.equal(nchw, tokens.reshape(2, 4, 6, -1).permute(0, 3, 1, 2))


# ---------------------------------------------------------------------------------------------------
# A model without blocks: each token is the patch embedding of its pixels plus the position of its tile

# Image 24 x 20 px in 4 px patches (6 x 5), tiles 16 px (4 x 4) overlapping by 8 px: rows start at 0 and 2,
# columns at 0 and 1 (the second tile moved back to end at the edge). Centrality within a 4-token tile:
# 1, 2, 2, 1.
# crop: the tile offset each position is taken from (ties go to the earlier tile).
CROP_ROW_OFFSETS = [0, 1, 2, 1, 2, 3]  # position 2: offset 2 of tile 0 (2) beats offset 0 of tile 1 (1)
CROP_COL_OFFSETS = [0, 1, 2, 2, 3]  # position 2: offset 2 of tile 0 (2) ties offset 1 of tile 1 (2): tile 0
# blend: weight of each tile offset at each position, centrality over the sum of centralities.
BLEND_ROWS = [[1, 0, 0, 0], [0, 1, 0, 0], [1 / 3, 0, 2 / 3, 0], [0, 2 / 3, 0, 1 / 3], [0, 0, 1, 0], [0, 0, 0, 1]]
BLEND_COLS = [[1, 0, 0, 0], [1 / 3, 2 / 3, 0, 0], [0, 1 / 2, 1 / 2, 0], [0, 0, 2 / 3, 1 / 3], [0, 0, 0, 1]]


@pytest.fixture
def embedding_only():
    """A class-token ViT of no blocks and no final norm, with random positions: the token of tile patch
    (y, x) is patch_embed(its pixels) + pos_embed[y, x]."""
    model = VisionTransformer(img_size=16, patch_size=PATCH, embed_dim=8, depth=0, num_heads=2, num_classes=0).eval()
    model.norm = nn.Identity()
    nn.init.normal_(model.pos_embed)
    nn.init.normal_(model.cls_token)
    return model


@pytest.mark.parametrize("merge", MERGES)
def test_merged_map_is_the_full_image_patch_embedding_plus_the_tile_positions(embedding_only, merge):
    images = torch.randn(2, 3, 24, 20)
    proj = embedding_only.patch_embed.proj
    full_image = F.conv2d(images, proj.weight, proj.bias, stride=PATCH).permute(0, 2, 3, 1)  # (B, 6, 5, C)
    positions = embedding_only.pos_embed[0, 1:].reshape(4, 4, -1)  # (tile rows, tile cols, C)
    if merge == "crop":
        expected_positions = positions[CROP_ROW_OFFSETS][:, CROP_COL_OFFSETS]
    else:
        expected_positions = torch.einsum("ia,abd,jb->ijd", torch.tensor(BLEND_ROWS), positions, torch.tensor(BLEND_COLS))
    with torch.inference_mode():
        features = tiled_features(embedding_only, images, tile=16, overlap=8, merge=merge)
    torch.testing.assert_close(features.grid, full_image + expected_positions, rtol=1e-6, atol=1e-6)
    # The class token sees no pixels, so every tile's is the same: its mean is that token.
    class_token = embedding_only.cls_token[0] + embedding_only.pos_embed[0, :1]
    torch.testing.assert_close(features.prefix, class_token.expand(2, 1, 8))


# ---------------------------------------------------------------------------------------------------
# Tiles against the model run on each tile alone


@pytest.mark.parametrize("merge", MERGES)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_tiled_model_equals_each_tile_run_alone(name, merge):
    model = MODELS[name](16)
    images = torch.randn(2, 3, 24, 36)  # 6 x 9 patches: 2 x 3 tiles of 4 x 4 with an 8 px overlap
    with torch.inference_mode():
        grid, logits = _per_tile_reference(model, images, 16, 8, merge)
        features = tiled_features(model, images, tile=16, overlap=8, merge=merge)
        out = tiled_forward(model, images, tile=16, overlap=8, merge=merge)
        chunked = TiledViT(model, overlap=8, merge=merge, max_tile_batch=4)(images)
        alone = torch.cat([TiledViT(model, overlap=8, merge=merge)(image[None]) for image in images])
    torch.testing.assert_close(features.grid, grid, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(chunked, out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(alone, out, rtol=1e-5, atol=1e-5)


def test_crop_and_blend_differ_only_where_tiles_overlap():
    model = MODELS["token"](16)
    images = torch.randn(1, 3, 16, 28)  # 4 x 7 patches: columns start at 0 and 3, overlapping in column 3 only
    with torch.inference_mode():
        crop, blend = (TiledViT(model, features_only=True, output_fmt="NHWC", merge=m)(images) for m in MERGES)
    differs = (crop - blend).abs().amax(dim=(0, 1, 3)) > 1e-6  # (7,) per column
    assert differs.tolist() == [False, False, False, True, False, False, False]


def test_class_token_logits_are_the_mean_of_the_tiles_logits():
    model = MODELS["token"](16)
    images = torch.randn(2, 3, 32, 24)
    layout = tile_layout((32, 24), 16, 0, (PATCH, PATCH))
    with torch.inference_mode():
        tiles = [model(images[:, :, top:top + h, left:left + w]) for top, left, h, w in layout.boxes()]
        out = TiledViT(model)(images)
    torch.testing.assert_close(out, torch.stack(tiles).mean(dim=0), rtol=1e-5, atol=1e-5)


def test_a_model_built_for_any_size_takes_other_tiles_and_trains():
    model = _vit(16, dynamic_img_size=True, global_pool="avg", class_token=False).train()
    tiled = TiledViT(model, tile=(8, 12), overlap=(4, 0))
    images = torch.randn(2, 3, 16, 24)
    F.cross_entropy(tiled(images), torch.tensor([1, 3])).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    with torch.inference_mode():
        grid, logits = _per_tile_reference(model.eval(), images, (8, 12), (4, 0), "crop")
        torch.testing.assert_close(tiled(images), logits, rtol=1e-5, atol=1e-5)


def test_a_trained_run_wraps_at_its_training_size(tmp_path):
    """load_trained_model gives the model trained at tile size; the wrapper runs it on larger images."""
    kwargs = dict(attn="linear", img_size=16, **TINY)
    trained = create_model("visattn_vit_tiny_patch16", **kwargs).eval()
    save_file(trained.state_dict(), tmp_path / "model_best.safetensors")
    (tmp_path / "model.json").write_text(json.dumps({"model": "visattn_vit_tiny_patch16", "kwargs": kwargs}))
    tiled = TiledViT(load_trained_model(tmp_path), overlap=8)
    images = torch.randn(1, 3, 32, 32)
    with torch.inference_mode():
        _, expected = _per_tile_reference(trained, images, 16, 8, "crop")
        torch.testing.assert_close(tiled(images), expected, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------------
# Bad arguments


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(tile=10), "tile height must be a positive multiple of the patch size 4 px, got 10"),
        (dict(tile=(16, 0)), "tile width must be a positive multiple of the patch size 4 px, got 0"),
        (dict(tile=16.0), r"tile must be an int or a pair of ints \(height, width\) in pixels, got 16.0"),
        (dict(overlap=16), r"overlap height must be a multiple of the patch size 4 px in \[0, tile height 16\), got 16"),
        (dict(overlap=(0, 6)), r"overlap width must be a multiple of the patch size 4 px in \[0, tile width 16\), got 6"),
        (dict(overlap=-4), "overlap height must be a multiple"),
        (dict(merge="mean"), "merge must be one of crop, blend, got 'mean'"),
        (dict(max_tile_batch=0), "max_tile_batch must be None"),
        (dict(output_fmt="NLC"), "output_fmt must be one of NCHW, NHWC, got 'NLC'"),
        (dict(tile=32), r"the model takes 16x16 px images only \(built without dynamic_img_size\), so tile must be 16x16"),
    ],
)
def test_bad_arguments_are_one_line_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TiledViT(_vit(16), **kwargs)


@pytest.mark.parametrize(
    "shape, message",
    [
        ((1, 3, 12, 32), "image height 12 px is smaller than the tile height 16 px"),
        ((1, 3, 32, 30), "image width 30 px is not a multiple of the patch size 4 px"),
        ((3, 32, 32), r"images must be \(B, C, H, W\), got shape \(3, 32, 32\)"),
    ],
)
def test_bad_images_are_one_line_errors(shape, message):
    with pytest.raises(ValueError, match=message):
        TiledViT(_vit(16))(torch.randn(shape))


def test_only_a_timm_vit_is_wrapped_and_patch_dropout_is_refused():
    with pytest.raises(ValueError, match="tiled inference wraps a timm VisionTransformer"):
        TiledViT(timm.create_model("resnet18", num_classes=2))
    dropping = _vit(16, patch_drop_rate=0.5).train()
    with pytest.raises(ValueError, match="patch dropout"):
        TiledViT(dropping)(torch.randn(1, 3, 32, 32))
