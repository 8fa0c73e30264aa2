"""Moved to :mod:`visattn.train.data` (the augmentation check to :mod:`visattn.train.augment`); this alias
is kept for one release."""
from visattn._moved import warn_moved
from visattn.train.augment import check_auto_augment
from visattn.train.config import ConfigError, TrainConfig
from visattn.train.data import SPLIT_SEED, DataError, DataSplits, TransformedDataset, build_transform, load_splits
from visattn.train.datasets.local import DigitsDataset, load_digits_splits, load_imagefolder_splits
from visattn.train.datasets.public import load_torchvision_splits as load_cifar_splits

warn_moved(__name__, "visattn.train.data")

__all__ = [
    "SPLIT_SEED",
    "ConfigError",
    "DataError",
    "DataSplits",
    "DigitsDataset",
    "TrainConfig",
    "TransformedDataset",
    "build_transform",
    "check_auto_augment",
    "load_cifar_splits",
    "load_digits_splits",
    "load_imagefolder_splits",
    "load_splits",
]
