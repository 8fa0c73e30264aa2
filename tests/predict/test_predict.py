"""visattn.predict on a tiny trained run: what model.json records, predictions against the model itself,
folders, unreadable files, JSON output, bad run directories, runs written before the data config, and tiled
prediction against visattn.tiled.TiledViT."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision.transforms as T
import yaml
from PIL import Image
from safetensors.torch import load_file

from tests.helpers import load_script
from tests.train.test_train import ENV, REPO, TINY, _image_folder, train
from visattn.predict import Tiling, find_images, load_predictor, load_trained_model, predict, read_model_file
from visattn.predict.cli import main as predict_main
from visattn.tiled import TiledViT
from visattn.train.config import TrainConfig
from visattn.train.data import DataSplits, build_transform, eval_data_config, load_splits

DIGIT_NAMES = [str(digit) for digit in range(10)]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One epoch of the tiny digits recipe (axial attention, 16x16 images, patch 4)."""
    run_dir = tmp_path_factory.mktemp("predict") / "run"
    assert train.main([*TINY, "--epochs", "1", "--warmup-epochs", "0", "--run-dir", str(run_dir)]) == 0
    return run_dir


@pytest.fixture(scope="module")
def run_config(tiny_run: Path) -> TrainConfig:
    return TrainConfig(**yaml.safe_load((tiny_run / "config.yaml").read_text()))


@pytest.fixture(scope="module")
def digit_files(tmp_path_factory: pytest.TempPathFactory, run_config: TrainConfig) -> list[Path]:
    """The first six evaluation digits as PNG (lossless) and JPEG files, with their class in the name."""
    folder = tmp_path_factory.mktemp("digits")
    evaluation = load_splits(run_config).eval
    files = []
    for index in range(6):
        image, label = evaluation[index]
        path = folder / f"{index}_{label}.{'png' if index % 2 == 0 else 'jpg'}"
        image.save(path)
        files.append(path)
    return files


def reference_probabilities(run_dir: Path, path: Path) -> torch.Tensor:
    """(num_classes,) softmax of the run's best model on the image at ``path``, transformed by hand with
    torchvision from the numbers in model.json (timm's eval transform at crop_pct 1.0 of a square image)."""
    data_config = read_model_file(run_dir)["data_config"]
    _, height, width = data_config["input_size"]
    assert height == width and data_config["crop_pct"] == 1.0 and data_config["interpolation"] == "bicubic"
    transform = T.Compose([
        T.Resize(height, interpolation=T.InterpolationMode.BICUBIC), T.CenterCrop(height), T.ToTensor(),
        T.Normalize(data_config["mean"], data_config["std"]),
    ])
    model = load_trained_model(run_dir)
    with torch.no_grad():
        return model(transform(Image.open(path).convert("RGB"))[None]).softmax(-1)[0]


# -- what the run directory records ---------------------------------------------------------------
def test_model_json_records_the_evaluation_transform_and_class_names(tiny_run, run_config):
    info = read_model_file(tiny_run)
    splits = load_splits(run_config)
    expected = json.loads(json.dumps(eval_data_config(run_config, splits)))
    assert info["data_config"] == expected
    assert info["data_config"]["input_size"] == [3, 16, 16] and info["data_config"]["mean"] == list(splits.mean)
    assert info["class_names"] == DIGIT_NAMES

    predictor = load_predictor(tiny_run, device="cpu")
    assert predictor.class_names == tuple(DIGIT_NAMES)
    assert predictor.model.pretrained_cfg["label_names"] == tuple(DIGIT_NAMES)
    # The predictor's transform is the one evaluation used, to the bit.
    evaluation_transform = build_transform(run_config, splits, training=False)
    for index in range(3):
        image, _ = splits.eval[index]
        assert torch.equal(predictor.transform(image), evaluation_transform(image))


