"""Tiled prediction: each image at its own size, not resized, cut into tiles the model takes and merged on
its patch grid by :class:`visattn.tiled.TiledViT` before the model's head classifies it.

    predictor = load_predictor("runs/digits-axial", dynamic_img_size=True)   # tiles of any size
    results = predict(predictor, ["large.png"], tiling=Tiling(tile=16, overlap=8))

The image is normalised with the run's recorded mean and std and its edges cropped evenly to a multiple of the
patch size (fewer than one patch of pixels per axis); an image smaller than a tile is a :class:`Prediction`
error, not a resize.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torchvision.transforms.functional as TF
from PIL import Image

from visattn.tiled import TiledViT


@dataclass(frozen=True)
class Tiling:
    """Tiles of ``tile`` pixels (an int or (h, w); None: the model's ``img_size``) overlapping by at least
    ``overlap`` pixels, merged by ``merge`` ("crop" or "blend"); see :class:`visattn.tiled.TiledViT`."""

    tile: int | tuple[int, int] | None = None
    overlap: int | tuple[int, int] = 0
    merge: str = "crop"

    def wrap(self, model: nn.Module, max_tile_batch: int) -> TiledViT:
        """``model`` as a :class:`TiledViT` with these tiles; ValueError for a tile or overlap it cannot take."""
        return TiledViT(model, self.tile, self.overlap, self.merge, max_tile_batch)


def tiled_input(image: Image.Image, data_config: dict[str, Any], patch_size: tuple[int, int]) -> torch.Tensor:
    """RGB ``image`` -> (3, H, W): normalised with ``data_config``'s mean and std, not resized, each axis cropped
    evenly on both sides to the largest multiple of its patch size."""
    tensor = TF.normalize(TF.to_tensor(image), data_config["mean"], data_config["std"])  # (3, H_img, W_img)
    height, width = (size - size % patch for size, patch in zip(tensor.shape[-2:], patch_size))
    top, left = (tensor.shape[-2] - height) // 2, (tensor.shape[-1] - width) // 2
    return tensor[:, top:top + height, left:left + width]


def smaller_than_tile(image: Image.Image, tile: tuple[int, int]) -> str | None:
    """Why ``image`` cannot be tiled with ``tile`` (h, w) pixels, or None when it can. A tile is a multiple of
    the patch, so cropping the image to the patch never makes it smaller than a tile it was not smaller than."""
    width, height = image.size
    if height < tile[0] or width < tile[1]:
        return f"image {height}x{width} px is smaller than the tile {tile[0]}x{tile[1]} px; use a smaller tile"
    return None
