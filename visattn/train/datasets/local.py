"""Datasets that need no download: the embedded digits, and any folder of images (ImageFolder).

The embedded default is scikit-learn's handwritten digits (``sklearn.datasets.load_digits``): 1,797
real 8x8 grey-level scans of the digits 0-9 (the UCI optdigits test set) that ship inside the
scikit-learn wheel (part of the ``visattn[train]`` install), so a run needs no download. They are
split once, stratified, with a fixed seed (80/20 by default: 360 test images); a fixed, stratified
``VAL_FRACTION`` of the training images is then held out for validation.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from torch.utils.data import Dataset
from torchvision.datasets import ImageFolder
from torchvision.datasets.folder import IMG_EXTENSIONS

from visattn.train.datasets.image_files import load_image
from visattn.train.datasets.spec import SPLIT_SEED, VAL_FRACTION, DataError, DatasetSpec, DataSplits, split_off

_EVAL_FOLDERS = ("val", "validation", "test")


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
    # Normalized by the whole training split (validation included), as before the validation cut, so that
    # the recorded data config does not depend on it.
    mean = float(x_train.mean() / 16.0)
    std = float(x_train.std() / 16.0)
    train, validation = split_off(DigitsDataset(x_train, y_train), y_train, VAL_FRACTION)
    return DataSplits(
        train=train, val=validation, eval=DigitsDataset(x_eval, y_eval),
        num_classes=10, mean=(mean,) * 3, std=(std,) * 3, classes=tuple(str(digit) for digit in range(10)),
    )


def load_imagefolder_splits(data_dir: str, eval_fraction: float) -> DataSplits:
    """``data_dir/train`` + ``data_dir/{val,validation,test}``, or one folder split by ``eval_fraction``.

    With train/, val/ (or validation/) and test/ all there, val/ is the validation split and test/ the
    evaluated one; otherwise a fixed, stratified ``VAL_FRACTION`` of the training images is held out for
    validation.
    """
    root = Path(data_dir)
    if not root.is_dir():
        raise DataError(
            f"image folder {root} does not exist. --data-dir must hold one sub-folder of images per class "
            "(or train/ and val/ folders that each do)."
        )
    validation = None
    try:
        if (root / "train").is_dir():
            eval_dirs = [root / name for name in _EVAL_FOLDERS if (root / name).is_dir()]
            if not eval_dirs:
                raise DataError(f"{root} has train/ but no {', '.join(_EVAL_FOLDERS)} folder to evaluate on.")
            train = _image_folder(root / "train")
            if len(eval_dirs) > 1 and eval_dirs[-1].name == "test":
                validation, evaluation = _image_folder(eval_dirs[0]), _image_folder(eval_dirs[-1])
            else:
                evaluation = _image_folder(eval_dirs[0])
            for other in (evaluation, validation):
                if other is not None:
                    _check_same_classes(train, other)
            classes = train.classes
        else:
            full = _image_folder(root)
            train, evaluation = split_off(full, full.targets, eval_fraction)
            classes = full.classes
        if validation is None:
            train_labels = train.targets if isinstance(train, ImageFolder) else [full.targets[i] for i in train.indices]
            train, validation = split_off(train, train_labels, VAL_FRACTION)
    except (FileNotFoundError, ValueError) as error:  # ImageFolder: no class folders
        raise DataError(f"cannot read image folder {root}: {error}") from None
    return DataSplits(
        train=train, eval=evaluation, val=validation, num_classes=len(classes), mean=IMAGENET_DEFAULT_MEAN,
        std=IMAGENET_DEFAULT_STD, classes=tuple(classes),
    )


def _image_folder(folder: Path) -> ImageFolder:
    """The ImageFolder of ``folder``, read by :func:`load_image`; DataError naming every class folder that
    holds no image file (torchvision's own error names the class, not the folder)."""
    dataset = ImageFolder(str(folder), loader=load_image, allow_empty=True)
    filled = set(dataset.targets)
    empty = [str(folder / name) for index, name in enumerate(dataset.classes) if index not in filled]
    if empty:
        raise DataError(
            f"class folder(s) without an image file ({', '.join(IMG_EXTENSIONS)}): {', '.join(empty)}. "
            "Add images or remove the folder(s)"
        )
    return dataset


def _check_same_classes(train: ImageFolder, other: ImageFolder) -> None:
    """DataError naming the class folders that only one of ``train`` and ``other`` has."""
    if other.classes == train.classes:
        return
    only = [
        f"only in {dataset.root}: {', '.join(sorted(set(dataset.classes) - set(rest.classes)))}"
        for dataset, rest in ((train, other), (other, train)) if set(dataset.classes) - set(rest.classes)
    ]
    raise DataError(f"{train.root} and {other.root} do not have the same class folders ({'; '.join(only)})")


SPECS = (
    DatasetSpec(
        name="digits", title="scikit-learn digits", reader="sklearn.datasets.load_digits", default_img_size=16,
        official_splits="none (1,797 images; a stratified eval_fraction is held out, then validation from train)",
        load=lambda source: load_digits_splits(source.eval_fraction),
    ),
    DatasetSpec(
        name="imagefolder", title="image folder", reader="torchvision.datasets.ImageFolder", default_img_size=512,
        official_splits=(
            "train/ + val/ or test/ (with both, val/ validates and test/ is evaluated), "
            "or one folder (a stratified eval_fraction is held out); validation cut from train unless val/ and test/ both exist"
        ),
        load=lambda source: load_imagefolder_splits(str(source.root), source.eval_fraction),
    ),
)

