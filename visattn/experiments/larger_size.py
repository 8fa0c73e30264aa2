"""A model trained at one image size tested at a larger one, one column each: its own test images
upsampled, the test split drawn at the larger size (whole), tiled at each overlap, and the most confident
tile."""
from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
import torch.nn as nn
from timm.data import create_transform
from torch.utils.data import DataLoader, TensorDataset

from visattn.experiments.summarize import FinishedRun
from visattn.predict import load_trained_model
from visattn.tiled import TiledViT, cut_tiles, model_tile, tile_layout
from visattn.train import DataError, eval_data_config, load_splits, without_images

TRAINED = "trained size"
UPSAMPLED = "upsampled"
WHOLE = "whole"
MOST_CONFIDENT = "most confident tile"
SECOND_STAGE = "second stage"


def tiled_column(overlap: int) -> str:
    return f"tiled, overlap {overlap} px"


def columns(overlaps: list[int]) -> list[str]:
    return [TRAINED, UPSAMPLED, WHOLE, *(tiled_column(overlap) for overlap in overlaps), MOST_CONFIDENT, SECOND_STAGE]


@dataclass
class Evaluation:
    """One first stage tested at the larger size."""

    row: str
    seed: int
    run_dir: str
    trained_hw: tuple[int, int]
    accuracy: dict[str, float | None] = field(default_factory=dict)  # a column -> test accuracy (None: no such run)
    seconds: dict[str, float] = field(default_factory=dict)  # a column tested here -> seconds of its forward passes
    errors: dict[str, str] = field(default_factory=dict)  # a column that could not be tested -> why


def check_sizes(stage: FinishedRun, img_size: int, overlaps: list[int]) -> None:
    """ValueError, naming the flag, for a size or an overlap the tiles of ``stage``'s model cannot take, or for a
    run whose images were drawn at a ``canvas_size`` of their own (the columns draw at each size)."""
    trained, patch = stage.config.image_hw, stage.config.patch_size
    canvas = stage.config.dataset_kwargs.get("canvas_size", 0)
    if canvas:
        raise ValueError(f"--run-root: {stage.run_dir} drew its images at canvas_size {canvas} px whatever its "
                         f"img_size; the columns compare the sizes a generator draws at: use runs with canvas_size 0")
    if img_size < max(trained) or img_size % patch:
        raise ValueError(f"--img-size: must be a multiple of the patch size ({patch} px) and at least the size "
                         f"{stage.run_dir} was trained at ({trained[0]}x{trained[1]} px), got {img_size}")
    for overlap in overlaps:
        try:
            tile_layout((img_size, img_size), trained, overlap, (patch, patch))
        except ValueError as error:
            raise ValueError(f"--overlap: {error} (tiles of {stage.run_dir}'s {trained[0]}x{trained[1]} px)") from None


def split_images(stage: FinishedRun, drawn_hw: tuple[int, int], img_size: int, cache: dict[str, TensorDataset]) -> TensorDataset:
    """The test split of ``stage``'s dataset (a generated one drawn at ``drawn_hw``) as train.py's evaluation
    transforms it to ``img_size`` pixels, normalized with ``stage``'s own mean and std, without the files
    its run left out; transformed once and kept in ``cache`` for every run of the same data."""
    drawn = replace(stage.config, img_size=list(drawn_hw))
    skipped = stage.summary.get("skipped_image_files") or []
    key = json.dumps([drawn.dataset, drawn.dataset_kwargs, drawn.data_dir, drawn.eval_fraction, drawn.max_eval_samples,
                      drawn_hw, img_size, stage.mean, stage.std, sorted(skipped)], default=str)
    if key not in cache:
        splits = load_splits(drawn)
        if skipped:
            splits = without_images(splits, set(skipped))
        data_config = {**eval_data_config(replace(drawn, img_size=img_size), splits), "mean": stage.mean, "std": stage.std}
        transform = create_transform(is_training=False, **data_config)
        images, labels = zip(*((transform(image), label) for image, label in splits.eval))
        cache[key] = TensorDataset(torch.stack(images), torch.tensor(labels))
    return cache[key]


class MostConfidentTile(nn.Module):
    """Classifies every tile of the size ``model`` was built at alone; an image takes the class of the tile
    whose top probability is the highest. (B, C, H, W) -> (B, num_classes): that tile's logits."""

    def __init__(self, model: nn.Module, overlap: int) -> None:
        super().__init__()
        self.model, self.overlap = model, overlap

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        layout = tile_layout(tuple(images.shape[-2:]), model_tile(self.model), self.overlap,
                             tuple(self.model.patch_embed.patch_size))
        logits = self.model(cut_tiles(images, layout)).unflatten(0, (len(images), layout.num_tiles))  # (B, tiles, classes)
        best = logits.softmax(dim=-1).amax(dim=-1).argmax(dim=1)  # (B,): the tile with the top probability
        return logits[torch.arange(len(images), device=logits.device), best]


@torch.no_grad()
def accuracy(model: nn.Module, dataset: TensorDataset, batch_size: int) -> float:
    """Top-1 accuracy of ``model`` over the whole of ``dataset``."""
    model.eval()
    correct = 0
    for images, targets in DataLoader(dataset, batch_size=batch_size):
        correct += (model(images).argmax(dim=-1) == targets).sum().item()
    return correct / len(dataset)


def evaluate(stage: FinishedRun, img_size: int, overlaps: list[int], merge: str, batch_size: int,
             cache: dict[str, TensorDataset]) -> Evaluation:
    """Every column of ``stage`` at ``img_size``; a column whose model cannot be built or run is recorded in
    ``errors`` and the others are tested all the same."""
    evaluation = Evaluation(stage.row, stage.seed, str(stage.run_dir), stage.config.image_hw)
    evaluation.accuracy[TRAINED] = stage.summary["test_acc"]

    def attempt(column: str, build: Callable[[], nn.Module], dataset: Callable[[], TensorDataset]) -> None:
        try:
            model, images = build(), dataset()
            start = time.perf_counter()
            evaluation.accuracy[column] = accuracy(model, images, batch_size)
            evaluation.seconds[column] = time.perf_counter() - start
        except (ValueError, RuntimeError, OSError, DataError) as error:
            evaluation.accuracy[column] = None
            evaluation.errors[column] = (str(error).splitlines() or [type(error).__name__])[0]

    # Each model is read once for the columns that share it; one that fails is tried again by each, which
    # then records the error.
    @functools.cache
    def whole() -> nn.Module:
        return load_trained_model(stage.run_dir, stage.weights, img_size=img_size)

    @functools.cache
    def small() -> nn.Module:
        return load_trained_model(stage.run_dir, stage.weights)

    def upsampled() -> TensorDataset:
        return split_images(stage, stage.config.image_hw, img_size, cache)

    def larger() -> TensorDataset:
        return split_images(stage, (img_size, img_size), img_size, cache)

    attempt(UPSAMPLED, whole, upsampled)
    attempt(WHOLE, whole, larger)
    for overlap in overlaps:
        attempt(tiled_column(overlap), lambda: TiledViT(small(), overlap=overlap, merge=merge), larger)
    attempt(MOST_CONFIDENT, lambda: MostConfidentTile(small(), max(overlaps)), larger)
    return evaluation
