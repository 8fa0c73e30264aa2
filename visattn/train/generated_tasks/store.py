"""Drawing a whole split (in several processes) and caching it on disk.

A split is cached as one ``.npz`` file named by a key over everything that fixes its images: the
task, its image version, every option (seed included), the image size, the split and this file's
format version. The file holds a SHA-256 of its arrays and is written to a temporary name, then
renamed, so a reader sees either nothing or a whole file; a file that cannot be read, lacks an
array, has the wrong shapes or fails its checksum is drawn again and replaced, never used.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import tempfile
import zipfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from visattn.train.generated_tasks.common import Task

FORMAT_VERSION = 1
_CHUNK = 250  # samples per task handed to a worker process
_CHECKSUM = "sha256"

logger = logging.getLogger(__name__)


def cache_key(task: Task, options: object, image_hw: tuple[int, int], split: str) -> str:
    described = {
        "format": FORMAT_VERSION, "task": task.name, "version": task.version, "options": dataclasses.asdict(options),
        "image_hw": list(image_hw), "split": split,
    }
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:20]


def cache_path(root: str | Path, task: Task, options: object, image_hw: tuple[int, int], split: str) -> Path:
    return Path(root) / "generated" / task.name / f"{split}-{cache_key(task, options, image_hw, split)}.npz"


def _checksum(arrays: dict[str, np.ndarray]) -> np.ndarray:
    digest = hashlib.sha256()
    for name in sorted(arrays):
        array = np.ascontiguousarray(arrays[name])
        digest.update(f"{name}:{array.dtype.str}:{array.shape}".encode())
        digest.update(array.data)
    return np.frombuffer(digest.digest(), dtype=np.uint8)


def read_split(path: Path, size: int, image_hw: tuple[int, int]) -> dict[str, np.ndarray] | None:
    """The arrays in ``path`` if it is a whole, unaltered split of ``size`` images of ``image_hw``; else None."""
    try:
        with np.load(path, allow_pickle=False) as stored:
            arrays = {name: stored[name] for name in stored.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, KeyError) as error:
        logger.warning("cached split %s cannot be read (%s); drawing it again", path, error)
        return None
    checksum = arrays.pop(_CHECKSUM, None)
    images, labels = arrays.get("images"), arrays.get("labels")
    if (
        checksum is None or images is None or labels is None or images.shape != (size, *image_hw)
        or images.dtype != np.uint8 or labels.shape != (size,)
        or not np.array_equal(checksum, _checksum(arrays))
    ):
        logger.warning("cached split %s is incomplete or altered; drawing it again", path)
        return None
    return arrays


def write_split(path: Path, arrays: dict[str, np.ndarray]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}-", suffix=".npz.partial")
    try:
        with os.fdopen(handle, "wb") as file:
            np.savez_compressed(file, **arrays, **{_CHECKSUM: _checksum(arrays)})
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def _draw_chunk(task: Task, options: object, image_hw: tuple[int, int], split: str, start: int, stop: int) -> dict[str, np.ndarray]:
    return task.generate(options, image_hw, split, np.arange(start, stop))


def available_cpus() -> int:
    """The CPU cores this process may run on (its affinity, where the system has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def draw_split(task: Task, options: object, image_hw: tuple[int, int], split: str, workers: int | None = None) -> dict[str, np.ndarray]:
    """Every sample of ``split``, drawn in ``workers`` processes (default: one per CPU, one for a small split).

    The result does not depend on ``workers``: each sample draws from its own seeded generator.
    """
    size = options.size(split)
    bounds = [(start, min(start + _CHUNK, size)) for start in range(0, size, _CHUNK)]
    workers = min(workers or available_cpus(), len(bounds))
    if workers <= 1:
        chunks = [_draw_chunk(task, options, image_hw, split, start, stop) for start, stop in bounds]
    else:
        with ProcessPoolExecutor(workers) as pool:
            chunks = list(pool.map(_draw_chunk, *zip(*[(task, options, image_hw, split, a, b) for a, b in bounds])))
    return {name: np.concatenate([chunk[name] for chunk in chunks]) for name in chunks[0]}


def load_split(task: Task, options: object, image_hw: tuple[int, int], split: str, root: str | Path,
               workers: int | None = None) -> dict[str, np.ndarray]:
    """``split`` from the cache under ``root``, drawn (and cached) when it is missing or not whole."""
    path = cache_path(root, task, options, image_hw, split)
    if path.exists():
        arrays = read_split(path, options.size(split), image_hw)
        if arrays is not None:
            return arrays
    arrays = draw_split(task, options, image_hw, split, workers)
    write_split(path, arrays)
    return arrays
