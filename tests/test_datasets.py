"""Datasets by name: every public dataset loaded from a fake in its real on-disk layout through its real
torchvision class (split sizes, labels, class names, image size after the transform), the one-line
message with the fetch command when it is missing or damaged, --download never implied, and the
recipe of every dataset."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
from torch.utils.data import Subset

import visattn  # noqa: F401  (registers the visattn_vit_* models with timm)
from tests.fake_datasets import CLASS_COLOURS, FAKES, make_fake
from visattn.train.cli import parse_args
from visattn.train.config import DATASETS, TrainConfig, make_config
from visattn.train.data import DataError, TransformedDataset, build_transform, load_splits
from visattn.train.datasets import DATASET_SPECS
from visattn.train.datasets.public import READERS

REPO = Path(__file__).resolve().parents[1]
PUBLIC = sorted(READERS)
# Attention types whose cost grows (near) linearly with the number of tokens.
LINEAR_TIME = {"linear", "axial", "neighborhood", "longformer", "linformer", "sparse", "floor"}


def _colour_class(image) -> int:
    """The class whose fake colour is nearest the mean colour of ``image`` (PIL)."""
    mean = np.asarray(image.convert("RGB"), dtype=np.float64).reshape(-1, 3).mean(0)
    return int(np.argmin([np.abs(mean - colour).sum() for colour in CLASS_COLOURS]))


def test_every_dataset_name_comes_from_the_registry_and_has_a_fake_and_a_recipe():
    assert DATASETS == tuple(DATASET_SPECS)
    assert set(PUBLIC) == set(FAKES)
    assert {"cifar10", "cifar100", "stl10", "flowers102", "oxford_pets", "food101", "eurosat", "imagenette",
            "imagefolder", "digits"} <= set(DATASETS)
    for name, spec in DATASET_SPECS.items():
        assert (REPO / "configs" / f"{name}.yaml").is_file(), name
        assert make_config({"dataset": name, "data_dir": "x"}).img_size == spec.default_img_size


@pytest.mark.parametrize("name", PUBLIC)
def test_fake_loads_through_the_torchvision_class_with_official_splits(name, tmp_path, monkeypatch):
    fake = make_fake(name, tmp_path, monkeypatch)
    config = make_config({"dataset": name, "data_dir": str(tmp_path)})
    splits = load_splits(config)
    assert (len(splits.train), len(splits.val), len(splits.eval)) == (fake.train, fake.val, fake.test)
    assert splits.classes == fake.classes and splits.num_classes == len(fake.classes)
    assert config.image_hw == (DATASET_SPECS[name].default_img_size,) * 2
    for part in (splits.train, splits.val, splits.eval):
        for index in range(len(part)):
            image, label = part[index]
            assert _colour_class(image) == label, (name, index)
    # every class in validation, and no image both in train and in validation
    val_labels = [splits.val[i][1] for i in range(len(splits.val))]
    assert sorted(set(val_labels)) == [0, 1, 2]
    if isinstance(splits.val, Subset):
        assert not set(splits.val.indices) & set(splits.train.indices)
    for training, part in ((True, splits.train), (False, splits.eval)):
        tensor, _ = TransformedDataset(part, build_transform(config, splits, training), seed=0)[0]
        assert tensor.shape == (3, *config.image_hw)
