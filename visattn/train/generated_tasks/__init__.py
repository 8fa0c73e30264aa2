"""Procedurally generated tasks at high resolution, selectable by ``--dataset`` with no download.

    common.py            split names, per-sample seeds, options shared by every task, the Task record
    cluttered_digits.py  ``cluttered-digits``: find an embedded digit on a canvas strewn with pieces of others
    pathfinder.py        ``pathfinder``: are two markers joined by one dashed curve (Linsley et al. 2018, LRA)
    store.py             drawing a split in several processes, and its checked on-disk cache

The generators use NumPy and Pillow only. Options come from ``dataset_kwargs``
(``--dataset-kwargs level=easy train_size=20000``); the images are drawn at the config's ``img_size``, or with
``canvas_size`` at that side and resized to ``img_size`` by the transforms.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image
from torch.utils.data import Dataset

from visattn.train.generated_tasks import cluttered_digits, pathfinder
from visattn.train.generated_tasks.common import SPLITS, Task, canvas_hw, parse_options
from visattn.train.generated_tasks.store import load_split

TASKS: dict[str, Task] = {task.name: task for task in (cluttered_digits.TASK, pathfinder.TASK)}


def task_options(name: str, values: Mapping[str, Any], image_hw: tuple[int, int]) -> Any:
    """The options of task ``name`` from ``values``, checked against the canvas they draw at for a config of
    ``image_hw``; ValueError if bad."""
    task = TASKS[name]
    options = parse_options(task, values)
    if options.canvas_size and image_hw[0] != image_hw[1]:
        raise ValueError(f"img_size: dataset_kwargs canvas_size draws square images, which a "
                         f"{image_hw[0]}x{image_hw[1]} img_size would crop; use a square img_size or canvas_size 0")
    try:
        task.check(options, canvas_hw(options, image_hw))
    except ValueError as error:  # the canvas, not img_size, is what is too small
        if options.canvas_size and str(error).startswith("img_size: "):
            reason = str(error).removeprefix("img_size: ")
            raise ValueError(f"dataset_kwargs: canvas_size {options.canvas_size}: {reason}") from None
        raise
    return options


def drawn_as(options: Any, image_hw: tuple[int, int]) -> tuple[Any, tuple[int, int]]:
    """The options and (H, W) the images of ``options`` are drawn with for a config of ``image_hw``: as at an
    ``img_size`` of the canvas's side, so that both share one cache."""
    return replace(options, canvas_size=0), canvas_hw(options, image_hw)


class GeneratedDataset(Dataset):
    """One split of a generated task as (PIL RGB image, class index) pairs; ``metadata`` holds the
    generator's per-sample records (marker centres, digit placement), row for row."""

    def __init__(self, arrays: dict[str, np.ndarray]) -> None:
        self.images = arrays["images"]
        self.labels = arrays["labels"]
        self.metadata = {name: array for name, array in arrays.items() if name not in ("images", "labels")}

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[Image.Image, int]:
        return Image.fromarray(self.images[index]).convert("RGB"), int(self.labels[index])


@dataclass(frozen=True)
class GeneratedSplits:
    train: GeneratedDataset
    val: GeneratedDataset
    test: GeneratedDataset
    num_classes: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]


def load_generated(name: str, values: Mapping[str, Any], image_hw: tuple[int, int], root: str | Path) -> GeneratedSplits:
    """Train, val and test of task ``name``, cached under ``root/generated``; mean and std from train (at the
    canvas's size)."""
    task = TASKS[name]
    options = task_options(name, values, image_hw)
    drawn, drawn_hw = drawn_as(options, image_hw)
    splits = {split: GeneratedDataset(load_split(task, drawn, drawn_hw, split, root)) for split in SPLITS}
    mean, std = _grey_mean_std(splits["train"].images)
    return GeneratedSplits(**splits, num_classes=task.num_classes, mean=(mean,) * 3, std=(std,) * 3)


def _grey_mean_std(images: np.ndarray) -> tuple[float, float]:
    """Mean and standard deviation of uint8 ``images`` in [0, 1], from a histogram (no float copy)."""
    counts = np.zeros(256, dtype=np.int64)
    for start in range(0, len(images), 512):
        counts += np.bincount(images[start:start + 512].ravel(), minlength=256)
    levels = np.arange(256) / 255.0
    mean = float(counts @ levels / counts.sum())
    variance = float(counts @ (levels - mean) ** 2 / counts.sum())
    return mean, max(variance, 1e-12) ** 0.5
