"""Datasets and transforms for training: the embedded digits, CIFAR-10/100, any ImageFolder, and the
generated tasks of :mod:`visattn.train.generated`.

The embedded default is scikit-learn's handwritten digits (``sklearn.datasets.load_digits``): 1,797
real 8x8 grey-level scans of the digits 0-9 (the UCI optdigits test set) that ship inside the
scikit-learn wheel (part of the ``visattn[train]`` install), so a run needs no download. They are
split once, stratified, with a fixed seed (80/20 by default), and resized like every other dataset
to the image size the patch grid asks for.

Every dataset yields PIL RGB images; timm's ``create_transform`` turns them into tensors. Training
augmentation draws its randomness from a seed fixed by (run seed, epoch, sample index), not from the
process RNG, so the augmented images do not depend on the number of processes, the number of
workers, the batch a sample lands in, or whether the run was resumed midway through an epoch.
"""
from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD, create_transform
from torch.utils.data import Dataset, Subset
from torchvision.datasets import CIFAR10, CIFAR100, ImageFolder

from visattn.train.config import TrainConfig
from visattn.train.generated import TASKS, load_generated

# Seed of the fixed splits and subsets: part of the dataset's definition, not of a run.
SPLIT_SEED = 0

_CIFAR = {
    "cifar10": dict(
        label="CIFAR-10", folder="cifar-10-batches-py", size="170 MB", num_classes=10,
        mean=(0.4914, 0.4822, 0.4465), std=(0.2470, 0.2435, 0.2616),
    ),
    "cifar100": dict(
        label="CIFAR-100", folder="cifar-100-python", size="170 MB", num_classes=100,
        mean=(0.5071, 0.4865, 0.4409), std=(0.2673, 0.2564, 0.2762),
    ),
}
_EVAL_FOLDERS = ("val", "validation", "test")


class DataError(Exception):
    """The dataset asked for is not there or cannot be read; the message says how to get it."""


@dataclass(frozen=True)
class DataSplits:
    """Train and evaluation images as (PIL RGB image, class index) pairs, before any transform."""

    train: Dataset
    eval: Dataset
    num_classes: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]


class DigitsDataset(Dataset):
    """scikit-learn's 8x8 digits (grey levels 0-16) as PIL RGB images."""

    def __init__(self, images: np.ndarray, labels: np.ndarray) -> None:
        # (N, 8, 8) grey levels 0..16 -> uint8 0..255
        self.images = np.rint(images * (255.0 / 16.0)).astype(np.uint8)
        self.labels = labels.astype(np.int64)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[Image.Image, int]:
        return Image.fromarray(self.images[index]).convert("RGB"), int(self.labels[index])


def load_digits_splits(eval_fraction: float) -> DataSplits:
    digits = load_digits()
    x_train, x_eval, y_train, y_eval = train_test_split(
        digits.images, digits.target, test_size=eval_fraction, stratify=digits.target, random_state=SPLIT_SEED
    )
    mean = float(x_train.mean() / 16.0)
    std = float(x_train.std() / 16.0)
    return DataSplits(
        train=DigitsDataset(x_train, y_train), eval=DigitsDataset(x_eval, y_eval),
        num_classes=10, mean=(mean,) * 3, std=(std,) * 3,
    )


def load_cifar_splits(name: str, data_dir: str | None, download: bool) -> DataSplits:
    spec = _CIFAR[name]
    root = Path(data_dir or "data")
    if not download and not (root / spec["folder"]).is_dir():
        raise DataError(
            f"{spec['label']} was not found: expected {root / spec['folder']}. Pass --download to fetch it "
            f"(about {spec['size']}) into {root}, or point --data-dir at the folder that holds {spec['folder']}."
        )
    cls = CIFAR10 if name == "cifar10" else CIFAR100
    try:
        train = cls(str(root), train=True, download=download)
        evaluation = cls(str(root), train=False, download=False)
    except RuntimeError as error:  # torchvision: "Dataset not found or corrupted"
        raise DataError(
            f"{spec['label']} in {root / spec['folder']} is incomplete or corrupted ({error}). Delete that "
            "folder and pass --download to fetch it again."
        ) from None
    except OSError as error:
        raise DataError(f"downloading {spec['label']} into {root} failed: {error}") from None
    return DataSplits(train=train, eval=evaluation, num_classes=spec["num_classes"], mean=spec["mean"], std=spec["std"])


