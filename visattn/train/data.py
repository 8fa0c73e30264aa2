"""Datasets and transforms for training: the dataset of a config (by name, from
:data:`visattn.train.datasets.DATASET_SPECS`), limited to a fixed subset if asked, and timm's transforms.

Every dataset yields PIL RGB images; timm's ``create_transform`` turns them into tensors, resized to the
image size the patch grid asks for, and normalised as :func:`choose_normalization` says: with the dataset's
mean and std, except when the run starts from weights trained with another. The image files a run reads are checked before it starts
(:func:`check_images`), and those that cannot be read are named or, if asked, left out (:func:`without_images`). Training
augmentation draws its randomness from a seed fixed by (run seed, epoch, sample index), not from the
process RNG, so the augmented images do not depend on the number of processes, the number of
workers, the batch a sample lands in, or whether the run was resumed midway through an epoch.
"""
from __future__ import annotations

import random
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from timm.data import create_transform
from timm.models import get_pretrained_cfg
from torch.utils.data import Dataset, Subset

from visattn.predict import read_model_file, recorded_data_config

from visattn.train.config import TrainConfig
from visattn.train.datasets import DATASET_SPECS, SPLIT_SEED, DataError, DataSource, DataSplits
from visattn.train.datasets.image_files import ImageCheck, check_image_files, describe_unreadable, image_samples
from visattn.train.run_dir import is_run_dir

__all__ = [
    "SPLIT_SEED", "DataError", "DataSplits", "ImageCheck", "Normalization", "TransformedDataset", "build_transform",
    "check_images", "choose_normalization", "describe_unreadable", "load_splits", "without_images",
]


def load_splits(config: TrainConfig, download: bool = False, progress: bool = False) -> DataSplits:
    """The dataset of ``config``, limited to ``max_*_samples``; DataError if it is not available.

    Only ``download`` fetches a missing dataset; ``progress`` shows a progress bar while a preparation (a generated
    dataset's statistics) runs.
    """
    spec = DATASET_SPECS[config.dataset]
    source = DataSource(
        data_dir=config.data_dir, download=download, eval_fraction=config.eval_fraction,
        options=config.dataset_kwargs, image_hw=config.image_hw, progress=progress,
    )
    splits = spec.load(source)
    return DataSplits(
        train=_fixed_subset(splits.train, config.max_train_samples),
        eval=_fixed_subset(splits.eval, config.max_eval_samples),
        val=None if splits.val is None else _fixed_subset(splits.val, config.max_eval_samples),
        num_classes=splits.num_classes, mean=splits.mean, std=splits.std, classes=splits.classes,
    )


def check_images(config: TrainConfig, splits: DataSplits, progress: bool = False) -> ImageCheck:
    """Reads every image file ``splits`` will read once (files remembered from an earlier check as read well
    and unchanged are skipped), in ``max(1, num_workers)`` threads, with a progress bar if ``progress``; what
    cannot be read is in ``unreadable``. A dataset not read from a list of files (generated, in memory, or a
    torchvision class with its own list) has none."""
    files = [path for part in (splits.train, splits.val, splits.eval) if part is not None
             for path, _ in image_samples(part) or ()]
    if not files:
        return ImageCheck()
    root = DataSource(data_dir=config.data_dir, download=False, eval_fraction=config.eval_fraction).root
    return check_image_files(files, root, threads=max(1, config.num_workers), progress=progress)


def without_images(splits: DataSplits, unreadable: Collection[str]) -> DataSplits:
    """``splits`` without the images read from the files of ``unreadable``; DataError when that leaves a split
    without images, or a class without training images."""
    kept: dict[str, Dataset | None] = {}
    for name, part in (("train", splits.train), ("validation", splits.val), ("test", splits.eval)):
        samples = None if part is None else image_samples(part)
        if samples is None:
            kept[name] = part
            continue
        indices = [index for index, (path, _) in enumerate(samples) if path not in unreadable]
        if not indices:
            raise DataError(f"the {name} split has no readable image left: none of its {len(samples)} files can be read")
        kept[name] = part if len(indices) == len(samples) else Subset(part, indices)
    train_samples = image_samples(kept["train"]) or []
    if train_samples:
        left = {label for _, label in train_samples}
        lost = [name for label, name in enumerate(splits.named_classes()) if label not in left]
        if lost:
            raise DataError(f"once the unreadable files are left out, class(es) {', '.join(lost)} have no training image")
    return DataSplits(
        train=kept["train"], eval=kept["test"], val=kept["validation"], num_classes=splits.num_classes,
        mean=splits.mean, std=splits.std, classes=splits.classes,
    )


