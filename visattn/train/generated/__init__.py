"""Procedurally generated tasks at high resolution, selectable by ``--dataset`` with no download.

    common.py            split names, per-sample seeds, options shared by every task, the Task record
    cluttered_digits.py  ``cluttered-digits``: find an embedded digit on a canvas strewn with pieces of others
    pathfinder.py        ``pathfinder``: are two markers joined by one dashed curve (Linsley et al. 2018, LRA)
    store.py             drawing a split in several processes, and its checked on-disk cache

The generators use NumPy and Pillow only. Options come from ``dataset_kwargs``
(``--dataset-kwargs level=easy train_size=20000``); the images are drawn at the config's ``img_size``.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image
from torch.utils.data import Dataset

from visattn.train.generated import cluttered_digits, pathfinder
from visattn.train.generated.common import SPLITS, Task, parse_options
from visattn.train.generated.store import load_split

TASKS: dict[str, Task] = {task.name: task for task in (cluttered_digits.TASK, pathfinder.TASK)}


def task_options(name: str, values: Mapping[str, Any], image_hw: tuple[int, int]) -> Any:
    """The options of task ``name`` from ``values``, checked against the image size; ValueError if bad."""
    task = TASKS[name]
    options = parse_options(task, values)
    task.check(options, image_hw)
    return options


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
    """Train, val and test of task ``name``, cached under ``root/generated``; mean and std from train."""
    task = TASKS[name]
    options = task_options(name, values, image_hw)
    splits = {split: GeneratedDataset(load_split(task, options, image_hw, split, root)) for split in SPLITS}
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
