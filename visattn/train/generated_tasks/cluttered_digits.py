"""Cluttered digits (after the cluttered MNIST of Jaderberg et al. 2015, "Spatial Transformer Networks"):
find the digit on a large canvas strewn with pieces of other digits.

The digits are scikit-learn's embedded 8x8 scans (``load_digits``, no download), upscaled to
``digit_size`` px with bilinear interpolation. They are first split once, stratified, 60/20/20 into
train/val/test pools, so a test canvas never shows a digit (as target or as clutter) that a training
canvas shows. A canvas holds one target digit at a uniformly random position, its class the label,
and ``clutter_count`` square pieces of side ``clutter_size`` cut from other digits of the same pool
(the first of four random crops with some ink), at random positions. Pieces and digit are laid on black by
a pixel-wise maximum, and no piece comes closer to the digit's centre than half a piece outside its
box: the digit's core, its box shrunk by ``clutter_size // 2`` on each side, is the digit alone.

Two options make variants of the task for judging a recipe on data it was not tuned on. With
``digit_size_max`` each canvas draws its digit's side from [``digit_size``, ``digit_size_max``] and cuts its
clutter from digits of that same side, so that stroke width never tells the target from the clutter. With
``placements`` k the training split shows few distinct target digits, each on k canvases; validation and
test are drawn as without it, so they measure the same thing for every k. Left at 0, both draw nothing
from a canvas's generator: the canvases are those drawn before the options existed.

Classes are balanced: sample ``index`` shows digit ``index % 10``. Pure NumPy and Pillow, no torch;
sample ``index`` of ``split`` is fixed by ``(seed, split, index)`` alone (and, with ``placements``, by the
training digits chosen once per dataset seed).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
from PIL import Image
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from visattn.train.generated_tasks.common import SPLITS, SplitSizes, Task, sample_rng, split_rng

REFERENCE_AREA = 128 * 128  # clutter_count defaults to CLUTTER_PER_REFERENCE_AREA pieces per this many pixels
CLUTTER_PER_REFERENCE_AREA = 16
_POOL_SEED = 0  # the split of the source digits is part of the dataset's definition
_CROP_TRIES = 4
_MIN_INK = 0.2  # a piece is the first of _CROP_TRIES random crops at least this inked on average (else the inkiest)


@dataclass(frozen=True)
class ClutteredDigitsOptions(SplitSizes):
    """``--dataset cluttered-digits`` options (``--dataset-kwargs digit_size=28 clutter_count=16``).

    digit_size: the target digit's side in px (the 8x8 scans upscaled), at least 8.
    digit_size_max: 0, every digit is ``digit_size`` px; else each canvas draws its digit's side uniformly
        from [digit_size, digit_size_max], and its clutter pieces are cut from digits of that side too. The
        canvas must hold a ``digit_size_max`` digit with ``clutter_size`` px around it.
    clutter_size: the side of each square clutter piece in px, 1 to ``digit_size`` (a piece is cut from a
        digit, the smallest one included).
    clutter_count: pieces per canvas; 0, the default density: 16 pieces per 128x128 px of canvas.
    placements: 0, each canvas draws its target digit at random from its split's pool; k > 0, the training
        split shows only ceil(n_c / k) digits of each class c (n_c: its canvases of that class; ceil(train_size
        / k) in all when train_size is a multiple of 10k), chosen from the training pool by ``seed``, each on
        k canvases at positions of their own: the smaller the training set's variety, the larger k. Clutter
        is still cut from the whole pool, and validation and test are drawn as with 0.
    """

    digit_size: int = 32
    digit_size_max: int = 0
    clutter_size: int = 14
    clutter_count: int = 0
    placements: int = 0


@dataclass(frozen=True)
class Placement:
    """Where the target digit went: its box's top-left corner, its side, and its source digit."""

    top: int
    left: int
    size: int
    source: int


