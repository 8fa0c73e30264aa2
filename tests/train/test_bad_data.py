"""Bad data in an ImageFolder: every file a run reads is checked before training and before the run directory
is touched; an unreadable one (truncated JPEG or PNG, zero bytes, not an image) is one line naming it, or with
--skip-bad-images is left out, counted and named at the end and in summary.json; grey, CMYK, 16-bit and tiny
images are read as 8-bit RGB; an empty class folder or class folders that differ between train/ and val/ are one
line; --overwrite with bad data leaves the previous run as it was."""
from __future__ import annotations

import io
import json
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from tests.train.fake_datasets import CLASS_COLOURS
import train  # the script at the repository root, importable from there as pytest runs the tests
from visattn.predict import read_image, to_rgb
from visattn.train import prepare
from visattn.train.config import make_config
from visattn.train.data import (
    DataError, ImageCheck, TransformedDataset, build_transform, check_images, load_splits, without_images,
)
from visattn.train.datasets import image_files
from visattn.train.datasets.image_files import BadImageError, check_image_files, image_samples, load_image

REPO = Path(__file__).resolve().parents[2]

CLASSES = ("cats", "dogs", "owls")
# A 1-block ViT of width 16 at 16x16 with 4x4 patches, one epoch: seconds on a CPU.
TINY = [
    "--dataset", "imagefolder", "--img-size", "16", "--patch-size", "4", "--embed-dim", "16", "--depth", "1",
    "--num-heads", "2", "--batch-size", "4", "--epochs", "1", "--warmup-epochs", "0", "--num-workers", "0",
]


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """The image check remembers files under $XDG_CACHE_HOME: here a folder of the test's own."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def _encoded(image: Image.Image, fmt: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **options)
    return buffer.getvalue()


def _noisy(label: int, size: tuple[int, int] = (24, 20), seed: int = 0) -> Image.Image:
    """A (width, height) RGB image of the class colour with a little noise."""
    rng = np.random.default_rng([label, seed])
    pixels = np.asarray(CLASS_COLOURS[label], dtype=np.int16) + rng.integers(-8, 9, (size[1], size[0], 3))
    return Image.fromarray(pixels.clip(0, 255).astype(np.uint8))


def image_folder(root: Path, train: int = 8, val: int = 3) -> Path:
    """train/ and val/ with ``train`` and ``val`` JPEGs per class of CLASSES."""
    for split, count in (("train", train), ("val", val)):
        for label, name in enumerate(CLASSES):
            folder = root / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for number in range(count):
                _noisy(label, seed=number).save(folder / f"{number}.jpg", quality=95)
    return root


# -- every kind of file ---------------------------------------------------------------------------
# Files that cannot be read: (bytes to write, what the one line must say is wrong).
UNREADABLE: dict[str, tuple[Callable[[], bytes], str]] = {
    "truncated.jpg": (lambda: _encoded(_noisy(0, (64, 48)), "JPEG", quality=95)[:900], "cannot decode: "),
    "truncated-tail.jpg": (lambda: _encoded(_noisy(0, (64, 48)), "JPEG", quality=95)[:-40], "cannot decode: "),
    "truncated.png": (lambda: _encoded(_noisy(1, (64, 48)), "PNG")[:700], "cannot decode: "),
    "zero-bytes.png": (lambda: b"", "not an image file Pillow can read (empty file)"),
    "notes.jpg": (lambda: b"a text file with an image extension\n", "not an image file Pillow can read"),
}
# Files that read: (image to write, format, the RGB pixel expected at (0, 0) after reading).
GREY_LEVEL, CMYK_CYAN, DEEP_LEVELS = 77, (255, 0, 0, 0), (0, 1000, 32896, 65535)
READABLE: dict[str, tuple[Callable[[], Image.Image], str, tuple[int, int, int]]] = {
    "grey.png": (lambda: Image.new("L", (5, 4), GREY_LEVEL), "PNG", (GREY_LEVEL,) * 3),
    "cmyk.jpg": (lambda: Image.new("CMYK", (16, 16), CMYK_CYAN), "JPEG", (0, 255, 255)),
    "16-bit.png": (lambda: Image.fromarray(np.full((4, 5), 32896, dtype=np.uint16)), "PNG", (128, 128, 128)),
    "1x1.png": (lambda: Image.new("RGB", (1, 1), CLASS_COLOURS[2]), "PNG", CLASS_COLOURS[2]),
    "3x2.jpg": (lambda: Image.new("RGB", (3, 2), CLASS_COLOURS[1]), "JPEG", CLASS_COLOURS[1]),
}


def write_unreadable(folder: Path, name: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_bytes(UNREADABLE[name][0]())
    return path


def write_readable(folder: Path, name: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    make, fmt, _ = READABLE[name]
    path = folder / name
    make().save(path, format=fmt, **({"quality": 95} if fmt == "JPEG" else {}))
    return path


@pytest.mark.parametrize("name", sorted(UNREADABLE))
def test_an_unreadable_file_is_one_line_naming_it_and_what_is_wrong(name, tmp_path):
    path = write_unreadable(tmp_path, name)
    expected = UNREADABLE[name][1]
    with pytest.raises(BadImageError) as caught:
        load_image(str(path))
    message = str(caught.value)
    assert message.startswith(f"{path}: {expected}") and "\n" not in message
    check = check_image_files([str(path)], tmp_path, threads=1)  # the check reads JPEGs in draft: same verdict
    assert list(check.unreadable) == [str(path)] and check.unreadable[str(path)].startswith(expected)


@pytest.mark.parametrize("name", sorted(READABLE))
def test_grey_cmyk_16_bit_and_tiny_images_are_read_as_8_bit_rgb(name, tmp_path):
    path = write_readable(tmp_path, name)
    image = load_image(str(path))
    assert image.mode == "RGB"
    pixels = np.asarray(image).astype(int)  # (H, W, 3)
    assert np.abs(pixels[0, 0] - READABLE[name][2]).max() <= 2  # JPEG rounds a level or two
    assert check_image_files([str(path)], tmp_path, threads=1).unreadable == {}


def test_16_bit_grey_levels_are_scaled_to_8_bits_not_clipped_to_white(tmp_path):
    """Pillow's own conversion of 16-bit grey (mode I;16) to RGB clips every level above 255: all but black
    turns white. Read here: level * 255 / 65535, rounded, for I;16 from a PNG and the other 16-bit modes."""
    levels = np.array([DEEP_LEVELS, (257, 12850, 51400, 65000)], dtype=np.uint16)  # (2, 4)
    expected = np.rint(levels * (255 / 65535)).astype(np.uint8)
    assert expected.tolist() == [[0, 4, 128, 255], [1, 50, 200, 253]]
    Image.fromarray(levels).save(tmp_path / "deep.png")
    assert Image.open(tmp_path / "deep.png").mode == "I;16"
    assert np.asarray(Image.open(tmp_path / "deep.png").convert("RGB"))[0, 1:].tolist() == [[255] * 3] * 3  # Pillow clips
    read = np.asarray(read_image(tmp_path / "deep.png"))  # (2, 4, 3)
    assert (read == expected[..., None]).all()
    for mode, dtype in (("I;16", "<u2"), ("I;16B", ">u2"), ("I", "<i4")):
        image = Image.fromarray(levels.astype(dtype))
        assert image.mode == mode
        assert (np.asarray(to_rgb(image)) == expected[..., None]).all(), mode


def test_an_image_smaller_than_a_patch_is_resized_to_the_image_size_by_both_transforms(tmp_path):
    """A 1x1 and a 3x2 image (patch 4, image 16x16): both transforms give a full-size image of the colour."""
    root = image_folder(tmp_path / "data", train=2, val=1)
    tiny = [write_readable(root / "train" / "owls", "1x1.png"), write_readable(root / "train" / "dogs", "3x2.jpg")]
    config = make_config({"dataset": "imagefolder", "data_dir": str(root), "img_size": 16, "patch_size": 4})
    splits = load_splits(config)
    samples = image_samples(splits.train) + image_samples(splits.val)
    mean, std = torch.tensor(splits.mean)[:, None, None], torch.tensor(splits.std)[:, None, None]
    for path in map(str, tiny):
        part = splits.train if path in dict(image_samples(splits.train)) else splits.val
        index = [p for p, _ in image_samples(part)].index(path)
        colour = torch.tensor(READABLE[Path(path).name][2], dtype=torch.float32)[:, None, None] / 255
        for training in (True, False):
            tensor, label = TransformedDataset(part, build_transform(config, splits, training), seed=0)[index]
            assert tensor.shape == (3, 16, 16) and label == dict(samples)[path]
            assert torch.allclose(tensor * std + mean, colour.expand(3, 16, 16), atol=2 / 255), (path, training)


# -- the check before training ------------------------------------------------------------------
def bad_folder(root: Path) -> tuple[Path, dict[str, str]]:
    """An image folder holding every unreadable and every readable kind of file; the unreadable path -> the start
    of what the error must say is wrong."""
    image_folder(root)
    bad = {}
    for number, name in enumerate(sorted(UNREADABLE)):
        split = "val" if number == 0 else "train"
        path = write_unreadable(root / split / CLASSES[number % 3], name)
        bad[str(path)] = UNREADABLE[name][1]
    for number, name in enumerate(sorted(READABLE)):
        write_readable(root / "train" / CLASSES[number % 3], name)
    return root, bad


def test_unreadable_files_stop_the_run_before_training_with_one_line_naming_each(tmp_path, capsys):
    root, bad = bad_folder(tmp_path / "data")
    run_dir = tmp_path / "run"
    assert train.main([*TINY, "--data-dir", str(root), "--run-dir", str(run_dir)]) == 2
    out, err = capsys.readouterr()
    (line,) = err.splitlines()
    assert line.startswith(f"error: {len(bad)} image file(s) cannot be read: ")
    assert line.endswith(". Fix or remove them, or pass --skip-bad-images to train without them")
    for path, reason in bad.items():
        assert f"{path}: {reason}" in line
    assert "epoch" not in out and not run_dir.exists()


def test_skip_bad_images_leaves_them_out_and_names_them_at_the_start_the_end_and_in_the_summary(tmp_path, capsys):
    root, bad = bad_folder(tmp_path / "data")
    run_dir = tmp_path / "run"
    assert train.main([*TINY, "--data-dir", str(root), "--run-dir", str(run_dir), "--skip-bad-images"]) == 0
    out = capsys.readouterr().out
    files = sum(1 for path in root.rglob("*") if path.is_file())
    assert f"image files: {files} checked in " in out
    assert f"notice: left out (--skip-bad-images): {len(bad)} image file(s) cannot be read: " in out
    (last,) = [line for line in out.splitlines() if line.startswith("left out (--skip-bad-images): ")]
    assert last.endswith(f"; and {len(bad) - 3} more (all of them in summary.json)")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["skipped_images"] == len(bad)
    assert {path: reason[: len(bad[path])] for path, reason in summary["skipped_image_files"].items()} == bad
    assert summary["test_samples"] == len(CLASSES) * 3  # val/, the test split: its 9 images, not its unreadable file

    # the splits the run trained on, as load_data makes them: every other file, none of the unreadable ones
    config = make_config({"dataset": "imagefolder", "data_dir": str(root), "img_size": 16, "patch_size": 4})
    splits = load_splits(config)
    kept = without_images(splits, summary["skipped_image_files"])
    for before, after in ((splits.train, kept.train), (splits.val, kept.val), (splits.eval, kept.eval)):
        paths = [path for path, _ in image_samples(after)]
        assert set(paths) == {path for path, _ in image_samples(before)} - set(bad)
        for index in range(len(after)):
            assert after[index][0].mode == "RGB"


def test_leaving_out_every_image_of_a_class_or_a_split_is_one_line(tmp_path):
    root = image_folder(tmp_path / "data", train=3, val=1)
    splits = load_splits(make_config({"dataset": "imagefolder", "data_dir": str(root)}))
    owls = {path for path, label in image_samples(splits.train) if label == 2}
    with pytest.raises(DataError, match=r"^once the unreadable files are left out, class\(es\) owls have no training image$"):
        without_images(splits, owls)
    with pytest.raises(DataError, match=r"^the test split has no readable image left: none of its 3 files can be read$"):
        without_images(splits, {path for path, _ in image_samples(splits.eval)})


def test_the_check_decodes_only_what_changed_since_the_last_one(tmp_path, monkeypatch):
    root = image_folder(tmp_path / "data", train=4, val=2)
    config = make_config({"dataset": "imagefolder", "data_dir": str(root)})
    splits = load_splits(config)
    first = check_images(config, splits)
    assert (first.checked, first.decoded, first.unreadable) == (18, 18, {})
    again = check_images(config, splits)
    assert (again.checked, again.decoded, again.unreadable) == (18, 0, {})
    damaged = root / "train" / "dogs" / "1.jpg"
    damaged.write_bytes(damaged.read_bytes()[:300])  # another size: decoded again, and found
    third = check_images(config, splits)
    assert third.decoded == 1 and list(third.unreadable) == [str(damaged)]
    assert check_images(config, splits).decoded == 1  # an unreadable file is never remembered as read
    # a cache that cannot be written (its folder is a file) only means decoding everything each time
    monkeypatch.setenv("XDG_CACHE_HOME", str(damaged))
    assert [check_images(config, splits).decoded for _ in range(2)] == [18, 18]
    assert image_files.cache_file(root).parent.parent.parent == damaged


def test_a_file_damaged_after_the_check_is_one_line_naming_it_also_from_a_loader_worker(tmp_path, monkeypatch, capsys):
    root = image_folder(tmp_path / "data")
    path = write_unreadable(root / "val" / "dogs", "truncated.jpg")
    config = make_config({"dataset": "imagefolder", "data_dir": str(root), "img_size": 16, "patch_size": 4})
    splits = load_splits(config)
    index = [p for p, _ in image_samples(splits.eval)].index(str(path))
    loader = DataLoader(TransformedDataset(torch.utils.data.Subset(splits.eval, [index]), build_transform(config, splits, False), None),
                        num_workers=1)
    with pytest.raises(BadImageError) as caught:
        next(iter(loader))
    assert str(caught.value).startswith(f"{path}: cannot decode: ") and "\n" not in str(caught.value)

    # through train.py, as if the file had been damaged once the check had passed: the epoch's evaluation meets it
    monkeypatch.setattr(prepare, "load_data", lambda accelerator, config, download: (load_splits(config), ImageCheck()))
    assert train.main([*TINY, "--data-dir", str(root), "--run-dir", str(tmp_path / "run"), "--num-workers", "1"]) == 2
    assert error_line(capsys.readouterr().err).startswith(f"error: {path}: cannot decode: ")


def error_line(stderr: str) -> str:
    """The one error line among the progress bar's lines (which redraw after carriage returns); no traceback."""
    assert "Traceback" not in stderr
    errors = [line for line in stderr.replace("\r", "\n").splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, stderr[-3000:]
    return errors[0]


# -- classes ------------------------------------------------------------------------------------
def test_an_empty_class_folder_is_one_line_naming_it(tmp_path):
    root = image_folder(tmp_path / "data", train=2, val=1)
    (root / "train" / "bats").mkdir()
    (root / "train" / "bats" / "readme.txt").write_text("no image here")
    (root / "val" / "bats").mkdir()
    with pytest.raises(DataError) as caught:
        load_splits(make_config({"dataset": "imagefolder", "data_dir": str(root)}))
    message = str(caught.value)
    assert message.startswith("class folder(s) without an image file (.jpg, .jpeg, .png, ") and "\n" not in message
    assert message.endswith(f"): {root / 'train' / 'bats'}. Add images or remove the folder(s)")


def test_train_and_val_with_other_class_folders_is_one_line_naming_them(tmp_path):
    root = image_folder(tmp_path / "data", train=2, val=1)
    (root / "val" / "owls").rename(root / "val" / "bats")
    with pytest.raises(DataError) as caught:
        load_splits(make_config({"dataset": "imagefolder", "data_dir": str(root)}))
    assert str(caught.value) == (
        f"{root / 'train'} and {root / 'val'} do not have the same class folders "
        f"(only in {root / 'train'}: owls; only in {root / 'val'}: bats)"
    )


# -- --overwrite --------------------------------------------------------------------------------
def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(path.relative_to(folder)): (path.stat().st_size, path.stat().st_mtime_ns)
            for path in sorted(folder.rglob("*")) if path.is_file()}


