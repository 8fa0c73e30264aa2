"""Small fakes of the public datasets, written in each one's real on-disk layout, so that the tests load
them through the real torchvision classes without a network.

Every image of class ``c`` is filled with the colour ``CLASS_COLOURS[c]``, so a test can tell from the
pixels which label a file was read with. CIFAR, STL-10 and Flowers-102 check the md5 sums of their files
even without download (the other classes only check that their files and folders exist); a fake cannot
have the real sums, so :func:`make_fake` points the class's table of sums at the fake's files. Every other
check the class runs is the real one.
"""
from __future__ import annotations

import hashlib
import json
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from torchvision.datasets import CIFAR10, CIFAR100, STL10, Flowers102

# One colour per class of every fake; three classes each.
CLASS_COLOURS = ((220, 40, 40), (40, 200, 60), (50, 60, 230))


@dataclass(frozen=True)
class Fake:
    """What loading a fake must give: split sizes after the validation (and test) cuts, class names."""

    train: int
    val: int
    test: int
    classes: tuple[str, ...]


def md5_of(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def _image(label: int, size: tuple[int, int] = (24, 20)) -> Image.Image:
    """A (width, height) image of the class colour with a little noise (so JPEG has something to code)."""
    rng = np.random.default_rng(label)
    pixels = np.asarray(CLASS_COLOURS[label], dtype=np.int16) + rng.integers(-8, 9, (size[1], size[0], 3))
    return Image.fromarray(pixels.clip(0, 255).astype(np.uint8))


def _save_jpeg(path: Path, label: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    _image(label).save(path, format="JPEG", quality=95)


def _labels(per_class: int) -> list[int]:
    return [label for label in range(len(CLASS_COLOURS)) for _ in range(per_class)]


# -- CIFAR: pickled batches of (N, 3072) uint8 rows, md5-checked ---------------------------------------
def _cifar_rows(labels: list[int]) -> np.ndarray:
    return np.stack([np.asarray(_image(label, (32, 32))).transpose(2, 0, 1).reshape(-1) for label in labels])


def _pickle(path: Path, entry: dict) -> None:
    path.write_bytes(pickle.dumps(entry))


def _fake_cifar(root: Path, monkeypatch: pytest.MonkeyPatch, cls: type, label_key: str, names_key: str,
                names: tuple[str, ...]) -> Fake:
    folder = root / cls.base_folder
    folder.mkdir(parents=True)
    train_files = [name for name, _ in cls.train_list]
    per_file = max(1, 5 // len(train_files))  # five images per class in all
    for name in train_files:
        labels = _labels(per_file)
        _pickle(folder / name, {"data": _cifar_rows(labels), label_key: labels})
    (test_file, _), = cls.test_list
    _pickle(folder / test_file, {"data": _cifar_rows(_labels(2)), label_key: _labels(2)})
    _pickle(folder / cls.meta["filename"], {names_key: list(names)})
    monkeypatch.setattr(cls, "train_list", [[name, md5_of(folder / name)] for name in train_files])
    monkeypatch.setattr(cls, "test_list", [[test_file, md5_of(folder / test_file)]])
    monkeypatch.setattr(cls, "meta", {**cls.meta, "md5": md5_of(folder / cls.meta["filename"])})
    return Fake(train=12, val=3, test=6, classes=names)


def fake_cifar10(root: Path, monkeypatch: pytest.MonkeyPatch) -> Fake:
    return _fake_cifar(root, monkeypatch, CIFAR10, "labels", "label_names", ("airplane", "automobile", "bird"))


def fake_cifar100(root: Path, monkeypatch: pytest.MonkeyPatch) -> Fake:
    names = ("apple", "aquarium_fish", "baby")
    return _fake_cifar(root, monkeypatch, CIFAR100, "fine_labels", "fine_label_names", names)


# -- STL-10: raw uint8 arrays, (N, 3, 96, 96) stored column-major per image, md5-checked ---------------
def fake_stl10(root: Path, monkeypatch: pytest.MonkeyPatch) -> Fake:
    folder = root / STL10.base_folder
    folder.mkdir(parents=True)

    def write(stem: str, labels: list[int], with_labels: bool = True) -> None:
        images = np.stack([np.asarray(_image(label, (96, 96))).transpose(2, 1, 0) for label in labels])  # (N, C, W, H)
        (folder / f"{stem}_X.bin").write_bytes(images.astype(np.uint8).tobytes())
        if with_labels:
            (folder / f"{stem}_y.bin").write_bytes((np.asarray(labels) + 1).astype(np.uint8).tobytes())

    write("train", _labels(5))
    write("test", _labels(2))
    write("unlabeled", [0, 1], with_labels=False)
    names = ("airplane", "bird", "car")
    (folder / STL10.class_names_file).write_text("\n".join(names) + "\n")
    monkeypatch.setattr(STL10, "train_list", [[name, md5_of(folder / name)] for name, _ in STL10.train_list])
    monkeypatch.setattr(STL10, "test_list", [[name, md5_of(folder / name)] for name, _ in STL10.test_list])
    return Fake(train=12, val=3, test=6, classes=names)


# -- Oxford 102 Flowers: jpg/image_%05d.jpg, imagelabels.mat (1-based labels), setid.mat, md5-checked -------
def fake_flowers102(root: Path, monkeypatch: pytest.MonkeyPatch) -> Fake:
    from scipy.io import savemat

    folder = root / "flowers-102"
    split_labels = {"trnid": _labels(2), "valid": _labels(2), "tstid": _labels(3)}
    all_labels, set_ids = [], {}
    for key, labels in split_labels.items():
        set_ids[key] = np.arange(len(all_labels) + 1, len(all_labels) + len(labels) + 1)
        all_labels += labels
    for image_id, label in enumerate(all_labels, 1):
        _save_jpeg(folder / "jpg" / f"image_{image_id:05d}.jpg", label)
    savemat(folder / "imagelabels.mat", {"labels": np.asarray(all_labels) + 1})
    savemat(folder / "setid.mat", set_ids)
    monkeypatch.setattr(Flowers102, "_file_dict", {
        **Flowers102._file_dict,
        "label": ("imagelabels.mat", md5_of(folder / "imagelabels.mat")),
        "setid": ("setid.mat", md5_of(folder / "setid.mat")),
    })
    return Fake(train=6, val=6, test=9, classes=tuple(Flowers102.classes))


# -- Oxford-IIIT Pet: images/<Breed>_<n>.jpg, annotations/{trainval,test}.txt -------------------------
_PET_BREEDS = (("Abyssinian", 1), ("american_bulldog", 2), ("american_pit_bull_terrier", 2))  # (breed, species)


def fake_oxford_pets(root: Path, monkeypatch: pytest.MonkeyPatch) -> Fake:
    folder = root / "oxford-iiit-pet"
    (folder / "annotations").mkdir(parents=True)
    number = 0
    for split, per_class in (("trainval", 5), ("test", 2)):
        lines = []
        for label in _labels(per_class):
            number += 1
            breed, species = _PET_BREEDS[label]
            image_id = f"{breed}_{number}"
            _save_jpeg(folder / "images" / f"{image_id}.jpg", label)
            lines.append(f"{image_id} {label + 1} {species} {label + 1}")
        (folder / "annotations" / f"{split}.txt").write_text("\n".join(lines) + "\n")
    return Fake(train=12, val=3, test=6, classes=("Abyssinian", "American Bulldog", "American Pit Bull Terrier"))


# -- Food-101: images/<class>/<id>.jpg, meta/{train,test}.json, meta/classes.txt ---------------------------
def fake_food101(root: Path, monkeypatch: pytest.MonkeyPatch) -> Fake:
    folder = root / "food-101"
    names = ("apple_pie", "baby_back_ribs", "baklava")
    (folder / "meta").mkdir(parents=True)
    number = 1000
    for split, per_class in (("train", 5), ("test", 2)):
        listing: dict[str, list[str]] = {name: [] for name in names}
        for label in _labels(per_class):
            number += 1
            _save_jpeg(folder / "images" / names[label] / f"{number}.jpg", label)
            listing[names[label]].append(f"{names[label]}/{number}")
        (folder / "meta" / f"{split}.json").write_text(json.dumps(listing))
    (folder / "meta" / "classes.txt").write_text("\n".join(names) + "\n")
    return Fake(train=12, val=3, test=6, classes=names)


# -- EuroSAT (RGB): eurosat/2750/<Class>/<Class>_<n>.jpg, no official split -------------------------------
def fake_eurosat(root: Path, monkeypatch: pytest.MonkeyPatch) -> Fake:
    names = ("AnnualCrop", "Forest", "HerbaceousVegetation")
    for number, label in enumerate(_labels(10), 1):
        _save_jpeg(root / "eurosat" / "2750" / names[label] / f"{names[label]}_{number}.jpg", label)
    # 30 images: 6 held out for test (eval_fraction 0.2), then 3 of the other 24 for validation
    return Fake(train=21, val=3, test=6, classes=names)


# -- Imagenette: imagenette2[-160|-320]/{train,val}/<wnid>/<name>.JPEG ---------------------------------
_IMAGENETTE_WNIDS = ("n01440764", "n02102040", "n02979186")


def _fake_imagenette(root: Path, folder_name: str) -> Fake:
    for split, per_class in (("train", 5), ("val", 2)):
        for number, label in enumerate(_labels(per_class)):
            wnid = _IMAGENETTE_WNIDS[label]
            _save_jpeg(root / folder_name / split / wnid / f"{wnid}_{number}.JPEG", label)
    return Fake(train=12, val=3, test=6, classes=("tench", "English springer", "cassette player"))


def fake_imagenette(root: Path, monkeypatch: pytest.MonkeyPatch) -> Fake:
    return _fake_imagenette(root, "imagenette2-320")


def fake_imagenette_160(root: Path, monkeypatch: pytest.MonkeyPatch) -> Fake:
    return _fake_imagenette(root, "imagenette2-160")


def fake_imagenette_full(root: Path, monkeypatch: pytest.MonkeyPatch) -> Fake:
    return _fake_imagenette(root, "imagenette2")


FAKES: dict[str, Callable[[Path, pytest.MonkeyPatch], Fake]] = {
    "cifar10": fake_cifar10,
    "cifar100": fake_cifar100,
    "stl10": fake_stl10,
    "flowers102": fake_flowers102,
    "oxford_pets": fake_oxford_pets,
    "food101": fake_food101,
    "eurosat": fake_eurosat,
    "imagenette": fake_imagenette,
    "imagenette-160": fake_imagenette_160,
    "imagenette-full": fake_imagenette_full,
}


def make_fake(name: str, root: Path, monkeypatch: pytest.MonkeyPatch) -> Fake:
    """Write the fake of dataset ``name`` under ``root``, as its download would leave it."""
    return FAKES[name](root, monkeypatch)