@functools.lru_cache(maxsize=64)  # a split with digit_size_max draws at every side in its range
def source_digits(digit_size: int) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """(1797, S, S) uint8 upscaled digits, (1797,) labels, and the indices of each split's pool."""
    digits = load_digits()
    grey = np.rint(digits.images * (255.0 / 16.0)).astype(np.uint8)
    images = np.stack([
        np.asarray(Image.fromarray(image).resize((digit_size, digit_size), Image.Resampling.BILINEAR))
        for image in grey
    ])
    indices = np.arange(len(grey))
    train, rest = train_test_split(indices, test_size=0.4, stratify=digits.target, random_state=_POOL_SEED)
    val, test = train_test_split(rest, test_size=0.5, stratify=digits.target[rest], random_state=_POOL_SEED)
    pools = {"train": np.sort(train), "val": np.sort(val), "test": np.sort(test)}
    return images, digits.target.astype(np.int64), pools


def canvases_of_class(split_size: int, label: int) -> int:
    """How many of a split's canvases show ``label``: sample ``index`` shows ``index % 10``."""
    return len(range(label, split_size, 10))


def training_digits_needed(options: ClutteredDigitsOptions, label: int) -> int:
    """With ``placements`` k: how many distinct training digits of ``label`` its k-canvas runs take."""
    return math.ceil(canvases_of_class(options.train_size, label) / options.placements)


@functools.lru_cache(maxsize=4)
def training_sources(options: ClutteredDigitsOptions) -> tuple[np.ndarray, ...]:
    """With ``placements`` k: per class, the training digits the training split shows, in the order its
    canvases of that class take them (each k canvases in a row), drawn once from the dataset seed."""
    _, labels, pools = source_digits(options.digit_size)
    pool = pools["train"]
    rng = split_rng(options.seed, "train")
    return tuple(
        rng.choice(pool[labels[pool] == label], replace=False, size=training_digits_needed(options, label))
        for label in range(10)
    )


def clutter_count(options: ClutteredDigitsOptions, image_hw: tuple[int, int]) -> int:
    if options.clutter_count:
        return options.clutter_count
    return round(CLUTTER_PER_REFERENCE_AREA * image_hw[0] * image_hw[1] / REFERENCE_AREA)


def check_options(options: ClutteredDigitsOptions, image_hw: tuple[int, int]) -> None:
    if not 8 <= options.digit_size:
        raise ValueError(f"dataset_kwargs: cluttered-digits option digit_size: must be >= 8, got {options.digit_size}")
    if not 1 <= options.clutter_size <= options.digit_size:
        raise ValueError(
            f"dataset_kwargs: cluttered-digits option clutter_size: must be in [1, digit_size {options.digit_size}], "
            f"got {options.clutter_size}"
        )
    if options.digit_size_max != 0 and options.digit_size_max < options.digit_size:
        raise ValueError(
            f"dataset_kwargs: cluttered-digits option digit_size_max: must be 0 (every digit digit_size px) or "
            f">= digit_size {options.digit_size}, got {options.digit_size_max}"
        )
    if options.clutter_count < 0:
        raise ValueError(
            f"dataset_kwargs: cluttered-digits option clutter_count: must be >= 0 (0: the default density), "
            f"got {options.clutter_count}"
        )
    if options.placements < 0:
        raise ValueError(
            f"dataset_kwargs: cluttered-digits option placements: must be >= 0 (0: a digit drawn for each canvas), "
            f"got {options.placements}"
        )
    if options.placements:
        _, labels, pools = source_digits(options.digit_size)
        held = np.bincount(labels[pools["train"]], minlength=10)
        for label in range(10):
            needed = training_digits_needed(options, label)
            if needed > held[label]:
                raise ValueError(
                    f"dataset_kwargs: cluttered-digits option placements: {options.placements} canvases per digit "
                    f"over train_size {options.train_size} need {needed} training digits of class {label}, the "
                    f"training pool holds {held[label]}; raise placements or lower train_size"
                )
    largest = options.digit_size_max or options.digit_size
    if min(image_hw) < largest + options.clutter_size:
        raise ValueError(
            f"img_size: a {image_hw[0]}x{image_hw[1]} canvas leaves no room for {options.clutter_size} px clutter "
            f"around a {largest} px digit (the recipe, configs/cluttered-digits.yaml, draws 128 px canvases)"
        )


