"""The image files a dataset is read from: read as prediction reads them (:func:`visattn.predict.read_image`),
checked before training starts, and an unreadable one named with what is wrong with it.

A damaged file found only when an epoch reaches it costs the epoch, and without this module the error
would name no file. :func:`check_image_files` therefore decodes every file a run will read once, before
the run directory is touched (a JPEG at an eighth of its size, which still decodes all of its data), in
a pool of threads (Pillow lets go of the GIL while it decodes). The files that read well are remembered
by size, modification time and inode in ``$XDG_CACHE_HOME/visattn/image-check/`` (``~/.cache`` when the
variable is unset), so that a resumed or repeated run decodes only what changed. A file damaged after it
was checked still fails when it is read, with the same one line naming it (:class:`BadImageError`).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image
from torch.utils.data import Dataset, Subset
from torchvision.datasets import DatasetFolder

from visattn.predict.images import UnreadableImageError, read_image
from visattn.train.datasets.spec import DataError
from visattn.train.progress import preparation_bar

logger = logging.getLogger(__name__)

CACHE_VERSION = 1


class BadImageError(DataError):
    """An image file that cannot be read: ``"<path>: <what is wrong>"``."""

    def __init__(self, message: str) -> None:
        # Raised in a DataLoader worker, the error reaches the main process rebuilt from the worker's whole
        # traceback as its message (torch's ExceptionWrapper); the last line of it is this error's own.
        lines = message.strip().splitlines() or [""]
        super().__init__(lines[-1].split(f"{BadImageError.__name__}: ", 1)[-1])


def load_image(path: str) -> Image.Image:
    """The ImageFolder loader: the image at ``path`` as 8-bit RGB, or a BadImageError naming it."""
    try:
        return read_image(path)
    except UnreadableImageError as error:
        raise BadImageError(f"{path}: {error}") from None


def image_samples(dataset: Dataset) -> list[tuple[str, int]] | None:
    """(file, class index) of each index of ``dataset``, through Subsets down to a torchvision DatasetFolder
    (ImageFolder, EuroSAT); None for a dataset that is not read from a list of files."""
    if isinstance(dataset, Subset):
        samples = image_samples(dataset.dataset)
        return None if samples is None else [samples[index] for index in dataset.indices]
    if isinstance(dataset, DatasetFolder):
        return [(str(path), int(label)) for path, label in dataset.samples]
    return None


@dataclass(frozen=True)
class ImageCheck:
    """What :func:`check_image_files` found: ``unreadable`` maps each file that cannot be read to what is
    wrong with it; ``checked`` files in all, ``decoded`` of them read this time (the others unchanged since
    an earlier check), in ``seconds``."""

    checked: int = 0
    decoded: int = 0
    seconds: float = 0.0
    unreadable: dict[str, str] = field(default_factory=dict)


def cache_file(root: Path) -> Path:
    """Where the files under ``root`` that read well are remembered."""
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    digest = hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:16]
    return Path(cache) / "visattn" / "image-check" / f"{digest}.json"


def check_image_files(paths: Sequence[str], root: Path, threads: int, progress: bool = False) -> ImageCheck:
    """Reads each file of ``paths`` (under ``root``) once, in ``threads`` threads, but those remembered as read
    well and unchanged since, with a progress bar if ``progress``; remembers the ones that read well."""
    started = time.perf_counter()
    files = list(dict.fromkeys(paths))
    remembered = _read_cache(root)
    keys = {path: os.path.relpath(path, root) for path in files}
    signatures = {path: _signature(path) for path in files}
    to_decode = [path for path in files if signatures[path] is None or remembered.get(keys[path]) != signatures[path]]
    with ThreadPoolExecutor(max_workers=threads) as pool:
        bar = preparation_bar(len(to_decode), "image files: checking", "file", shown=progress)
        problems = []
        with bar:
            for problem in pool.map(_problem, to_decode):
                problems.append(problem)
                bar.update()
    unreadable = {path: problem for path, problem in zip(to_decode, problems) if problem is not None}
    for path in files:
        if path in unreadable:
            remembered.pop(keys[path], None)
        elif signatures[path] is not None:
            remembered[keys[path]] = signatures[path]
    if to_decode:
        _write_cache(root, remembered)
    return ImageCheck(checked=len(files), decoded=len(to_decode), seconds=time.perf_counter() - started,
                      unreadable=unreadable)


def describe_unreadable(unreadable: dict[str, str], listed: int = 5) -> str:
    """'N image file(s) cannot be read: PATH: REASON; ...' in one line, the first ``listed`` of them named."""
    named = "; ".join(f"{path}: {reason}" for path, reason in list(unreadable.items())[:listed])
    more = f"; and {len(unreadable) - listed} more" if len(unreadable) > listed else ""
    return f"{len(unreadable)} image file(s) cannot be read: {named}{more}"


def _problem(path: str) -> str | None:
    try:
        read_image(path, draft=True)
    except UnreadableImageError as error:
        return str(error)
    return None


def _signature(path: str) -> list[int] | None:
    try:
        stat = os.stat(path)
    except OSError:
        return None  # reading it says what is wrong
    return [stat.st_size, stat.st_mtime_ns, stat.st_ino]


def _read_cache(root: Path) -> dict[str, list[int]]:
    """The remembered files (path relative to ``root`` -> signature); empty when there is no usable cache."""
    try:
        contents = json.loads(cache_file(root).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(contents, dict) or contents.get("version") != CACHE_VERSION or not isinstance(contents.get("files"), dict):
        return {}
    return contents["files"]


def _write_cache(root: Path, files: dict[str, list[int]]) -> None:
    """Written whole or not at all; a cache that cannot be written only means decoding again next time."""
    path = cache_file(root)
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"version": CACHE_VERSION, "root": str(root.resolve()), "files": files}))
        os.replace(tmp, path)
    except OSError as error:
        logger.debug("image check cache %s not written: %s", path, error)
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
