"""The tiled-inference module: a timm ViT applied to overlapping tiles of a large image, as one ``nn.Module``."""
from __future__ import annotations

import torch
import torch.nn as nn
from einops import rearrange
from timm.models.vision_transformer import VisionTransformer

from visattn.tiled.functional import (
    check_max_tile_batch,
    check_merge,
    check_model,
    check_tile_fits_model,
    model_tile,
    tiled_features,
)
from visattn.tiled.layout import pixel_pair, tile_layout

OUTPUT_FORMATS = ("NCHW", "NHWC")


class TiledViT(nn.Module):
    """``model`` run on tiles of ``tile`` pixels overlapping by ``overlap``, its tokens merged onto the image's
    patch grid, then pooled and classified by the model's own head.

    Args:
        model: a timm ``VisionTransformer`` (stock or visattn), e.g. ``load_trained_model(run_dir)``.
        tile: tile size in pixels, int or (h, w), a multiple of the patch size; default: the model's ``img_size``
            (a model built without ``dynamic_img_size`` takes no other).
        overlap: least overlap of neighbouring tiles in pixels, int or (h, w), a multiple of the patch size
            smaller than the tile.
        merge: ``"crop"`` (each token from the tile where it is most central) or ``"blend"`` (the
            centrality-weighted mean of the tiles covering it); see :func:`visattn.tiled.merge_tiles`.
        max_tile_batch: tiles per forward of the model; None: all tiles of the batch at once.
        features_only: ``forward`` returns the token map of :meth:`forward_token_map` instead of logits.
        output_fmt: layout of the token map: ``"NCHW"`` (B, C, H, W), as timm's ``forward_intermediates``, or
            ``"NHWC"`` (B, H, W, C).

    Images must be a multiple of the patch size and at least one tile in each direction. Gradients flow
    through every step, so the wrapper also trains.
    """

    def __init__(
        self,
        model: VisionTransformer,
        tile: int | tuple[int, int] | None = None,
        overlap: int | tuple[int, int] = 0,
        merge: str = "crop",
        max_tile_batch: int | None = None,
        features_only: bool = False,
        output_fmt: str = "NCHW",
    ) -> None:
        super().__init__()
        check_model(model)
        check_merge(merge)
        if output_fmt not in OUTPUT_FORMATS:
            raise ValueError(f"output_fmt must be one of {', '.join(OUTPUT_FORMATS)}, got {output_fmt!r}")
        check_max_tile_batch(max_tile_batch)
        tile = pixel_pair(model_tile(model) if tile is None else tile, "tile")
        # An image of exactly one tile checks the tile and the overlap against the patch size now, not at the
        # first forward.
        tile_layout(tile, tile, overlap, tuple(model.patch_embed.patch_size))
        check_tile_fits_model(model, tile)
        self.model = model
        self.tile, self.overlap, self.merge = tile, overlap, merge
        self.max_tile_batch = max_tile_batch
        self.features_only, self.output_fmt = features_only, output_fmt

    @property
    def num_classes(self) -> int:
        return self.model.num_classes

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """The wrapped model's gradient checkpointing (recompute each block in the backward)."""
        self.model.set_grad_checkpointing(enable)

    def forward_features(self, images: torch.Tensor) -> torch.Tensor:
        """(B, C, H_img, W_img) -> (B, P + H * W, C): the prefix tokens averaged over the tiles, then the merged
        patch grid, row-major: the layout of the wrapped model's ``forward_features``."""
        return tiled_features(self.model, images, self.tile, self.overlap, self.merge, self.max_tile_batch).tokens()

    def forward_head(self, tokens: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """The wrapped model's ``forward_head``: its pooling, ``fc_norm`` and ``head``."""
        return self.model.forward_head(tokens, pre_logits=pre_logits)

    def forward_token_map(self, images: torch.Tensor) -> torch.Tensor:
        """(B, C_img, H_img, W_img) -> the merged patch tokens (after the model's final norm) as a map:
        (B, C, H, W) for ``output_fmt="NCHW"``, (B, H, W, C) for ``"NHWC"``."""
        grid = tiled_features(self.model, images, self.tile, self.overlap, self.merge, self.max_tile_batch).grid
        return rearrange(grid, "b h w d -> b d h w") if self.output_fmt == "NCHW" else grid

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Logits (B, num_classes), or the token map with ``features_only``."""
        if self.features_only:
            return self.forward_token_map(images)
        return self.forward_head(self.forward_features(images))

    def extra_repr(self) -> str:
        return f"tile={self.tile}, overlap={self.overlap}, merge={self.merge!r}, max_tile_batch={self.max_tile_batch}"
