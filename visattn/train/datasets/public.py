"""Public datasets read through their torchvision classes: CIFAR-10/100, STL-10, Oxford 102 Flowers,
Oxford-IIIT Pet, Food-101, EuroSAT and Imagenette (three image sizes).

Each is read from ``--data-dir`` (default ``./data``) in the layout its torchvision class reads, and only
downloaded with ``--download``. The official splits are kept: the official test split (Imagenette's
``val``) is the one evaluated; the official validation split (Flowers-102's ``val``) is the validation
split; where there is none, a fixed, stratified 10% of train is held out for validation. EuroSAT has no
official split at all: a stratified ``eval_fraction`` of it is held out for test first.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from torch.utils.data import Dataset, Subset
from torchvision.datasets import CIFAR10, CIFAR100, STL10, EuroSAT, Flowers102, Food101, Imagenette, OxfordIIITPet

from visattn.train.datasets.spec import (
    DEFAULT_DATA_DIR, VAL_FRACTION, DataError, DataSource, DatasetSpec, DataSplits, cut_stratified,
)

# Raised by torchvision's classes for missing or damaged files: RuntimeError from their integrity or
# existence checks, FileNotFoundError for a listed file or folder that is not there, ValueError for a
# malformed annotation or array.
_READ_ERRORS = (RuntimeError, FileNotFoundError, ValueError)


@dataclass(frozen=True)
class TorchvisionReader:
    """How one torchvision dataset class is read.

    Attributes:
        cls: the torchvision class; called as ``cls(root, download=..., **split_keywords)``.
        folder: what the class reads under the root (the download creates it).
        train: keywords of the official training split.
        val: keywords of the official validation split; None: a stratified VAL_FRACTION of train.
        test: keywords of the official test split; None: a stratified ``eval_fraction`` of train.
        labels: the class index of every image of a split, read without decoding the images.
        classes: the class names of a split, in class-index order.
        errors: what the class raises for missing or damaged files.
    """

    cls: Callable[..., Dataset]
    folder: str
    train: dict[str, Any]
    val: dict[str, Any] | None
    test: dict[str, Any] | None
    labels: Callable[[Any], Sequence[int]]
    classes: Callable[[Any], Sequence[str]] = lambda dataset: dataset.classes
    mean: tuple[float, float, float] = IMAGENET_DEFAULT_MEAN
    std: tuple[float, float, float] = IMAGENET_DEFAULT_STD
    errors: tuple[type[Exception], ...] = _READ_ERRORS


# Several torchvision classes keep their labels only in a private list; reading it avoids decoding every
# image just to learn its class.
def _private_labels(dataset: Any) -> Sequence[int]:
    return dataset._labels


def _imagenette_labels(dataset: Imagenette) -> Sequence[int]:
    return [label for _, label in dataset._samples]


def _imagenette_classes(dataset: Imagenette) -> Sequence[str]:
    return [names[0] for names in dataset.classes]  # each class is a tuple of synonyms


def _stl10_classes(dataset: STL10) -> Sequence[str]:
    if not hasattr(dataset, "classes"):  # STL10 reads class_names.txt only if it is there
        raise FileNotFoundError(f"{Path(dataset.root) / STL10.base_folder / STL10.class_names_file} is missing")
    return dataset.classes


def _imagenette(size: str) -> TorchvisionReader:
    return TorchvisionReader(
        cls=Imagenette, folder=Path(Imagenette._ARCHIVES[size][0]).stem,
        train=dict(split="train", size=size), val=None, test=dict(split="val", size=size),
        labels=_imagenette_labels, classes=_imagenette_classes,
    )


READERS: dict[str, TorchvisionReader] = {
    "cifar10": TorchvisionReader(
        cls=CIFAR10, folder=CIFAR10.base_folder, train=dict(train=True), val=None, test=dict(train=False),
        labels=lambda dataset: dataset.targets, mean=(0.4914, 0.4822, 0.4465), std=(0.2470, 0.2435, 0.2616),
    ),
    "cifar100": TorchvisionReader(
        cls=CIFAR100, folder=CIFAR100.base_folder, train=dict(train=True), val=None, test=dict(train=False),
        labels=lambda dataset: dataset.targets, mean=(0.5071, 0.4865, 0.4409), std=(0.2673, 0.2564, 0.2762),
    ),
    "stl10": TorchvisionReader(
        cls=STL10, folder=STL10.base_folder, train=dict(split="train"), val=None, test=dict(split="test"),
        labels=lambda dataset: dataset.labels.tolist(), classes=_stl10_classes,
    ),
    "flowers102": TorchvisionReader(
        cls=Flowers102, folder="flowers-102", train=dict(split="train"), val=dict(split="val"),
        test=dict(split="test"), labels=_private_labels,
    ),
    "oxford_pets": TorchvisionReader(
        cls=OxfordIIITPet, folder="oxford-iiit-pet", train=dict(split="trainval"), val=None,
        test=dict(split="test"), labels=_private_labels,
    ),
    "food101": TorchvisionReader(
        cls=Food101, folder="food-101", train=dict(split="train"), val=None, test=dict(split="test"),
        labels=_private_labels,
    ),
    "eurosat": TorchvisionReader(
        cls=EuroSAT, folder="eurosat", train={}, val=None, test=None, labels=lambda dataset: dataset.targets,
    ),
    "imagenette": _imagenette("320px"),
    "imagenette-160": _imagenette("160px"),
    "imagenette-full": _imagenette("full"),
}


def load_torchvision_splits(name: str, data_dir: str | None, download: bool, eval_fraction: float = 0.2) -> DataSplits:
    """The splits of public dataset ``name`` under ``data_dir``, fetched first if ``download``; DataError
    (one line with the command that fetches it) if it is missing or damaged."""
    spec, reader = _SPECS[name], READERS[name]
    root = Path(data_dir or DEFAULT_DATA_DIR)
    folder = root / reader.folder
    if not download and not folder.exists():
        raise DataError(
            f"{spec.title} was not found: expected {folder}. Pass --download to fetch it (about "
            f"{spec.download_size}) into {root}: {spec.fetch_command(root)}"
        )
    try:
        full = reader.cls(str(root), download=download, **reader.train)
        official_val = reader.cls(str(root), **reader.val) if reader.val is not None else None
        official_test = reader.cls(str(root), **reader.test) if reader.test is not None else None
        labels = list(reader.labels(full))
        classes = tuple(reader.classes(full))
    except reader.errors as error:
        raise DataError(
            f"{spec.title} in {folder} is incomplete or corrupted ({error}). Delete that folder and fetch it "
            f"again: {spec.fetch_command(root)}"
        ) from None
    except OSError as error:
        raise DataError(f"downloading {spec.title} into {root} failed: {error}") from None
    keep = list(range(len(full)))
    test = official_test
    if test is None:
        kept, held = cut_stratified(labels, eval_fraction)
        keep, test = kept, Subset(full, held)
    val = official_val
    if val is None:
        kept, held = cut_stratified([labels[index] for index in keep], VAL_FRACTION)
        keep, val = [keep[i] for i in kept], Subset(full, [keep[i] for i in held])
    return DataSplits(
        train=Subset(full, keep), eval=test, val=val, num_classes=len(classes), mean=reader.mean, std=reader.std,
        classes=classes,
    )


def _spec(
    name: str, title: str, reader: str, size: int, official: str, download_size: str, recipe: str | None = None
) -> DatasetSpec:
    def load(source: DataSource) -> DataSplits:
        return load_torchvision_splits(name, source.data_dir, source.download, source.eval_fraction)

    return DatasetSpec(
        name=name, title=title, reader=reader, default_img_size=size, official_splits=official, load=load,
        download_size=download_size, recipe=recipe,
    )


SPECS = (
    _spec("cifar10", "CIFAR-10", "torchvision.datasets.CIFAR10", 32, "train 50,000 / test 10,000", "170 MB",
          recipe="cifar10-pixels-1024tok"),
    _spec("cifar100", "CIFAR-100", "torchvision.datasets.CIFAR100", 32, "train 50,000 / test 10,000", "170 MB",
          recipe="cifar100-pixels-1024tok"),
    _spec("stl10", "STL-10", "torchvision.datasets.STL10", 96,
          "train 5,000 / test 8,000 (the 100,000 unlabelled images are not used)", "2.6 GB"),
    _spec("flowers102", "Oxford 102 Flowers", "torchvision.datasets.Flowers102", 512,
          "train 1,020 / val 1,020 / test 6,149", "330 MB"),
    _spec("oxford_pets", "Oxford-IIIT Pet", "torchvision.datasets.OxfordIIITPet", 384,
          "trainval 3,680 / test 3,669", "800 MB"),
    _spec("food101", "Food-101", "torchvision.datasets.Food101", 512, "train 75,750 / test 25,250", "5 GB"),
    _spec("eurosat", "EuroSAT (RGB)", "torchvision.datasets.EuroSAT", 64,
          "none (27,000 images; a stratified eval_fraction is held out for test)", "90 MB"),
    _spec("imagenette", "Imagenette (320 px)", "torchvision.datasets.Imagenette(size='320px')", 320,
          "train 9,469 / val 3,925 (evaluated as test)", "330 MB"),
    _spec("imagenette-160", "Imagenette (160 px)", "torchvision.datasets.Imagenette(size='160px')", 160,
          "train 9,469 / val 3,925 (evaluated as test)", "95 MB"),
    _spec("imagenette-full", "Imagenette (full size)", "torchvision.datasets.Imagenette(size='full')", 448,
          "train 9,469 / val 3,925 (evaluated as test)", "1.5 GB", recipe="imagenette-448"),
)
_SPECS = {spec.name: spec for spec in SPECS}
