"""The mean and standard deviation of a generated split's images (its normalisation), from a fixed number of its
first images, drawn in several processes and remembered on disk.

The statistics count every pixel of the split's first :func:`statistics_size` images: the whole split up to
``STATISTICS_PIXELS`` pixels (10,000 images of 128x128), fewer at larger sizes (156 at 1024 px, 39 at 2048 px),
so that they cost a run a few seconds at any size and no process ever holds or draws a whole high-resolution
split for them. A split within the budget, such as every split behind the published tables (at most 10,000
images at 128 px, 1,000 at 256 px), gets the statistics of all its images.

They are remembered as ``<root>/generated/<task>/statistics-<key>.json``, the key a hash of everything that fixes
the images counted (the task, its image version, every option, the image size, the split, the number of images).
The file holds that description, the 256-level histogram the statistics come from and a SHA-256 of both, and is
written under a temporary name, then renamed; one that cannot be read, describes other images, fails its checksum
or does not count every pixel of those images is computed again, never used.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import tempfile
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import numpy as np
from visattn.train.generated_tasks.common import Task
from visattn.train.progress import preparation_bar

FORMAT_VERSION = 1
STATISTICS_PIXELS = 10_000 * 128 * 128
CHUNK_PIXELS = 250 * 128 * 128  # the pixels one task handed to a process draws: 250 images of 128 px, 3 of 1024 px
LEVELS = 256

logger = logging.getLogger(__name__)


def available_cpus() -> int:
    """The CPU cores this process may run on (its affinity, where the system has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def statistics_size(split_size: int, image_hw: tuple[int, int]) -> int:
    """How many of a split's first images its statistics count: all of them up to ``STATISTICS_PIXELS`` pixels."""
    return min(split_size, max(1, STATISTICS_PIXELS // (image_hw[0] * image_hw[1])))


def grey_mean_std(counts: np.ndarray) -> tuple[float, float]:
    """Mean and standard deviation in [0, 1] of the pixels a 256-level histogram ``counts`` (256,) counts."""
    levels = np.arange(LEVELS) / 255.0
    mean = float(counts @ levels / counts.sum())
    variance = float(counts @ (levels - mean) ** 2 / counts.sum())
    return mean, max(variance, 1e-12) ** 0.5


def describe(task: Task, options: object, image_hw: tuple[int, int], split: str, samples: int) -> dict[str, Any]:
    """Everything that fixes the images the statistics of ``split`` count, as JSON values."""
    return {
        "format": FORMAT_VERSION, "task": task.name, "version": task.version, "options": dataclasses.asdict(options),
        "image_hw": list(image_hw), "split": split, "samples": samples,
    }


def _digest(value: object) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def statistics_path(root: str | Path, described: dict[str, Any]) -> Path:
    return Path(root) / "generated" / described["task"] / f"statistics-{_digest(described)[:20]}.json"


def draw_histogram(task: Task, options: object, image_hw: tuple[int, int], split: str, start: int, stop: int) -> np.ndarray:
    """(256,) int64 pixel counts of samples ``start`` to ``stop`` of ``split``."""
    images = task.generate(options, image_hw, split, np.arange(start, stop))["images"]
    return np.bincount(images.ravel(), minlength=LEVELS).astype(np.int64)


def count_levels(task: Task, options: object, image_hw: tuple[int, int], split: str, samples: int,
                 workers: int | None = None, progress: bool = False) -> np.ndarray:
    """(256,) pixel counts of the first ``samples`` images of ``split``, drawn in ``workers`` processes (default: one
    per CPU; one for a single chunk), with a progress bar if ``progress`` (:func:`visattn.train.progress.preparation_bar`).
    The counts do not depend on ``workers``: each sample draws from its own seeded generator."""
    step = max(1, CHUNK_PIXELS // (image_hw[0] * image_hw[1]))
    bounds = [(start, min(start + step, samples)) for start in range(0, samples, step)]
    workers = min(workers or available_cpus(), len(bounds))
    counts = np.zeros(LEVELS, dtype=np.int64)
    bar = preparation_bar(samples, f"{task.name} {split}: normalisation statistics", "image", shown=progress)
    with bar:
        if workers <= 1:
            for start, stop in bounds:
                counts += draw_histogram(task, options, image_hw, split, start, stop)
                bar.update(stop - start)
            return counts
        with ProcessPoolExecutor(workers) as pool:
            futures = {pool.submit(draw_histogram, task, options, image_hw, split, start, stop): stop - start
                       for start, stop in bounds}
            for future in as_completed(futures):
                counts += future.result()
                bar.update(futures[future])
    return counts


def split_statistics(task: Task, options: object, image_hw: tuple[int, int], split: str, root: str | Path,
                     progress: bool = False, workers: int | None = None) -> tuple[float, float]:
    """(mean, std) of ``split``'s first :func:`statistics_size` images, remembered under ``root``."""
    samples = statistics_size(options.size(split), image_hw)
    described = describe(task, options, image_hw, split, samples)
    path = statistics_path(root, described)
    counts = read_counts(path, described)
    if counts is None:
        counts = count_levels(task, options, image_hw, split, samples, workers, progress)
        write_counts(path, described, counts)
    return grey_mean_std(counts)


def read_counts(path: Path, described: dict[str, Any]) -> np.ndarray | None:
    """The histogram in ``path`` if the file is there, whole and unaltered, holds the statistics ``described`` and
    counts every pixel of their images; else None."""
    if not path.exists():
        return None
    try:
        stored = json.loads(path.read_text())
        counts = np.asarray(stored["counts"], dtype=np.int64)
        checksum = stored["sha256"]
    except (OSError, ValueError, TypeError, KeyError, OverflowError) as error:
        logger.warning("statistics %s cannot be read (%s); computing them again", path, error)
        return None
    pixels = described["samples"] * described["image_hw"][0] * described["image_hw"][1]
    if (
        stored.get("described") != described or checksum != _digest([described, stored["counts"]])
        or counts.shape != (LEVELS,) or (counts < 0).any() or counts.sum() != pixels
    ):
        logger.warning("statistics %s are altered or not of the images they name; computing them again", path)
        return None
    return counts


def write_counts(path: Path, described: dict[str, Any], counts: np.ndarray) -> None:
    """Written whole or not at all; statistics that cannot be written are only computed again next time."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}-", suffix=".json.partial")
    except OSError as error:
        logger.warning("statistics %s not written: %s", path, error)
        return
    listed = counts.tolist()
    try:
        with os.fdopen(handle, "w") as file:
            json.dump({"described": described, "counts": listed, "sha256": _digest([described, listed])}, file)
        os.replace(temporary, path)
    except OSError as error:
        logger.warning("statistics %s not written: %s", path, error)
    finally:  # gone once renamed; a stopped or failed write leaves nothing behind
        with contextlib.suppress(OSError):
            Path(temporary).unlink(missing_ok=True)
