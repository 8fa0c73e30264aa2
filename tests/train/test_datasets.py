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
from tests.train.fake_datasets import CLASS_COLOURS, FAKES, make_fake
from visattn.models import create_model
from visattn.train.attention import resolve_attention
from visattn.train.cli import parse_args
from visattn.train.config import DATASETS, make_config
from visattn.train.data import DataError, TransformedDataset, build_transform, load_splits
from visattn.train.datasets import DATASET_SPECS
from visattn.train.datasets.public import READERS

REPO = Path(__file__).resolve().parents[2]
PUBLIC = sorted(READERS)
# Attention types whose cost grows (near) linearly with the number of tokens.
LINEAR_TIME = {"linear", "axial", "neighborhood", "longformer", "linformer", "sparse", "floor"}


def _colour_class(image) -> int:
    """The class whose fake colour is nearest the mean colour of ``image`` (PIL)."""
    mean = np.asarray(image.convert("RGB"), dtype=np.float64).reshape(-1, 3).mean(0)
    return int(np.argmin([np.abs(mean - colour).sum() for colour in CLASS_COLOURS]))


# Recipes named for what they are rather than for their dataset; the others are configs/<dataset>.yaml.
RENAMED_RECIPES = {
    "cifar10": "cifar10-pixels-1024tok", "cifar100": "cifar100-pixels-1024tok", "imagenette-full": "imagenette-448",
}


def recipe_file(dataset: str) -> str:
    return f"configs/{RENAMED_RECIPES.get(dataset, dataset)}.yaml"


def test_every_dataset_name_comes_from_the_registry_and_has_a_fake_and_a_recipe():
    assert DATASETS == tuple(DATASET_SPECS)
    assert set(PUBLIC) == set(FAKES)
    assert {"cifar10", "cifar100", "stl10", "flowers102", "oxford_pets", "food101", "eurosat", "imagenette",
            "imagefolder", "digits"} <= set(DATASETS)
    for name, spec in DATASET_SPECS.items():
        assert spec.recipe_file == recipe_file(name) and (REPO / spec.recipe_file).is_file(), name
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


