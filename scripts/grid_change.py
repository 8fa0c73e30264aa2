"""What a change of grid costs a trained model before any training at the new size: the validation
accuracy of a run's weights at its own image size and at another, with the learned position embedding
either resampled to the new grid (timm's bicubic resampling, what a next stage of a curriculum starts
from) or replaced by its mean over the grid (no absolute position left). The gap between the two columns
at the new size is what the resampled positions cost; the gap that remains with the mean, what the
larger canvas costs otherwise (more tokens pooled, more background).

    python scripts/grid_change.py runs/table-conv-stem/tune-base/linear/seed0-stage1 --img-size 128

Reads the run's ``config.yaml`` for the data (the same dataset options at the new size, normalized as the
weights were trained, as a next stage starting from them does) and its best weights.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from visattn.predict import load_trained_model
from visattn.train.config import make_config, read_yaml
from visattn.train.data import TransformedDataset, build_transform, load_splits


def mean_position_embedding_(model: torch.nn.Module) -> None:
    """Replace the patch part of ``model.pos_embed`` (1, P + H W, C) by its mean over the grid, in place;
    ValueError for a model without a learned position embedding."""
    if getattr(model, "pos_embed", None) is None:
        raise ValueError(f"{type(model).__name__} has no learned position embedding (pos_embed) to average")
    prefix = 0 if getattr(model, "no_embed_class", False) else model.num_prefix_tokens
    with torch.no_grad():
        patches = model.pos_embed[:, prefix:]
        patches.copy_(patches.mean(dim=1, keepdim=True).expand_as(patches))


def accuracy(model: torch.nn.Module, loader: DataLoader) -> float:
    correct = total = 0
    with torch.inference_mode():
        for images, labels in loader:
            correct += (model(images).argmax(-1) == labels).sum().item()
            total += labels.numel()
    return correct / total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="a finished run of train.py")
    parser.add_argument("--img-size", type=int, required=True, help="the new square image size, px")
    parser.add_argument("--batch-size", type=int, default=100)
    args = parser.parse_args(argv)
    recorded = read_yaml(args.run_dir / "config.yaml")
    rows = []
    for size in dict.fromkeys((recorded["img_size"], args.img_size)):
        # as a next stage from these weights: their image normalization, not the new size's own statistics
        config = make_config(recorded, {"img_size": size, "initial_checkpoint": str(args.run_dir), "pretrained": False})
        splits = load_splits(config)
        split_name, split = ("validation", splits.val) if splits.val is not None else ("test", splits.eval)  # train.py's choice
        loader = DataLoader(
            TransformedDataset(split, build_transform(config, splits, training=False), seed=None),
            batch_size=args.batch_size,
        )
        cells = []
        for flatten in (False, True):
            model = load_trained_model(args.run_dir, img_size=size)
            if flatten:
                mean_position_embedding_(model)
            cells.append(f"{100 * accuracy(model, loader):.1f}%")
        grid = model.patch_embed.grid_size
        rows.append(f"| {size} px | {grid[0]}×{grid[1]} | {cells[0]} | {cells[1]} |")
    print(f"{args.run_dir}: {split_name} accuracy of its best weights, before any training at the new size")
    print("| image | grid | position embedding resampled | its mean over the grid |\n|---|---|---:|---:|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