def _fixed_subset(dataset: Dataset, size: int | None) -> Dataset:
    if size is None or size >= len(dataset):
        return dataset
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(SPLIT_SEED))
    return Subset(dataset, sorted(order[:size].tolist()))


@dataclass(frozen=True)
class Normalization:
    """The per-channel ``mean`` and ``std`` a run normalises its images with, and ``reason``: why these."""

    mean: tuple[float, ...]
    std: tuple[float, ...]
    reason: str

    def line(self) -> str:
        """The start-up line: 'normalisation: mean (0.5, 0.5, 0.5), std (0.5, 0.5, 0.5): REASON'."""
        mean, std = (", ".join(f"{value:.4g}" for value in values) for values in (self.mean, self.std))
        return f"normalisation: mean ({mean}), std ({std}): {self.reason}"


def choose_normalization(config: TrainConfig, splits: DataSplits) -> Normalization:
    """The mean and std of the images' normalisation: the ones the first weights were trained with when the run
    starts from weights, else the dataset's.

    * ``initial_checkpoint`` a visattn run: the mean and std that run recorded in its model.json;
    * ``pretrained``, or ``initial_checkpoint`` a weights file, of a timm model with published weights (its
      ``pretrained_cfg``, with the ``pretrained_cfg_overlay`` of ``model_kwargs``): its (timm's augreg ViTs 0.5/0.5, DeiT
      ImageNet's), which the weights expect, whatever the dataset's own statistics;
    * otherwise (fresh weights, or a visattn_vit_* model, which timm publishes no weights of): the dataset's.
    """
    if config.initial_checkpoint is not None and is_run_dir(Path(config.initial_checkpoint)):
        recorded = recorded_data_config(read_model_file(config.initial_checkpoint))
        return Normalization(tuple(recorded["mean"]), tuple(recorded["std"]),
                             f"the one {config.initial_checkpoint} was trained with, whose weights the run starts from")
    pretrained_cfg = get_pretrained_cfg(config.model) if config.pretrained or config.initial_checkpoint else None
    # visattn_vit_* models carry a cfg too (ImageNet's mean/std), but no published weights that would expect it
    if pretrained_cfg is not None and (pretrained_cfg.hf_hub_id or pretrained_cfg.url):
        overlay = config.model_kwargs.get("pretrained_cfg_overlay") or {}
        mean, std = overlay.get("mean", pretrained_cfg.mean), overlay.get("std", pretrained_cfg.std)
        weights = "--pretrained" if config.pretrained else "--initial-checkpoint"
        named = pretrained_cfg.hf_hub_id or config.model
        return Normalization(tuple(mean), tuple(std), f"{config.model}'s pretrained_cfg ({named}), what the weights of "
                             f"{weights} expect, not the {config.dataset} dataset's own")
    return Normalization(tuple(splits.mean), tuple(splits.std), f"the {config.dataset} dataset's")


def eval_data_config(config: TrainConfig, splits: DataSplits) -> dict[str, Any]:
    """The evaluation transform in timm's data-config vocabulary (what ``timm.data.resolve_data_config``
    returns and ``create_transform`` takes): resize the shorter side to the image size, centre crop,
    normalize (:func:`choose_normalization`). model.json records it, so that prediction sees images as
    evaluation did."""
    normalization = choose_normalization(config, splits)
    return dict(
        input_size=(3, *config.image_hw), interpolation="bicubic", mean=normalization.mean, std=normalization.std,
        crop_pct=1.0, crop_mode="center",
    )


def build_transform(config: TrainConfig, splits: DataSplits, training: bool) -> Callable[[Image.Image], torch.Tensor]:
    """timm's transform: random-resized crop, flip, RandAugment, erasing for training; resize for eval."""
    data_config = eval_data_config(config, splits)
    if not (training and config.augment):
        return create_transform(is_training=False, **data_config)
    common = {key: data_config[key] for key in ("input_size", "interpolation", "mean", "std")}
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
    The epoch lives in shared memory, so that the persistent workers of a DataLoader, each holding a copy
    of the dataset from the first epoch, see every :meth:`set_epoch`.
    """

    def __init__(self, base: Dataset, transform: Callable[[Any], torch.Tensor], seed: int | None) -> None:
        self.base = base
        self.transform = transform
        self.seed = seed
        self._epoch = torch.zeros((), dtype=torch.int64).share_memory_()

    @property
    def epoch(self) -> int:
        return int(self._epoch)

    def set_epoch(self, epoch: int) -> None:
        self._epoch.fill_(epoch)

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