def _clutter_positions(rng: np.random.Generator, count: int, image_hw: tuple[int, int], piece: int,
                       digit_top: int, digit_left: int, digit_size: int) -> np.ndarray:
    """(count, 2) top-left corners of pieces that stay at least half a piece outside the digit's core."""
    margin = piece // 2
    core_low = np.array([digit_top + margin, digit_left + margin])
    core_high = np.array([digit_top + digit_size - margin, digit_left + digit_size - margin])
    chosen: list[np.ndarray] = []
    found = 0
    while found < count:
        corners = rng.integers(0, np.array(image_hw) - piece + 1, size=(2 * count, 2))
        overlaps = ((corners < core_high) & (corners + piece > core_low)).all(axis=1)
        keep = corners[~overlaps][: count - found]
        chosen.append(keep)
        found += len(keep)
    return np.concatenate(chosen)


def draw(options: ClutteredDigitsOptions, image_hw: tuple[int, int], split: str, index: int) -> tuple[np.ndarray, int, Placement]:
    """Sample ``index`` of ``split``: (H, W) uint8 canvas, its label, and where the digit went."""
    _, labels, pools = source_digits(options.digit_size)
    pool = pools[split]
    rng = sample_rng(options.seed, split, index)
    label = index % 10
    # Each option left at 0 draws nothing from rng: the canvases are those drawn before it existed.
    if options.placements and split == "train":
        source = int(training_sources(options)[label][index // 10 // options.placements])
    else:
        source = int(rng.choice(pool[labels[pool] == label]))
    size = options.digit_size
    if options.digit_size_max:
        size = int(rng.integers(options.digit_size, options.digit_size_max + 1))
    images = source_digits(size)[0]
    piece = options.clutter_size
    top, left = (int(v) for v in rng.integers(0, np.array(image_hw) - size + 1))
    count = clutter_count(options, image_hw)

    others = pool[pool != source]
    donors = rng.choice(others, size=(count, _CROP_TRIES))
    crop_corners = rng.integers(0, size - piece + 1, size=(count, _CROP_TRIES, 2))
    rows = crop_corners[..., 0, None, None] + np.arange(piece)[:, None]
    cols = crop_corners[..., 1, None, None] + np.arange(piece)[None, :]
    crops = images[donors[..., None, None], rows, cols]  # (count, tries, piece, piece)
    ink = crops.reshape(count, _CROP_TRIES, -1).sum(axis=2, dtype=np.int64)
    enough = ink >= _MIN_INK * 255 * piece * piece
    chosen = np.where(enough.any(axis=1), enough.argmax(axis=1), ink.argmax(axis=1))
    pieces = crops[np.arange(count), chosen]

    canvas = np.zeros(image_hw, dtype=np.uint8)
    for (y, x), crop in zip(_clutter_positions(rng, count, image_hw, piece, top, left, size), pieces):
        np.maximum(canvas[y:y + piece, x:x + piece], crop, out=canvas[y:y + piece, x:x + piece])
    np.maximum(canvas[top:top + size, left:left + size], images[source], out=canvas[top:top + size, left:left + size])
    return canvas, label, Placement(top=top, left=left, size=size, source=source)


def generate(options: ClutteredDigitsOptions, image_hw: tuple[int, int], split: str,
             indices: np.ndarray) -> dict[str, np.ndarray]:
    """images (n, H, W) uint8, labels (n,) int64, placement (n, 4) int32 (top, left, side, source digit index)."""
    if split not in SPLITS:
        raise ValueError(f"split {split!r} is not one of {', '.join(SPLITS)}")
    images = np.empty((len(indices), *image_hw), dtype=np.uint8)
    labels = np.empty(len(indices), dtype=np.int64)
    placement = np.empty((len(indices), 4), dtype=np.int32)
    for row, index in enumerate(indices.tolist()):
        images[row], labels[row], where = draw(options, image_hw, split, index)
        placement[row] = where.top, where.left, where.size, where.source
    return {"images": images, "labels": labels, "placement": placement}


TASK = Task(
    name="cluttered-digits", options=ClutteredDigitsOptions, version=1, num_classes=10, generate=generate,
    check=check_options,
)