def test_image_folder_class_names_are_the_folder_names(tmp_path):
    config = TrainConfig(dataset="imagefolder", data_dir=str(_image_folder(tmp_path, "flat")), img_size=16, patch_size=4)
    assert load_splits(config).classes == ("cats", "dogs", "owls")
    with pytest.raises(ValueError, match="2 class names for 3 classes"):
        DataSplits(train=[], eval=[], num_classes=3, mean=(0.5,) * 3, std=(0.5,) * 3, classes=("a", "b"))


# -- predictions ----------------------------------------------------------------------------------
def test_top_k_is_the_models_own_ranking_of_the_transformed_image(tiny_run, digit_files):
    results = predict(load_predictor(tiny_run, device="cpu"), digit_files, top_k=4, batch_size=4)
    assert [result.path for result in results] == [str(path) for path in digit_files]
    for path, result in zip(digit_files, results):
        expected = reference_probabilities(tiny_run, path)
        assert result.error is None and len(result.top_k) == 4
        names = [name for name, _ in result.top_k]
        probabilities = [probability for _, probability in result.top_k]
        assert names[0] == str(expected.argmax().item())
        assert names == [str(index) for index in expected.argsort(descending=True)[:4].tolist()]
        assert probabilities == sorted(probabilities, reverse=True) and sum(probabilities) <= 1 + 1e-6
        assert probabilities == pytest.approx(expected.sort(descending=True).values[:4].tolist(), abs=1e-5)


def test_predictions_of_the_evaluation_images_on_disk_reproduce_the_run_accuracy(tiny_run, run_config, tmp_path):
    evaluation = load_splits(run_config).eval
    labels = []
    for index in range(len(evaluation)):
        image, label = evaluation[index]
        (tmp_path / str(label)).mkdir(exist_ok=True)
        image.save(tmp_path / str(label) / f"{index}.png")
        labels.append(label)
    files, problems = find_images([tmp_path])
    assert len(files) == len(evaluation) == 50 and problems == []
    results = predict(load_predictor(tiny_run, "best", device="cpu"), files, top_k=1, batch_size=16)
    correct = sum(result.top_k[0][0] == Path(result.path).parent.name for result in results)
    summary = json.loads((tiny_run / "summary.json").read_text())
    assert correct / len(files) == pytest.approx(summary["test_acc"], abs=1e-9)


def test_a_conv_stem_run_predicts_its_own_test_accuracy(tmp_path):
    """The stem's batch norms are rebuilt from model.json and run in eval mode with their running statistics."""
    run_dir = tmp_path / "conv"
    assert train.main([*TINY, "--stem", "conv", "--epochs", "1", "--warmup-epochs", "0", "--run-dir", str(run_dir)]) == 0
    config = TrainConfig(**yaml.safe_load((run_dir / "config.yaml").read_text()))
    assert read_model_file(run_dir)["kwargs"]["stem"] == "conv"
    evaluation = load_splits(config).eval
    images, labels = zip(*(evaluation[index] for index in range(len(evaluation))))
    results = predict(load_predictor(run_dir, "best", device="cpu"), list(images), top_k=1, batch_size=16)
    correct = sum(result.top_k[0][0] == str(label) for result, label in zip(results, labels))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert correct / len(images) == pytest.approx(summary["test_acc"], abs=1e-9)


def test_a_bare_model_and_in_memory_images_give_the_same_results(tiny_run, digit_files):
    predictor = load_predictor(tiny_run, device="cpu")
    from_files = predict(predictor, digit_files, top_k=3)
    from_model = predict(load_trained_model(tiny_run), [Image.open(path) for path in digit_files], top_k=3, batch_size=1)
    for by_path, in_memory in zip(from_files, from_model):
        assert in_memory.path is None
        assert [name for name, _ in in_memory.top_k] == [name for name, _ in by_path.top_k]
        assert [p for _, p in in_memory.top_k] == pytest.approx([p for _, p in by_path.top_k], abs=1e-6)
    everything = predict(predictor, digit_files[:1], top_k=100)[0]
    assert sorted(name for name, _ in everything.top_k) == DIGIT_NAMES
    assert sum(p for _, p in everything.top_k) == pytest.approx(1.0, abs=1e-5)
    with pytest.raises(ValueError, match="top_k must be at least 1"):
        predict(predictor, digit_files, top_k=0)


