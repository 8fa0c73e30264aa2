"""Tiled inference as functions: cut an image into tiles, run a timm ViT on all of them as one batch, merge
the tiles' tokens back onto the image's patch grid, and classify the merged tokens with the model's head.

* :func:`cut_tiles` and :func:`merge_tiles` (with its loop twin :func:`naive_merge_tiles`) move tensors;
* :func:`tiled_features` runs the model on the tiles: the merged patch grid and the prefix tokens;
* :func:`tiled_forward` puts them back into one token sequence and calls the model's ``forward_head``.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn as nn
from einops import rearrange
from timm.models.vision_transformer import VisionTransformer

from visattn.tiled.layout import MERGES, TileLayout, pixel_pair, tile_layout


class TiledFeatures(NamedTuple):
    """The tokens of a tiled forward: ``prefix`` (B, P, C), the class and register tokens averaged over the
    tiles; ``grid`` (B, H, W, C), the patch tokens merged onto the image's patch grid."""

    prefix: torch.Tensor
    grid: torch.Tensor

    def tokens(self) -> torch.Tensor:
        """(B, P + H * W, C): the layout of the wrapped model's ``forward_features``, which its
        ``forward_head`` takes."""
        return torch.cat([self.prefix, rearrange(self.grid, "b h w d -> b (h w) d")], dim=1)


def check_merge(merge: str) -> None:
    if merge not in MERGES:
        raise ValueError(f"merge must be one of {', '.join(MERGES)}, got {merge!r}")


def check_max_tile_batch(max_tile_batch: int | None) -> None:
    if max_tile_batch is not None and (not isinstance(max_tile_batch, int) or max_tile_batch < 1):
        raise ValueError(f"max_tile_batch must be None (all tiles at once) or an int >= 1, got {max_tile_batch!r}")


def check_model(model: nn.Module) -> None:
    """ValueError unless ``model`` is a timm ``VisionTransformer`` (stock, or a visattn one)."""
    if not isinstance(model, VisionTransformer):
        raise ValueError(
            f"tiled inference wraps a timm VisionTransformer (timm 'vit_*' models, visattn_vit_*), got {type(model).__name__}"
        )


def model_tile(model: VisionTransformer) -> tuple[int, int]:
    """The image size the model was built for, (h, w) pixels: the default tile."""
    return tuple(model.patch_embed.img_size)


def check_tile_fits_model(model: VisionTransformer, tile: tuple[int, int]) -> None:
    """A model built without ``dynamic_img_size`` takes images of its ``img_size`` only."""
    built = model_tile(model)
    if not model.dynamic_img_size and tuple(tile) != built:
        raise ValueError(
            f"the model takes {built[0]}x{built[1]} px images only (built without dynamic_img_size), so tile must be "
            f"{built[0]}x{built[1]}, got {tile[0]}x{tile[1]}; build it with dynamic_img_size=True for other tile sizes"
        )


def cut_tiles(images: torch.Tensor, layout: TileLayout) -> torch.Tensor:
    """(B, C, H_img, W_img) -> (B * tiles, C, tile_h, tile_w): the tiles of each image, row-major."""
    (ph, pw), (th, tw) = layout.patch_size, layout.tile_grid
    device = images.device
    rows = torch.tensor(layout.rows.starts, device=device)[:, None] * ph + torch.arange(th * ph, device=device)
    cols = torch.tensor(layout.cols.starts, device=device)[:, None] * pw + torch.arange(tw * pw, device=device)
    tiles = images[:, :, rows[:, None, :, None], cols[None, :, None, :]]  # (B, C, tiles_h, tiles_w, tile_h, tile_w)
    return rearrange(tiles, "b c r s y x -> (b r s) c y x")


def merge_tiles(tokens: torch.Tensor, layout: TileLayout, merge: str = "crop") -> torch.Tensor:
    """(B, tiles, h * w, C) patch tokens of each tile, row-major -> (B, H, W, C) on the image's patch grid.

    ``crop``: each position takes the token of the tile where it is most central (per axis; ties to the
    earlier tile). ``blend``: each position is the mean of the tokens of every tile covering it, weighted by
    their centrality (the product over both axes of 1 + the distance in tokens to the tile's nearer edge).
    """
    check_merge(merge)
    (count_h, count_w), (th, tw) = layout.tile_counts, layout.tile_grid
    tiles = rearrange(tokens, "b (r s) (y x) d -> b r s y x d", r=count_h, s=count_w, y=th, x=tw)
    device = tokens.device
    if merge == "crop":
        row_tile, row_offset = (index.to(device) for index in layout.rows.crop_index())  # (H,) each
        col_tile, col_offset = (index.to(device) for index in layout.cols.crop_index())  # (W,) each
        return tiles[:, row_tile[:, None], col_tile[None, :], row_offset[:, None], col_offset[None, :]]
    rows = layout.rows.blend_weights().to(device=device, dtype=tokens.dtype)  # (tiles_h, h, H)
    cols = layout.cols.blend_weights().to(device=device, dtype=tokens.dtype)  # (tiles_w, w, W)
    merged = torch.einsum("brsyxd,ryh->bshxd", tiles, rows)  # the row axis merged: (B, tiles_w, H, w, C)
    return torch.einsum("bshxd,sxw->bhwd", merged, cols)