def load_imagefolder_splits(data_dir: str, eval_fraction: float) -> DataSplits:
    """``data_dir/train`` + ``data_dir/{val,validation,test}``, or one folder split by ``eval_fraction``."""
    root = Path(data_dir)
    if not root.is_dir():
        raise DataError(
            f"image folder {root} does not exist. --data-dir must hold one sub-folder of images per class "
            "(or train/ and val/ folders that each do)."
        )
    try:
        if (root / "train").is_dir():
            eval_dirs = [root / name for name in _EVAL_FOLDERS if (root / name).is_dir()]
            if not eval_dirs:
                raise DataError(f"{root} has train/ but no {', '.join(_EVAL_FOLDERS)} folder to evaluate on.")
            train, evaluation = ImageFolder(str(root / "train")), ImageFolder(str(eval_dirs[0]))
            if train.classes != evaluation.classes:
                raise DataError(f"{root / 'train'} and {eval_dirs[0]} do not have the same class folders.")
            num_classes = len(train.classes)
        else:
            full = ImageFolder(str(root))
            indices = np.arange(len(full))
            stratify = full.targets if min(np.bincount(full.targets)) >= 2 else None
            train_idx, eval_idx = train_test_split(
                indices, test_size=eval_fraction, stratify=stratify, random_state=SPLIT_SEED
            )
            train, evaluation = Subset(full, train_idx.tolist()), Subset(full, eval_idx.tolist())
            num_classes = len(full.classes)
    except (FileNotFoundError, ValueError) as error:  # ImageFolder: no class folders / no images
        raise DataError(f"cannot read image folder {root}: {error}") from None
    return DataSplits(
        train=train, eval=evaluation, num_classes=num_classes, mean=IMAGENET_DEFAULT_MEAN, std=IMAGENET_DEFAULT_STD
    )


def load_splits(config: TrainConfig, download: bool = False) -> DataSplits:
    """The dataset of ``config``, limited to ``max_*_samples``; DataError if it is not available."""
    if config.dataset == "digits":
        splits = load_digits_splits(config.eval_fraction)
    elif config.dataset in _CIFAR:
        splits = load_cifar_splits(config.dataset, config.data_dir, download)
    elif config.dataset in TASKS:
        generated = load_generated(config.dataset, config.dataset_kwargs, config.image_hw, config.data_dir or "data")
        splits = DataSplits(generated.train, generated.test, generated.num_classes, generated.mean, generated.std)
    else:
        splits = load_imagefolder_splits(config.data_dir, config.eval_fraction)
    return DataSplits(
        train=_fixed_subset(splits.train, config.max_train_samples),
        eval=_fixed_subset(splits.eval, config.max_eval_samples),
        num_classes=splits.num_classes, mean=splits.mean, std=splits.std,
    )


def _fixed_subset(dataset: Dataset, size: int | None) -> Dataset:
    if size is None or size >= len(dataset):
        return dataset
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(SPLIT_SEED))
    return Subset(dataset, sorted(order[:size].tolist()))


def build_transform(config: TrainConfig, splits: DataSplits, training: bool) -> Callable[[Image.Image], torch.Tensor]:
    """timm's transform: random-resized crop, flip, RandAugment, erasing for training; resize for eval."""
    common = dict(input_size=(3, *config.image_hw), interpolation="bicubic", mean=splits.mean, std=splits.std)
    if not (training and config.augment):
        return create_transform(is_training=False, crop_pct=1.0, **common)
    return create_transform(
        is_training=True,
        scale=tuple(config.crop_scale),
        ratio=tuple(config.crop_ratio),
        hflip=config.hflip,
        color_jitter=config.color_jitter,
        auto_augment=config.auto_augment,
        re_prob=config.re_prob,
        **common,
    )


class TransformedDataset(Dataset):
    """``base`` with ``transform`` applied; with a ``seed``, every draw is fixed by (seed, epoch, index).

    The transform runs with the Python, NumPy and torch CPU generators seeded for this sample and
    restored afterwards, so it neither depends on nor disturbs the process RNG (dropout, mixup).
    """

    def __init__(self, base: Dataset, transform: Callable[[Any], torch.Tensor], seed: int | None) -> None:
        self.base = base
        self.transform = transform
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image, label = self.base[index]
        if self.seed is None:
            return self.transform(image), label
        with _rng_fixed_to(np.random.SeedSequence([self.seed, self.epoch, index])):
            return self.transform(image), label


@contextmanager
def _rng_fixed_to(seed_sequence: np.random.SeedSequence) -> Iterator[None]:
    py_seed, np_seed, torch_seed = seed_sequence.generate_state(3).tolist()
    saved = random.getstate(), np.random.get_state(), torch.get_rng_state()
    random.seed(py_seed)
    np.random.seed(np_seed)
    torch.default_generator.manual_seed(torch_seed)  # CPU only: GPU generators keep their state
    try:
        yield
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])
        torch.set_rng_state(saved[2])