@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to download fails the test."""
    import urllib.request

    def refuse(*args, **kwargs):
        raise AssertionError(f"network access: {args[:1]}")

    monkeypatch.setattr(urllib.request, "urlopen", refuse)


def _files(root: Path) -> list[str]:
    return sorted(str(path.relative_to(root)) for path in root.rglob("*"))


@pytest.mark.parametrize("name", PUBLIC)
def test_a_missing_dataset_is_one_line_with_the_command_that_fetches_it(name, tmp_path, no_network):
    config = make_config({"dataset": name, "data_dir": str(tmp_path)})
    with pytest.raises(DataError) as caught:
        load_splits(config)
    message = str(caught.value)
    assert "\n" not in message and "was not found" in message
    assert message.endswith(f": python train.py --config {recipe_file(name)} --data-dir {tmp_path} --download")
    assert _files(tmp_path) == []


# A file or folder each torchvision class needs, removed to damage a fake.
DAMAGE = {
    "cifar10": "cifar-10-batches-py/test_batch",
    "cifar100": "cifar-100-python/meta",
    "stl10": "stl10_binary/test_y.bin",
    "flowers102": "flowers-102/setid.mat",
    "oxford_pets": "oxford-iiit-pet/annotations/test.txt",
    "food101": "food-101/meta/test.json",
    "eurosat": "eurosat/2750",
    "imagenette": "imagenette2-320/val",
    "imagenette-160": "imagenette2-160/train",
    "imagenette-full": "imagenette2/val",
}


@pytest.mark.parametrize("name", PUBLIC)
def test_a_damaged_dataset_is_one_line_and_is_left_as_it_is(name, tmp_path, monkeypatch, no_network):
    import shutil

    make_fake(name, tmp_path, monkeypatch)
    damaged = tmp_path / DAMAGE[name]
    shutil.rmtree(damaged) if damaged.is_dir() else damaged.unlink()
    before = _files(tmp_path)
    with pytest.raises(DataError) as caught:
        load_splits(make_config({"dataset": name, "data_dir": str(tmp_path)}))
    message = str(caught.value)
    assert "\n" not in message and "is incomplete or corrupted" in message
    assert message.endswith(f"again: python train.py --config {recipe_file(name)} --data-dir {tmp_path} --download")
    assert _files(tmp_path) == before


def test_download_fetches_through_torchvision_only_when_asked(tmp_path, monkeypatch):
    import torchvision.datasets.imagenette as imagenette_module

    fetched = []

    def fake_download(url, download_root, md5=None, **kwargs):
        fetched.append((url, md5))
        make_fake("imagenette", Path(download_root), monkeypatch)

    monkeypatch.setattr(imagenette_module, "download_and_extract_archive", fake_download)
    config = make_config({"dataset": "imagenette", "data_dir": str(tmp_path)})
    with pytest.raises(DataError, match="--download"):
        load_splits(config)
    assert fetched == []
    splits = load_splits(config, download=True)
    assert fetched == [("https://s3.amazonaws.com/fast-ai-imageclas/imagenette2-320.tgz",
                        "3df6f0d01a2c9592104656642f5e78a3")]
    assert (len(splits.train), len(splits.val), len(splits.eval)) == (12, 3, 6)
    load_splits(config, download=True)  # already there: nothing fetched again
    assert len(fetched) == 1


def test_the_validation_cut_is_fixed_stratified_and_disjoint_from_train(tmp_path, monkeypatch):
    make_fake("eurosat", tmp_path, monkeypatch)
    config = make_config({"dataset": "eurosat", "data_dir": str(tmp_path)})
    first, again = load_splits(config), load_splits(config)
    parts = (first.train.indices, first.val.indices, first.eval.indices)
    assert parts == (again.train.indices, again.val.indices, again.eval.indices)
    assert sorted(sum(map(list, parts), [])) == list(range(30))  # a partition of the 30 images
    for part, per_class in ((first.eval, 2), (first.val, 1)):
        assert np.bincount([part[i][1] for i in range(len(part))]).tolist() == [per_class] * 3


def _recipes() -> list[Path]:
    return sorted((REPO / "configs").glob("*.yaml"))


@pytest.mark.parametrize("recipe", _recipes(), ids=lambda path: path.stem)
def test_every_recipe_parses_and_its_model_builds(recipe):
    from_file, _, _ = parse_args(["--config", str(recipe)])
    config = make_config(from_file)
    resolve_attention(config)  # as train.py does: a recipe may key its attn_kwargs by type
    with torch.device("meta"):  # as train.py builds it: a named timm ViT is converted to the recipe's attention
        model = create_model(config.model, **config.model_kwargs_for_timm(num_classes=10))
    grid = tuple(model.patch_embed.grid_size)
    assert grid == (config.image_hw[0] // config.patch_size, config.image_hw[1] // config.patch_size)
    dataset_recipes = {str(REPO / spec.recipe_file): name for name, spec in DATASET_SPECS.items()}
    if str(recipe) in dataset_recipes and recipe.stem != "digits":
        assert grid[0] >= 32 and grid[1] >= 32, f"{recipe.name}: grid {grid} is smaller than 32x32"
        assert config.attn in LINEAR_TIME, f"{recipe.name}: {config.attn} is not a linear-time attention"
        assert config.img_size == DATASET_SPECS[dataset_recipes[str(recipe)]].default_img_size


@pytest.mark.parametrize("recipe", _recipes(), ids=lambda path: path.stem)
def test_every_recipe_header_states_its_token_count_cost_and_reach(recipe):
    header = " ".join(line.lstrip("# ") for line in recipe.read_text().splitlines() if line.startswith("#"))
    config = make_config(parse_args(["--config", str(recipe)])[0])
    tokens = (config.image_hw[0] // config.patch_size) * (config.image_hw[1] // config.patch_size)
    assert f"{tokens:,} tokens" in header, f"{recipe.name}: header does not state its {tokens:,} tokens"
    assert "Cost:" in header and "Reached:" in header, f"{recipe.name}: header does not say what it costs and reaches"


def test_a_public_dataset_recipe_goes_past_1024_tokens_and_says_it_is_not_measured():
    recipe = REPO / "configs" / "imagenette-512-4096tok.yaml"
    config = make_config(parse_args(["--config", str(recipe)])[0])
    assert config.dataset in PUBLIC and (config.img_size, config.patch_size) == (512, 8)  # a 64x64 grid
    header = recipe.read_text()
    assert "4,096 tokens" in header and "GPU recipe, not measured" in header


def test_train_py_trains_an_epoch_on_a_fake_through_the_dataset_recipe(tmp_path, monkeypatch):
    import json

    data = tmp_path / "data"
    make_fake("imagenette", data, monkeypatch)
    run_dir = tmp_path / "run"
    command = [
        sys.executable, str(REPO / "train.py"), "--config", str(REPO / "configs" / "imagenette.yaml"),
        "--data-dir", str(data), "--run-dir", str(run_dir), "--img-size", "32", "--patch-size", "4",
        "--embed-dim", "16", "--depth", "1", "--num-heads", "2", "--epochs", "1", "--warmup-epochs", "0",
        "--batch-size", "4", "--num-workers", "0", "--mixed-precision", "no",
    ]
    env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["dataset"] == "imagenette" and summary["attn"] == "linear"
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert metrics[0]["train_images"] == 12  # 15 fake training images less 3 held out for validation
    assert round(summary["test_acc"] * 6, 6) == round(summary["test_acc"] * 6)  # over the 6 test images


def test_the_datasets_page_has_a_line_per_dataset_with_its_recipe_and_fetch_command():
    page = (REPO / "docs" / "datasets.md").read_text()
    for name, spec in DATASET_SPECS.items():
        (row,) = [line for line in page.splitlines() if line.startswith(f"| `{name}` |")]
        assert f"`{spec.reader}`" in row and f"{spec.default_img_size} px" in row and f"`{spec.recipe_file}`" in row
        if spec.download_size is not None:
            assert f"`{spec.fetch_command('DIR')}`" in row


def test_an_image_folder_with_train_val_and_test_folders_validates_on_val_and_evaluates_on_test(tmp_path):
    from PIL import Image

    for split, per_class in (("train", 4), ("val", 2), ("test", 3)):
        for label, name in enumerate(("cats", "dogs")):
            folder = tmp_path / split / name
            folder.mkdir(parents=True)
            for number in range(per_class):
                Image.new("RGB", (12, 10), CLASS_COLOURS[label]).save(folder / f"{number}.png")
    splits = load_splits(make_config({"dataset": "imagefolder", "data_dir": str(tmp_path)}))
    assert (len(splits.train), len(splits.val), len(splits.eval)) == (8, 4, 6)
    assert splits.classes == ("cats", "dogs") and Path(splits.eval.root).name == "test"