def naive_merge_tiles(tokens: torch.Tensor, layout: TileLayout, merge: str = "crop") -> torch.Tensor:
    """:func:`merge_tiles`, one tile and one token at a time: the reference it is tested against."""
    check_merge(merge)
    batch, _, _, dim = tokens.shape
    (th, tw), (height, width) = layout.tile_grid, layout.grid
    origins = [(top, left) for top in layout.rows.starts for left in layout.cols.starts]

    def centrality(offset: int, size: int) -> int:
        return min(offset, size - 1 - offset) + 1

    total = tokens.new_zeros(batch, height, width, dim)
    weight = [[0.0] * width for _ in range(height)]
    best = [[(0, 0)] * width for _ in range(height)]  # crop: (row, column) centrality of the kept token
    for index, (top, left) in enumerate(origins):
        for y in range(th):
            for x in range(tw):
                token = tokens[:, index, y * tw + x]  # (B, C)
                key = (centrality(y, th), centrality(x, tw))
                i, j = top + y, left + x
                if merge == "blend":
                    total[:, i, j] += key[0] * key[1] * token
                    weight[i][j] += key[0] * key[1]
                elif key > best[i][j]:  # strictly more central; tiles come row-major, so ties keep the earlier
                    best[i][j] = key
                    total[:, i, j] = token
    if merge == "blend":
        total = total / torch.tensor(weight, dtype=tokens.dtype, device=tokens.device)[None, :, :, None]
    return total


def tiled_features(
    model: VisionTransformer,
    images: torch.Tensor,
    tile: int | tuple[int, int] | None = None,
    overlap: int | tuple[int, int] = 0,
    merge: str = "crop",
    max_tile_batch: int | None = None,
) -> TiledFeatures:
    """Run ``model.forward_features`` on the tiles of ``images`` (B, C, H_img, W_img) and merge them.

    Args:
        model: a timm ``VisionTransformer`` (stock or visattn); it takes tiles of ``tile`` pixels, so one built
            without ``dynamic_img_size`` needs ``tile`` equal to its ``img_size``.
        tile: tile size in pixels, an int or (h, w), a multiple of the patch size; default: the model's ``img_size``.
        overlap: pixels by which neighbouring tiles overlap at least, an int or (h, w), a multiple of the patch
            size, smaller than the tile.
        merge: ``"crop"`` or ``"blend"``, see :func:`merge_tiles`.
        max_tile_batch: tiles per forward of the model (all tiles of the batch at once when None).
    Returns:
        the merged patch grid (B, H, W, C) and the prefix tokens averaged over each image's tiles (B, P, C).
    Raises:
        ValueError: see :func:`~visattn.tiled.layout.tile_layout`, a model or tile the model cannot take, an
            unknown ``merge``, a ``max_tile_batch`` below 1, or a model that drops patch tokens.
    """
    check_model(model)
    check_merge(merge)
    check_max_tile_batch(max_tile_batch)
    if images.ndim != 4:
        raise ValueError(f"images must be (B, C, H, W), got shape {tuple(images.shape)}")
    tile = pixel_pair(model_tile(model) if tile is None else tile, "tile")
    check_tile_fits_model(model, tile)
    layout = tile_layout(tuple(images.shape[-2:]), tile, overlap, tuple(model.patch_embed.patch_size))
    tiles = cut_tiles(images, layout)  # (B * tiles, C, tile_h, tile_w)
    chunks = tiles.split(max_tile_batch) if max_tile_batch else (tiles,)
    features = torch.cat([model.forward_features(chunk) for chunk in chunks])  # (B * tiles, P + h * w, C)
    prefix_count = model.num_prefix_tokens
    expected = prefix_count + layout.tile_grid[0] * layout.tile_grid[1]
    if features.shape[1] != expected:
        raise ValueError(
            f"the model returned {features.shape[1]} tokens per tile, not its {prefix_count} prefix tokens + the "
            f"{layout.tile_grid[0]}x{layout.tile_grid[1]} patch grid; patch dropout (patch_drop_rate > 0 in training "
            "mode) leaves no grid to merge: use model.eval() or patch_drop_rate=0"
        )
    features = rearrange(features, "(b t) n d -> b t n d", b=images.shape[0])
    prefix = features[:, :, :prefix_count].mean(dim=1)  # (B, P, C)
    return TiledFeatures(prefix, merge_tiles(features[:, :, prefix_count:], layout, merge))


def tiled_forward(
    model: VisionTransformer,
    images: torch.Tensor,
    tile: int | tuple[int, int] | None = None,
    overlap: int | tuple[int, int] = 0,
    merge: str = "crop",
    max_tile_batch: int | None = None,
    pre_logits: bool = False,
) -> torch.Tensor:
    """(B, C, H_img, W_img) -> (B, num_classes): :func:`tiled_features`, then the model's own ``forward_head``
    (its pooling, ``fc_norm`` and ``head``) on the merged tokens; ``pre_logits``: the pooled features instead."""
    features = tiled_features(model, images, tile, overlap, merge, max_tile_batch)
    return model.forward_head(features.tokens(), pre_logits=pre_logits)