def test_a_folder_is_walked_for_image_files_in_sorted_order(digit_files, tmp_path):
    (tmp_path / "b" / "deeper").mkdir(parents=True)
    shutil.copy(digit_files[0], tmp_path / "b" / "deeper" / "x.PNG")
    shutil.copy(digit_files[1], tmp_path / "b" / "y.jpg")
    shutil.copy(digit_files[2], tmp_path / "a.png")
    (tmp_path / "notes.txt").write_text("not an image, not an image extension")
    (tmp_path / "empty").mkdir()
    files, problems = find_images([tmp_path, digit_files[3], tmp_path / "empty"])
    assert files == [str(tmp_path / "a.png"), str(tmp_path / "b" / "y.jpg"), str(tmp_path / "b" / "deeper" / "x.PNG"),
                     str(digit_files[3])]
    assert problems == [(str(tmp_path / "empty"), problems[0][1])] and "folder without image files" in problems[0][1]


# -- the command ----------------------------------------------------------------------------------
def _unreadable(folder: Path) -> dict[str, str]:
    """Three image-named files that cannot be read, and the reason each should be reported with."""
    (folder / "zero.png").write_bytes(b"")
    (folder / "text.png").write_text("hello, I am not a PNG")
    return {str(folder / "zero.png"): "empty file", str(folder / "text.png"): "not an image file",
            str(folder / "missing.jpg"): "no such file"}


def test_unreadable_files_are_reported_one_line_each_and_skipped(tiny_run, digit_files, tmp_path, capsys):
    bad = _unreadable(tmp_path)
    shutil.copy(digit_files[0], tmp_path / "good.png")
    code = predict_main([str(tiny_run), str(tmp_path), str(tmp_path / "missing.jpg"), str(digit_files[1]),
                         "--top-k", "3", "--device", "cpu"])
    out, err = capsys.readouterr()
    assert code == 0
    assert [line.split(": ")[0] for line in out.splitlines()] == [str(tmp_path / "good.png"), str(digit_files[1])]
    skipped = err.splitlines()
    assert len(skipped) == len(bad)
    for path, reason in bad.items():
        (line,) = [line for line in skipped if line.startswith(f"skipped {path}: ")]
        assert reason in line

    results = predict(load_predictor(tiny_run, device="cpu"), [tmp_path / "zero.png", digit_files[0], tmp_path / "text.png"])
    assert [bool(result.top_k) for result in results] == [False, True, False]
    assert "empty file" in results[0].error and results[1].error is None


def test_text_lines_hold_the_top_k_with_probabilities(tiny_run, digit_files, capsys):
    assert predict_main([str(tiny_run), *map(str, digit_files[:2]), "--top-k", "2", "--device", "cpu"]) == 0
    expected = predict(load_predictor(tiny_run, device="cpu"), digit_files[:2], top_k=2)
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"{r.path}: " + ", ".join(f"{name} {p:.3f}" for name, p in r.top_k) for r in expected]


