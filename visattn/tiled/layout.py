"""Where the tiles of an image lie, and how much each tile's token counts where tiles overlap.

Everything here is counted in patches: a tile of ``tile`` pixels with patches of ``p`` pixels is ``tile / p``
tokens long, and its tokens fall on the image's patch grid because every tile starts on a patch boundary.

Along one axis of ``length`` tokens, tiles of ``size`` tokens start every ``stride = size - overlap`` tokens,
and the last one is moved back to end at the image edge: starts ``0, s, 2s, ...`` while a tile still ends
inside the image, then ``length - size``. The last two tiles may thus overlap by more than ``overlap``.

The two axes are independent: the tiles of an image are every (row start, column start) pair, row-major,
and each weight or choice below is made per axis, so that the 2D one is their product.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

MERGES = ("crop", "blend")


@dataclass(frozen=True)
class AxisTiles:
    """The tiles along one axis: ``starts`` (tokens) of tiles ``size`` tokens long on an axis ``length`` long."""

    length: int
    size: int
    starts: tuple[int, ...]

    @classmethod
    def cover(cls, length: int, size: int, stride: int) -> AxisTiles:
        """Tiles every ``stride`` tokens, the last one ending at ``length``."""
        count = math.ceil((length - size) / stride) + 1
        return cls(length, size, tuple(min(k * stride, length - size) for k in range(count)))

    def centrality(self) -> torch.Tensor:
        """(tiles, length) int64: for each tile and position it covers, 1 + the distance in tokens to the
        nearer edge of the tile; 0 where the tile does not cover the position."""
        position = torch.arange(self.length)
        offset = position[None, :] - torch.tensor(self.starts)[:, None]  # (tiles, length)
        inside = (offset >= 0) & (offset < self.size)
        return torch.where(inside, torch.minimum(offset, self.size - 1 - offset) + 1, 0)

    def crop_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(tile, offset in the tile) of each position, each (length,) int64: the tile where the position is
        most central, the earlier one on a tie."""
        centrality = self.centrality()
        # argmax returns the first maximum on CPU and CUDA alike: ties go to the earlier tile.
        owner = centrality.argmax(dim=0)
        return owner, torch.arange(self.length) - torch.tensor(self.starts)[owner]

    def blend_weights(self) -> torch.Tensor:
        """(tiles, size, length) float64: the weight of token ``y`` of tile ``k`` at position ``i``, nonzero
        only where ``starts[k] + y == i``, proportional to its centrality; each position's weights sum to 1."""
        centrality = self.centrality().double()
        normalized = centrality / centrality.sum(dim=0, keepdim=True)  # (tiles, length)
        offset = torch.arange(self.length)[None, :] - torch.tensor(self.starts)[:, None]  # (tiles, length)
        placed = offset[:, None, :] == torch.arange(self.size)[None, :, None]  # (tiles, size, length)
        return torch.where(placed, normalized[:, None, :], 0.0)


@dataclass(frozen=True)
class TileLayout:
    """The tiles of an image: ``rows`` and ``cols`` in tokens, ``patch_size`` (h, w) in pixels."""

    rows: AxisTiles
    cols: AxisTiles
    patch_size: tuple[int, int]

    @property
    def grid(self) -> tuple[int, int]:
        """The image's patch grid (H, W)."""
        return self.rows.length, self.cols.length

    @property
    def tile_grid(self) -> tuple[int, int]:
        """One tile's patch grid (h, w)."""
        return self.rows.size, self.cols.size

    @property
    def tile_counts(self) -> tuple[int, int]:
        """Tiles along the rows and along the columns."""
        return len(self.rows.starts), len(self.cols.starts)

    @property
    def num_tiles(self) -> int:
        return len(self.rows.starts) * len(self.cols.starts)

    def boxes(self) -> list[tuple[int, int, int, int]]:
        """(top, left, height, width) of every tile in pixels, row-major."""
        (ph, pw), (th, tw) = self.patch_size, self.tile_grid
        return [(r * ph, c * pw, th * ph, tw * pw) for r in self.rows.starts for c in self.cols.starts]


def pixel_pair(value: int | tuple[int, int], name: str) -> tuple[int, int]:
    """``value`` as (height, width); ValueError naming ``name`` unless an int or a pair of ints."""
    pair = (value, value) if isinstance(value, int) else tuple(value) if isinstance(value, (tuple, list)) else ()
    if len(pair) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in pair):
        raise ValueError(f"{name} must be an int or a pair of ints (height, width) in pixels, got {value!r}")
    return pair


def tile_layout(
    image_size: tuple[int, int],
    tile: int | tuple[int, int],
    overlap: int | tuple[int, int],
    patch_size: tuple[int, int],
) -> TileLayout:
    """The tiles of an image of ``image_size`` (H, W) pixels: ``tile`` pixels each (an int, or (h, w)),
    overlapping by at least ``overlap`` pixels, for a model with patches of ``patch_size`` (h, w) pixels.

    Raises:
        ValueError: a tile that is not a positive multiple of the patch, an overlap that is not a multiple
            of the patch in [0, tile), an image that is not a multiple of the patch or smaller than a tile.
    """
    tile, overlap = pixel_pair(tile, "tile"), pixel_pair(overlap, "overlap")
    axes = []
    for axis, size, step, image, patch in zip(("height", "width"), tile, overlap, image_size, patch_size):
        if size < patch or size % patch:
            raise ValueError(f"tile {axis} must be a positive multiple of the patch size {patch} px, got {size}")
        if not 0 <= step < size or step % patch:
            raise ValueError(
                f"overlap {axis} must be a multiple of the patch size {patch} px in [0, tile {axis} {size}), got {step}"
            )
        if image % patch:
            raise ValueError(
                f"image {axis} {image} px is not a multiple of the patch size {patch} px; crop or resize the image"
            )
        if image < size:
            raise ValueError(f"image {axis} {image} px is smaller than the tile {axis} {size} px; use a smaller tile")
        axes.append(AxisTiles.cover(image // patch, size // patch, (size - step) // patch))
    return TileLayout(axes[0], axes[1], tuple(patch_size))