def _unreadable_file(root: Path) -> str:
    write_unreadable(root / "train" / "cats", "truncated.jpg")
    return "1 image file(s) cannot be read"


def _empty_class(root: Path) -> str:
    for path in (root / "val" / "owls").iterdir():
        path.unlink()
    return "class folder(s) without an image file"


def _other_classes(root: Path) -> str:
    (root / "val" / "owls").rename(root / "val" / "bats")
    return "do not have the same class folders"


@pytest.fixture(scope="module")
def previous_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished run on a good image folder."""
    tmp = tmp_path_factory.mktemp("previous")
    run_dir = tmp / "run"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(tmp / "cache"))
        assert train.main([*TINY, "--data-dir", str(image_folder(tmp / "data")), "--run-dir", str(run_dir)]) == 0
    return run_dir


@pytest.mark.parametrize("damage", [_unreadable_file, _empty_class, _other_classes], ids=lambda f: f.__name__[1:])
def test_overwrite_with_bad_data_leaves_the_previous_run_as_it_was(damage, previous_run, tmp_path, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(previous_run, run_dir)  # modification times kept
    before = _snapshot(run_dir)
    assert "summary.json" in before and any(name.startswith("checkpoints/") for name in before)
    bad = image_folder(tmp_path / "bad")
    expected = damage(bad)
    capsys.readouterr()
    assert train.main([*TINY, "--data-dir", str(bad), "--run-dir", str(run_dir), "--overwrite"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: ") and expected in line
    assert _snapshot(run_dir) == before


# -- several processes --------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_two_processes_leave_out_the_same_files_the_main_process_found(tmp_path):
    """Only the main process checks; the other takes its findings. Were it to keep the unreadable files, its
    share of the batches would reach them and stop the run."""
    root, bad = bad_folder(tmp_path / "data")
    run_dir = tmp_path / "run"
    launcher = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
        "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(_free_port()),
    ]
    env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    command = [*launcher, str(REPO / "train.py"), *TINY, "--data-dir", str(root), "--run-dir", str(run_dir), "--skip-bad-images"]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["num_processes"] == 2 and set(summary["skipped_image_files"]) == set(bad)
