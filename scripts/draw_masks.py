"""Draws, for each attention type, the keys that one query reads, on a grid of patches with the prefix tokens (class,
register, longformer's learned global token) in a row above it: from the naive twins' masks, for a query in the
middle and one near a corner (docs/img/masks/<type>.png). The Attention types page shows them in a table that
scripts/docs_hooks.py generates from PICTURES, each picture captioned with the call that draws it.

    python scripts/draw_masks.py [--out docs/img/masks] [--only TYPE ...]
"""
from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import torch

from visattn.layers.decay import initial_decay_rates
from visattn.ops.axial.naive import axial_masks
from visattn.ops.linformer import area_pooling_projection
from visattn.ops.local.naive import with_prefix_tokens
from visattn.ops.longformer import longformer_mask
from visattn.ops.neighborhood import neighborhood_mask
from visattn.ops.sparse import sparse_mask

GRID = (16, 16)
PREFIX = 2  # a class token and a register token
KERNEL, BLOCK, HALO, DWCONV, LINFORMER_K = 7, 8, 3, 3, 16
TILE = (4, 4)  # the tile-aligned windows' tile for the picture, against the default 8 x 16 (a 16 x 16 grid's 2 tiles)
LONGFORMER_GLOBAL = PREFIX + 1  # the prefix tokens and one learned global token (num_extra_global_tokens=1)
LIGHT = 0.35  # linear attention's weight of every key, beside its locality term


@dataclasses.dataclass(frozen=True)
class Picture:
    """One type's picture: ``keys(query)`` is (prefix + H*W,) float in [0, 1], how much the patch query at
    ``query`` (its row-major index) reads each token, prefix tokens first."""

    keys: Callable[[int], torch.Tensor]
    call: str  # the expression of ``keys``, as the page's caption shows it
    prefix: int = PREFIX
    block: int | None = None  # outline the query's block of this side (sparse, the tile-aligned windows)


