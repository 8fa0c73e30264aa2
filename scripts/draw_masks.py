"""Draws, for each attention type, which keys one query sees on a grid of patches, from the naive twins' masks
(docs/img/masks/<type>.png, shown on the site's Attention types page).

    python scripts/draw_masks.py [--out docs/img/masks] [--grid 16]
"""
from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib.pyplot as plt
import torch

from visattn.layers.decay import initial_decay_rates
from visattn.ops.axial.naive import axial_masks
from visattn.ops.linformer import area_pooling_projection
from visattn.ops.longformer import longformer_mask
from visattn.ops.neighborhood import neighborhood_mask
from visattn.ops.sparse import sparse_mask


def keys_seen(attn: str, grid: tuple[int, int], query: tuple[int, int]) -> torch.Tensor:
    """(H, W) float in [0, 1]: how much the query at grid position ``query`` reads each patch key."""
    H, W = grid
    index = query[0] * W + query[1]
    if attn in ("softmax", "linear"):
        return torch.ones(H, W)
    if attn == "floor":
        return torch.zeros(H * W).index_fill_(0, torch.tensor([index]), 1.0).view(H, W)
    if attn == "linear-decay":  # one head's weights gamma^(Manhattan distance), the first head's initial rate
        gamma = float(initial_decay_rates(1, True)[0])
        rows, cols = torch.meshgrid(torch.arange(H), torch.arange(W), indexing="ij")
        return gamma ** ((rows - query[0]).abs() + (cols - query[1]).abs()).float()
    if attn == "neighborhood":
        return neighborhood_mask(grid, 7)[index].float().view(H, W)
    if attn == "sparse":
        return sparse_mask(grid, 8, 3)[index].float().view(H, W)
    if attn == "longformer":  # one global token (the class token) in front of the patches
        return longformer_mask(grid, 1)[1 + index, 1:].float().view(H, W)
    if attn == "axial":  # row hop, then column hop: the two masks' union is what one layer reaches directly
        same_row, same_col = axial_masks(grid, 0)
        return (0.5 * same_row[index].float() + same_col[index].float()).clamp(max=1.0).view(H, W)
    if attn == "linformer":  # the k = 16 pooled areas, each one projected key, shaded by area
        proj = area_pooling_projection(16, grid)  # (k, H, W)
        return (proj.argmax(0) % 2 == (proj.argmax(0) // 4) % 2).float() * 0.5 + 0.5
    raise ValueError(f"attn must be one of {', '.join(TYPES)}, got {attn!r}")


TYPES = ("softmax", "linear", "linear-decay", "neighborhood", "sparse", "longformer", "linformer", "axial", "floor")


def draw(attn: str, grid: tuple[int, int], path: Path) -> None:
    H, W = grid
    queries = [(H // 2, W // 2 - 2), (1, W - 2)]  # one in the middle, one near a corner
    fig, axes = plt.subplots(1, 2, figsize=(4.4, 2.3))
    for ax, query in zip(axes, queries):
        ax.imshow(keys_seen(attn, grid, query).numpy(), cmap="Blues", vmin=0, vmax=1)
        ax.add_patch(plt.Rectangle((query[1] - 0.5, query[0] - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=2))
        ax.set_xticks([])
        ax.set_yticks([])
        ax.set_title(f"query at {query}", fontsize=8)
    fig.suptitle(attn, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/img/masks"))
    parser.add_argument("--grid", type=int, default=16, help="grid side in patches")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for attn in TYPES:
        draw(attn, (args.grid, args.grid), args.out / f"{attn}.png")
    print(f"{len(TYPES)} pictures in {args.out}")


if __name__ == "__main__":
    main()
