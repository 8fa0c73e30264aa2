"""What every dataset of ``--dataset`` is: a :class:`DatasetSpec` (how to read its splits, its default image
size, its official splits, how to fetch it), the :class:`DataSplits` it yields, and the fixed, stratified cut
that makes a validation (or test) split where the dataset has none."""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from sklearn.model_selection import train_test_split
from torch.utils.data import Dataset, Subset

# Seed of the fixed splits and subsets: part of the dataset's definition, not of a run.
SPLIT_SEED = 0
# Share of the training split held out for validation where a dataset has no validation split.
VAL_FRACTION = 0.1
# Where a downloadable dataset lives when no --data-dir is given.
DEFAULT_DATA_DIR = "data"


class DataError(Exception):
    """The dataset asked for is not there or cannot be read; the message says how to get it."""


@dataclass(frozen=True)
class DataSplits:
    """Images of a dataset as (PIL RGB image, class index) pairs, before any transform.

    ``eval`` is the test split train.py evaluates once, at the end, on the weights chosen on ``val``, and
    reports as test accuracy: the official test split where there is one. ``val`` is the validation split
    train.py evaluates every epoch to choose the best weights: the official one or a fixed, stratified cut
    from train (which then no longer holds those images); None only where a dataset has none, and then
    ``eval`` is evaluated every epoch instead. ``classes`` names the class indices.
    """

    train: Dataset
    eval: Dataset
    num_classes: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    val: Dataset | None = None
    classes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.classes and len(self.classes) != self.num_classes:
            raise ValueError(f"{len(self.classes)} class names for {self.num_classes} classes")

    def named_classes(self) -> tuple[str, ...]:
        """``classes``, or the class indices as text where the dataset names none."""
        return self.classes or tuple(str(index) for index in range(self.num_classes))


@dataclass(frozen=True)
class DataSource:
    """Where and how a dataset is read: its root folder, whether it may be downloaded, the held-out share
    of datasets that have no test split, what a generated dataset is drawn with (its options,
    ``dataset_kwargs``, and the image size (H, W)), and whether preparing it shows a progress bar (a run's
    main process)."""

    data_dir: str | None
    download: bool
    eval_fraction: float
    options: Mapping[str, Any] = field(default_factory=dict)
    image_hw: tuple[int, int] | None = None
    progress: bool = False

    @property
    def root(self) -> Path:
        return Path(self.data_dir or DEFAULT_DATA_DIR)


@dataclass(frozen=True)
class DatasetSpec:
    """One ``--dataset`` name.

    Attributes:
        name: the ``--dataset`` value.
        title: the dataset's own name, for messages.
        reader: what reads it (a torchvision class, scikit-learn, ...), for documentation.
        default_img_size: the image side when the config leaves ``img_size`` unset.
        official_splits: the splits the dataset is published with, e.g. ``"train 1,020 / val 1,020 / test 6,149"``.
        load: (source) -> DataSplits; DataError when the data is missing or unreadable.
        download_size: approximate size of what ``--download`` fetches; None when there is nothing to fetch.
        recipe: the file name (without .yaml) of its recipe under configs/, where it is not ``name``: a name
            that says what the recipe is (``cifar10-pixels-1024tok``).
    """

    name: str
    title: str
    reader: str
    default_img_size: int
    official_splits: str
    load: Callable[[DataSource], DataSplits]
    download_size: str | None = None
    recipe: str | None = None

    @property
    def recipe_file(self) -> str:
        """Its recipe, relative to the repository: ``configs/NAME.yaml``."""
        return f"configs/{self.recipe or self.name}.yaml"

    def fetch_command(self, root: Path | str) -> str:
        """The command that downloads this dataset into ``root`` (and trains its recipe)."""
        return f"python train.py --config {self.recipe_file} --data-dir {root} --download"


def cut_stratified(labels: Sequence[int], fraction: float) -> tuple[list[int], list[int]]:
    """(kept, held-out) indices: ``ceil(fraction * N)`` images held out, at least one per class, in the
    class proportions, the same on every call and every process (fixed seed). Unstratified only where a
    class has a single image."""
    labels = np.asarray(labels)
    present, counts = np.unique(labels, return_counts=True)
    held = max(math.ceil(fraction * len(labels)), len(present))
    if held >= len(labels):
        raise DataError(f"{len(labels)} images are too few to hold out {held} for a split of their own")
    stratify = labels if counts.min() >= 2 and len(labels) - held >= len(present) else None
    kept, held_out = train_test_split(
        np.arange(len(labels)), test_size=held, stratify=stratify, random_state=SPLIT_SEED
    )
    return sorted(kept.tolist()), sorted(held_out.tolist())


def split_off(dataset: Dataset, labels: Sequence[int], fraction: float) -> tuple[Subset, Subset]:
    """``dataset`` as (kept, held-out) subsets by :func:`cut_stratified`."""
    kept, held_out = cut_stratified(labels, fraction)
    return Subset(dataset, kept), Subset(dataset, held_out)
