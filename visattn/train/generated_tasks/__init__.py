"""Procedurally generated tasks at high resolution, selectable by ``--dataset`` with no download.

    common.py            split names, per-sample seeds, options shared by every task, the Task record
    cluttered_digits.py  ``cluttered-digits``: find an embedded digit on a canvas strewn with pieces of others
    pathfinder.py        ``pathfinder``: are two markers joined by one dashed curve (Linsley et al. 2018, LRA)
    statistics.py        a split's mean and std from its first images, drawn in several processes, remembered

The generators use NumPy and Pillow only. Options come from ``dataset_kwargs``
(``--dataset-kwargs level=easy train_size=20000``); the images are drawn at the config's ``img_size``, or with
``canvas_size`` at that side and resized to ``img_size`` by the transforms. A split is never drawn or held
whole: :class:`GeneratedDataset` draws sample ``i`` when it is asked for (in a DataLoader worker), from the
sample's own seeded generator, so memory follows the batch and the workers, not the split, and the images are
the same bytes whichever process draws them, in whatever order.
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
from visattn.train.generated_tasks.statistics import split_statistics

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
    """One split of a generated task as (PIL RGB image, class index) pairs, sample ``index`` drawn each time it is
    asked for, at ``image_hw``, from its own generator (seed, split, index): nothing of the split is held."""

    def __init__(self, task: Task, options: Any, image_hw: tuple[int, int], split: str) -> None:
        self.task, self.options, self.image_hw, self.split = task, options, image_hw, split

    def __len__(self) -> int:
        return self.options.size(self.split)

    def sample(self, index: int) -> dict[str, np.ndarray]:
        """Sample ``index`` as the generator draws it: image (H, W) uint8, label () int64, and its per-sample
        records (marker centres, digit placement); IndexError outside the split."""
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} of a {self.split} split of {len(self)}")
        arrays = self.task.generate(self.options, self.image_hw, self.split, np.array([index]))
        return {name: array[0] for name, array in arrays.items()}

    def __getitem__(self, index: int) -> tuple[Image.Image, int]:
        drawn = self.sample(index)
        return Image.fromarray(drawn["images"]).convert("RGB"), int(drawn["labels"])


@dataclass(frozen=True)
class GeneratedSplits:
    train: GeneratedDataset
    val: GeneratedDataset
    test: GeneratedDataset
    num_classes: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]


def load_generated(name: str, values: Mapping[str, Any], image_hw: tuple[int, int], root: str | Path,
                   progress: bool = False) -> GeneratedSplits:
    """Train, val and test of task ``name``, drawn on demand; mean and std from the first training images (at the
    canvas's size; :mod:`~visattn.train.generated_tasks.statistics`), remembered under ``root/generated``, with a
    progress bar while they are computed if ``progress``."""
    task = TASKS[name]
    options = task_options(name, values, image_hw)
    drawn, drawn_hw = drawn_as(options, image_hw)
    splits = {split: GeneratedDataset(task, drawn, drawn_hw, split) for split in SPLITS}
    mean, std = split_statistics(task, drawn, drawn_hw, "train", root, progress)
    return GeneratedSplits(**splits, num_classes=task.num_classes, mean=(mean,) * 3, std=(std,) * 3)