def test_no_readable_image_is_exit_status_1(tiny_run, tmp_path, capsys):
    _unreadable(tmp_path)
    assert predict_main([str(tiny_run), str(tmp_path), "--device", "cpu"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines()[-1].startswith("error: no image could be read")


def test_json_output_is_one_document_matching_the_api(tiny_run, digit_files, tmp_path, capsys):
    (tmp_path / "zero.png").write_bytes(b"")
    args = [str(tiny_run), *map(str, digit_files), str(tmp_path / "zero.png"), "--json", "--top-k", "3", "--which", "last",
            "--batch-size", "2", "--device", "cpu"]
    assert predict_main(args) == 0
    document = json.loads(capsys.readouterr().out)
    expected = predict(load_predictor(tiny_run, "last", device="cpu"), digit_files, top_k=3)
    assert (document["weights"], document["device"]) == ("last", "cpu")
    assert document["data_config"]["input_size"] == [3, 16, 16]
    assert [p["path"] for p in document["predictions"]] == [r.path for r in expected]
    for entry, result in zip(document["predictions"], expected):
        assert [c["class_name"] for c in entry["top_k"]] == [name for name, _ in result.top_k]
        assert [c["probability"] for c in entry["top_k"]] == pytest.approx([p for _, p in result.top_k], abs=1e-6)
    assert document["skipped"] == [dict(path=str(tmp_path / "zero.png"), reason=document["skipped"][0]["reason"])]


def test_python_dash_m_runs_the_command(tiny_run, digit_files):
    result = subprocess.run(
        [sys.executable, "-m", "visattn.predict", str(tiny_run), str(digit_files[0]), "--top-k", "1", "--json"],
        cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout)["predictions"][0]["path"] == str(digit_files[0])


def test_the_console_script_is_declared():
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["visattn-predict"] == "visattn.predict.cli:main"


def _break(run_dir: Path, how: str) -> str:
    """Damage a copy of a run; the text the one-line error must name."""
    if how == "no directory":
        shutil.rmtree(run_dir)
        return "does not exist"
    if how == "no model.json":
        (run_dir / "model.json").unlink()
        return "model.json does not exist"
    if how == "model.json not JSON":
        (run_dir / "model.json").write_text("{not json")
        return "model.json is not valid JSON"
    if how == "model.json without kwargs":
        (run_dir / "model.json").write_text(json.dumps({"model": "visattn_vit_tiny_patch16"}))
        return "lacks 'kwargs'"
    if how == "weights cut short":
        weights = run_dir / "model_best.safetensors"
        weights.write_bytes(weights.read_bytes()[:500])
        return "model_best.safetensors: not a readable safetensors file (Error while deserializing header"
    if how == "weights of another model":
        info = read_model_file(run_dir)
        info["kwargs"]["embed_dim"] = 32
        (run_dir / "model.json").write_text(json.dumps(info))
        return "size mismatch for"
    (run_dir / "model_best.safetensors").unlink()
    return "model_best.safetensors does not exist"


@pytest.mark.parametrize("how", ["no directory", "no model.json", "model.json not JSON", "model.json without kwargs",
                                 "no weights", "weights cut short", "weights of another model"])
def test_a_bad_run_directory_is_one_line_naming_what_is_missing(how, tiny_run, digit_files, tmp_path, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(tiny_run, run_dir)
    expected = _break(run_dir, how)
    assert predict_main([str(run_dir), str(digit_files[0]), "--device", "cpu"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1
    assert err.startswith("error: ") and expected in err


@pytest.mark.parametrize("device, reason", [("foo", "is not a torch device"), ("cuda", "is not available here")])
def test_an_unknown_or_absent_device_is_one_line(device, reason, tiny_run, digit_files, capsys):
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    assert predict_main([str(tiny_run), str(digit_files[0]), "--device", device]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and f"device {device!r} {reason}; this machine has cpu" in err


# -- runs written before model.json held the data config --------------------------------------------
def test_a_run_without_data_config_or_class_names_still_loads_and_says_so(tiny_run, digit_files, tmp_path, capsys):
    run_dir = tmp_path / "old"
    shutil.copytree(tiny_run, run_dir)
    info = read_model_file(run_dir)
    (run_dir / "model.json").write_text(json.dumps({"model": info["model"], "kwargs": info["kwargs"]}))

    model = load_trained_model(run_dir)  # the model alone, as before, and no warning
    weights = load_file(str(run_dir / "model_best.safetensors"))
    assert all(torch.equal(model.state_dict()[key], weights[key]) for key in weights)

    with pytest.warns(UserWarning, match=r"has no data_config or class_names .* --resume` records them"):
        predictor = load_predictor(run_dir, device="cpu")
    assert predictor.class_names == tuple(DIGIT_NAMES)
    assert (predictor.data_config["input_size"], predictor.data_config["crop_pct"]) == ((3, 16, 16), 1.0)
    result = predict(predictor, digit_files[:1], top_k=2)[0]
    assert len(result.top_k) == 2 and result.error is None

    assert predict_main([str(run_dir), str(digit_files[0]), "--device", "cpu"]) == 0
    out, err = capsys.readouterr()
    assert len(out.splitlines()) == 1 and err.count("\n") == 1 and err.startswith("warning: ")


def test_the_digits_script_writes_the_evaluation_digits_as_an_image_folder(tmp_path, capsys):
    script = load_script("digits_images")
    assert script.main([str(tmp_path), "--count", "12"]) == 0
    files, _ = find_images([tmp_path])
    evaluation = load_splits(TrainConfig()).eval
    assert len(files) == 12
    for index in range(12):
        image, label = evaluation[index]
        written = Image.open(tmp_path / str(label) / f"{index:03d}.png").convert("RGB")
        assert written.tobytes() == image.tobytes()


# -- tiled prediction -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def large_digit_files(tmp_path_factory: pytest.TempPathFactory, digit_files: list[Path]) -> list[Path]:
    """Two images larger than the 16x16 the tiny run was trained at, made of its digits side by side: 40x56
    px, and 42x59 px (not a multiple of the patch, 4 px), both lossless PNG."""
    folder = tmp_path_factory.mktemp("large")
    files = []
    for name, (height, width) in (("a.png", (40, 56)), ("b.png", (42, 59))):
        canvas = Image.new("RGB", (width, height))
        for index, (top, left) in enumerate([(0, 0), (0, 20), (20, 8), (24, 40)]):
            canvas.paste(Image.open(digit_files[index]).convert("RGB"), (left, top))
        canvas.save(folder / name)
        files.append(folder / name)
    return files


def tiled_reference(run_dir: Path, path: Path, tile, overlap, merge: str) -> torch.Tensor:
    """(num_classes,) softmax of :class:`TiledViT` over the run's best model on the image at ``path``, normalised
    by hand with model.json's mean and std and cropped by hand to the patch (4 px) around its centre."""
    data_config = read_model_file(run_dir)["data_config"]
    pixels = torch.from_numpy(np.asarray(Image.open(path).convert("RGB"), dtype=np.float32) / 255).permute(2, 0, 1)
    mean, std = torch.tensor(data_config["mean"])[:, None, None], torch.tensor(data_config["std"])[:, None, None]
    height, width = pixels.shape[1] // 4 * 4, pixels.shape[2] // 4 * 4
    top, left = (pixels.shape[1] - height) // 2, (pixels.shape[2] - width) // 2
    image = ((pixels - mean) / std)[:, top:top + height, left:left + width]
    model = load_trained_model(run_dir, dynamic_img_size=tile != 16)
    with torch.no_grad():
        return TiledViT(model, tile, overlap, merge)(image[None]).softmax(-1)[0]


@pytest.mark.parametrize("tile_args, tile, overlap, merge", [
    (["--tile", "16", "--tile-overlap", "8"], 16, 8, "crop"),
    (["--tile", "24x32", "--tile-overlap", "8x4", "--tile-merge", "blend", "--batch-size", "2"], (24, 32), (8, 4), "blend"),
], ids=["tile16-overlap8-crop", "tile24x32-overlap8x4-blend"])
def test_tiled_prediction_is_the_tiled_models_own_ranking(tile_args, tile, overlap, merge, tiny_run, large_digit_files, capsys):
    args = [str(tiny_run), *map(str, large_digit_files), "--top-k", "10", "--json", "--device", "cpu", *tile_args]
    assert predict_main(args) == 0
    document = json.loads(capsys.readouterr().out)
    pair = (lambda value: [value, value] if isinstance(value, int) else list(value))
    assert document["tiling"] == dict(tile=pair(tile), overlap=pair(overlap), merge=merge)
    assert [entry["path"] for entry in document["predictions"]] == [str(path) for path in large_digit_files]
    for entry, path in zip(document["predictions"], large_digit_files):
        expected = tiled_reference(tiny_run, path, tile, overlap, merge)
        assert [c["class_name"] for c in entry["top_k"]] == [str(i) for i in expected.argsort(descending=True).tolist()]
        assert [c["probability"] for c in entry["top_k"]] == pytest.approx(expected.sort(descending=True).values.tolist(), abs=1e-6)
    # The Python API gives the same, and tiling differs from resizing the whole image.
    api = predict(load_predictor(tiny_run, device="cpu", dynamic_img_size=True), large_digit_files, top_k=10,
                  tiling=Tiling(tile, overlap, merge))
    for entry, result in zip(document["predictions"], api):
        assert [c["probability"] for c in entry["top_k"]] == pytest.approx([p for _, p in result.top_k], abs=1e-6)
    whole = predict(load_predictor(tiny_run, device="cpu"), large_digit_files, top_k=10)
    assert any(abs(a[1] - b[1]) > 1e-4 for r, w in zip(api, whole) for a, b in zip(r.top_k, w.top_k))


def test_an_image_smaller_than_the_tile_is_skipped_in_one_line(tiny_run, digit_files, large_digit_files, capsys):
    assert predict_main([str(tiny_run), str(digit_files[0]), str(large_digit_files[0]), "--tile", "24", "--device", "cpu"]) == 0
    out, err = capsys.readouterr()
    assert [line.split(": ")[0] for line in out.splitlines()] == [str(large_digit_files[0])]
    assert err == f"skipped {digit_files[0]}: image 8x8 px is smaller than the tile 24x24 px; use a smaller tile\n"


@pytest.mark.parametrize("tile_args, message", [
    (["--tile", "10"], "tile height must be a positive multiple of the patch size 4 px, got 10"),
    (["--tile", "16x0"], "tile width must be a positive multiple of the patch size 4 px, got 0"),
    (["--tile", "big"], "--tile must be N or HxW in pixels (non-negative integers), got 'big'"),
    (["--tile", "16", "--tile-overlap", "16"], "overlap height must be a multiple of the patch size 4 px in [0, tile height 16), got 16"),
    (["--tile", "16", "--tile-overlap", "6"], "overlap height must be a multiple of the patch size 4 px in [0, tile height 16), got 6"),
    (["--tile", "16", "--tile-overlap", "-4"], "--tile-overlap must be N or HxW in pixels (non-negative integers), got '-4'"),
    (["--tile", "16", "--tile-merge", "mean"], "--tile-merge must be one of crop, blend, got 'mean'"),
    (["--tile-overlap", "8"], "--tile-overlap need --tile N or HxW (tiled prediction)"),
], ids=["not-a-multiple", "zero", "not-a-size", "overlap-a-whole-tile", "overlap-not-a-multiple", "negative-overlap",
        "unknown-merge", "overlap-without-tile"])
def test_a_bad_tile_value_is_one_line_naming_the_accepted_ones(tile_args, message, tiny_run, large_digit_files, capsys):
    assert predict_main([str(tiny_run), str(large_digit_files[0]), "--device", "cpu", *tile_args]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"error: {message}\n"


def test_grid_change_script_reproduces_the_runs_accuracy_and_tries_a_larger_grid(tiny_run, capsys):
    """scripts/grid_change.py: at the run's own size, with the resampled (here: unchanged) position embedding,
    the accuracy train.py recorded for the best weights; a row at the new size; the mean embedding is flat."""
    module = load_script("grid_change")
    assert module.main([str(tiny_run), "--img-size", "32"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{tiny_run}: validation accuracy of its best weights")
    rows = [line for line in out.splitlines() if line.startswith("| 16 px") or line.startswith("| 32 px")]
    recorded = json.loads((tiny_run / "summary.json").read_text())["best_acc"]
    assert rows[0].startswith(f"| 16 px | 4×4 | {100 * recorded:.1f}% |") and rows[1].startswith("| 32 px | 8×8 |")
    model = load_trained_model(tiny_run)
    module.mean_position_embedding_(model)
    patches = model.pos_embed[0, model.num_prefix_tokens:]
    assert torch.equal(patches, patches[:1].expand_as(patches))