def _grid_distance(query: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(H*W,) row and column offsets of every patch from the patch ``query``."""
    rows, cols = torch.meshgrid(torch.arange(GRID[0]), torch.arange(GRID[1]), indexing="ij")
    return (rows - query // GRID[1]).abs().flatten(), (cols - query % GRID[1]).abs().flatten()


def _linear(query: int) -> torch.Tensor:
    drow, dcol = _grid_distance(query)
    patches = torch.where((drow <= DWCONV // 2) & (dcol <= DWCONV // 2), 1.0, LIGHT)
    return torch.cat([torch.full((PREFIX,), LIGHT), patches])


def _linear_decay(query: int) -> torch.Tensor:
    gamma = float(initial_decay_rates(1, True)[0])
    drow, dcol = _grid_distance(query)
    return torch.cat([torch.ones(PREFIX), gamma ** (drow + dcol).float()])


def _linformer(query: int) -> torch.Tensor:
    area = area_pooling_projection(LINFORMER_K, GRID).argmax(0).flatten()  # (H*W,) the pooled area of each patch
    side = int(LINFORMER_K**0.5)
    return torch.cat([torch.ones(PREFIX), torch.where(area % 2 == (area // side) % 2, 1.0, 0.6)])


def _axial(query: int) -> torch.Tensor:
    same_row, same_col = axial_masks(GRID, PREFIX)
    return torch.maximum(0.5 * same_row[PREFIX + query].float(), same_col[PREFIX + query].float())


def _floor(query: int) -> torch.Tensor:
    return torch.zeros(PREFIX + GRID[0] * GRID[1]).index_fill_(0, torch.tensor([PREFIX + query]), 1.0)


PICTURES: dict[str, Picture] = {
    "softmax": Picture(lambda query: torch.ones(PREFIX + GRID[0] * GRID[1]),
                       "no mask: every key, the prefix tokens' included"),
    "linear": Picture(_linear, f"every key at one shade (linear attention has no mask), the {DWCONV}×{DWCONV} "
                      f"neighbourhood of its locality term (`dwconv_kernel={DWCONV}`) darker"),
    "linear-decay": Picture(_linear_decay, f"γ^(|Δrow| + |Δcol|), γ = `initial_decay_rates(1, True)[0]` (the first "
                            "head's rate, `decay=true`), without the locality term; the prefix tokens at weight 1"),
    "neighborhood": Picture(
        lambda query: with_prefix_tokens(neighborhood_mask(GRID, KERNEL), PREFIX)[PREFIX + query].float(),
        f"`with_prefix_tokens(neighborhood_mask({GRID}, {KERNEL}), {PREFIX})`: the window, not the prefix tokens"),
    "sparse": Picture(
        lambda query: with_prefix_tokens(sparse_mask(GRID, BLOCK, HALO), PREFIX)[PREFIX + query].float(),
        f"`with_prefix_tokens(sparse_mask({GRID}, {BLOCK}, {HALO}), {PREFIX})`: dashed, the query's {BLOCK}×{BLOCK} "
        f"block; around it, its halo of {HALO}", block=BLOCK),
    "neighborhood-tile-aligned": Picture(
        lambda query: with_prefix_tokens(neighborhood_mask(GRID, KERNEL, aligned_tile=TILE), PREFIX)[PREFIX + query].float(),
        f"`with_prefix_tokens(neighborhood_mask({GRID}, {KERNEL}, aligned_tile={TILE}), {PREFIX})` (`tile_aligned=true, "
        f"aligned_tile=[{TILE[0]}, {TILE[1]}]`): dashed, the query's tile; its window, 3×3 tiles, holds the {KERNEL}×{KERNEL} "
        "neighbourhood of each query of the tile, shifted inward at the border", block=TILE[0]),
    "sparse-tile-aligned": Picture(
        lambda query: with_prefix_tokens(sparse_mask(GRID, BLOCK, HALO, aligned_tile=TILE), PREFIX)[PREFIX + query].float(),
        f"`with_prefix_tokens(sparse_mask({GRID}, {BLOCK}, {HALO}, aligned_tile={TILE}), {PREFIX})` (`tile_aligned=true, "
        f"aligned_tile=[{TILE[0]}, {TILE[1]}]`): dashed, the query's tile, in place of the {BLOCK}×{BLOCK} block; its halo of "
        f"{HALO} rounded out to one tile, cut at the border", block=TILE[0]),
    "sparse-tile-aligned-halo0": Picture(
        lambda query: with_prefix_tokens(sparse_mask(GRID, BLOCK, 0, aligned_tile=TILE), PREFIX)[PREFIX + query].float(),
        f"`with_prefix_tokens(sparse_mask({GRID}, {BLOCK}, 0, aligned_tile={TILE}), {PREFIX})` (`tile_aligned=true, "
        f"aligned_tile=[{TILE[0]}, {TILE[1]}], halo=0`): "
        "Swin's windows without the shift, each tile alone", block=TILE[0]),
    "longformer": Picture(
        lambda query: longformer_mask(GRID, LONGFORMER_GLOBAL, kernel_size=KERNEL)[LONGFORMER_GLOBAL + query].float(),
        f"`longformer_mask({GRID}, {LONGFORMER_GLOBAL}, kernel_size={KERNEL})`: the class and register tokens and one "
        "learned global token (`num_extra_global_tokens=1`)", prefix=LONGFORMER_GLOBAL),
    "linformer": Picture(_linformer, f"the prefix tokens, and the {LINFORMER_K} areas of "
                         f"`area_pooling_projection({LINFORMER_K}, {GRID})` (shaded in turn) that its {LINFORMER_K} "
                         "keys start from"),
    "axial": Picture(_axial, f"`axial_masks({GRID}, {PREFIX})`: the row (hop 1, lighter), then the column (hop 2)"),
    "floor": Picture(_floor, "itself alone: no mixing"),
}


def caption_table() -> str:
    """The Attention types page's table of pictures, each with the call that draws it."""
    rows = ["| type | the keys of one query | drawn from |", "|---|---|---|"]
    for name, picture in PICTURES.items():
        call = picture.call.replace("|", "\\|")
        rows.append(f"| `{name}` | ![{name}](img/masks/{name}.png) | {call} |")
    return "\n".join(rows) + "\n"


def draw(name: str, path: Path) -> None:
    picture, (H, W) = PICTURES[name], GRID
    queries = [(H // 2, W // 2 - 2), (1, W - 2)]  # one in the middle, one near a corner
    fig, axes = plt.subplots(1, 2, figsize=(4.4, 2.7))
    for ax, (row, col) in zip(axes, queries):
        keys = picture.keys(row * W + col).numpy()
        image = np.full((H + 2, W), np.nan)  # the prefix row, a gap, the grid
        image[0, : picture.prefix], image[2:] = keys[: picture.prefix], keys[picture.prefix:].reshape(H, W)
        cmap = plt.get_cmap("Blues").copy()
        cmap.set_bad("white")
        ax.imshow(np.ma.masked_invalid(image), cmap=cmap, vmin=0, vmax=1)
        for cell in range(picture.prefix):
            ax.add_patch(plt.Rectangle((cell - 0.5, -0.5), 1, 1, fill=False, edgecolor="grey", linewidth=0.8))
        ax.add_patch(plt.Rectangle((-0.5, 1.5), W, H, fill=False, edgecolor="grey", linewidth=0.8))
        if picture.block:
            top, left = row // picture.block * picture.block, col // picture.block * picture.block
            ax.add_patch(plt.Rectangle((left - 0.5, top + 1.5), picture.block, picture.block, fill=False,
                                       edgecolor="black", linewidth=1.2, linestyle="--"))
        ax.add_patch(plt.Rectangle((col - 0.5, row + 1.5), 1, 1, fill=False, edgecolor="red", linewidth=2))
        ax.set_xticks([])
        ax.set_yticks([])
        ax.axis("off")
        ax.set_title(f"query at {(row, col)}", fontsize=8)
    fig.suptitle(f"{name}: prefix tokens above, {H}×{W} patches", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/img/masks"))
    parser.add_argument("--only", nargs="+", choices=list(PICTURES), default=list(PICTURES), metavar="TYPE",
                        help=f"the types to draw (default: all of {', '.join(PICTURES)})")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.only:
        draw(name, args.out / f"{name}.png")
    print(f"{len(args.only)} pictures in {args.out}")


if __name__ == "__main__":
    main()
