"""What every generated task shares: split names, per-sample seeds, options and the task description.

A task draws sample ``index`` of ``split`` from its own generator,
``np.random.default_rng([seed, SPLITS.index(split), index])``, so a sample does not depend on which
process made it, in what order, or how many samples were made before it. A choice made once for a whole
split draws from :func:`split_rng`, a generator independent of every sample's.
"""
from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from visattn.train.fieldtypes import matches, type_name

SPLITS = ("train", "val", "test")


def sample_rng(seed: int, split: str, index: int) -> np.random.Generator:
    """The generator of sample ``index`` of ``split``: fixed by the three numbers alone."""
    return np.random.default_rng([seed, SPLITS.index(split), index])


def split_rng(seed: int, split: str) -> np.random.Generator:
    """The generator of choices made once for a whole split: fixed by ``seed`` and ``split``, and (a spawn key
    of its own) independent of every sample's generator."""
    return np.random.default_rng(np.random.SeedSequence([seed, SPLITS.index(split)], spawn_key=(0,)))


@dataclass(frozen=True)
class SplitSizes:
    """Options every task has: the dataset seed, the number of images per split, and the canvas.

    canvas_size: the side in px the images are drawn at; 0, the config's ``img_size``. Another side draws the
        same images as an ``img_size`` of that side would, and the transforms resize them to ``img_size`` as
        they do any dataset's images: a curriculum's first stage sees its last stage's images at a lower
        resolution. It needs a square ``img_size``.
    """

    seed: int = 0
    train_size: int = 10_000
    val_size: int = 2_000
    test_size: int = 2_000
    canvas_size: int = 0

    def size(self, split: str) -> int:
        return getattr(self, f"{split}_size")


# generate(options, (H, W), split, indices) -> {"images": (n, H, W) uint8, "labels": (n,) int64, metadata...}
Generate = Callable[[Any, tuple[int, int], str, np.ndarray], dict[str, np.ndarray]]


@dataclass(frozen=True)
class Task:
    """A generated dataset: its options (a frozen dataclass whose defaults are the recipe's), the
    version of its images (part of the cache key: raise it whenever the same options draw other
    images), the number of classes, and the function that draws samples."""

    name: str
    options: type
    version: int
    num_classes: int
    generate: Generate
    check: Callable[[Any, tuple[int, int]], None]


def canvas_hw(options: SplitSizes, image_hw: tuple[int, int]) -> tuple[int, int]:
    """The (H, W) the images of ``options`` are drawn at for a config of ``image_hw``."""
    return (options.canvas_size, options.canvas_size) if options.canvas_size else image_hw


def parse_options(task: Task, values: Mapping[str, Any]) -> Any:
    """``values`` as ``task``'s options; ValueError naming a key it does not take or a value of the wrong type.

    The messages start with the config key at fault (``dataset_kwargs``), as the task's ``check`` ones do
    (``dataset_kwargs`` or ``img_size``)."""
    fields = [f.name for f in dataclasses.fields(task.options)]
    hints = typing.get_type_hints(task.options)
    converted = {}
    for key, value in values.items():
        if key not in fields:
            raise ValueError(f"dataset_kwargs: dataset {task.name!r} has no option {key!r}; its options: {', '.join(fields)}")
        ok, converted[key] = matches(value, hints[key])
        if not ok:
            raise ValueError(f"dataset_kwargs: {task.name} option {key!r}: expected {type_name(hints[key])}, got {value!r}")
    options = task.options(**converted)
    for split in SPLITS:
        if options.size(split) < 1:
            raise ValueError(f"dataset_kwargs: {task.name} option {split}_size: must be >= 1, got {options.size(split)}")
    if options.canvas_size < 0:
        raise ValueError(f"dataset_kwargs: {task.name} option canvas_size: must be >= 0 (0: the img_size), "
                         f"got {options.canvas_size}")
    return options
