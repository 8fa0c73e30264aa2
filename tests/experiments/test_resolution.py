"""visattn.experiments.resolution: a model trained at one size, tested whole and tiled at a larger one."""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

import train  # the script at the repository root, importable from there as pytest runs the tests
from visattn.experiments import larger_size, resolution, stages, summarize
from visattn.models import create_model
from visattn.predict import load_trained_model
from visattn.tiled import TiledViT
from visattn.train.config import make_config
from visattn.train.data import load_splits

from tests.helpers import TINY


def test_the_most_confident_tile_is_the_tile_with_the_top_probability():
    torch.manual_seed(0)
    model = create_model("visattn_vit_tiny_patch16", img_size=8, patch_size=4, embed_dim=16, depth=1, num_heads=2,
                         num_classes=5, attn="linear").eval()
    with torch.no_grad():
        model.head.weight.mul_(50)  # tiles' top probabilities far apart, so the choice is not a rounding tie
    # 8 px tiles of 16 x 20 px images: rows at 0 and 8; columns at 0, 8 and 12, the last moved back to the edge
    images = torch.randn(3, 3, 16, 20)
    with torch.no_grad():
        chosen = larger_size.MostConfidentTile(model, overlap=0)(images)
        for image, logits in zip(images, chosen):
            tiles = [image[:, top:top + 8, left:left + 8] for top in (0, 8) for left in (0, 8, 12)]
            each = model(torch.stack(tiles))  # (6, 5)
            top = each.softmax(dim=-1).amax(dim=-1)
            assert top.sort().values[-1] - top.sort().values[-2] > 1e-3
            torch.testing.assert_close(logits, each[top.argmax()], rtol=0, atol=1e-6)


@pytest.mark.slow
def test_at_its_own_size_every_column_is_the_runs_test_accuracy(tmp_path):
    # At the size it was trained at an image is one tile, the position embedding is not resampled and the
    # test split is the run's: every way of testing gives the accuracy train.py reported.
    first = tmp_path / "root" / "softmax+rope=axial" / "seed0-stage1"
    assert train.main([*TINY, "--max-train-samples", "640", "--epochs", "5", "--attn", "softmax", "--attn-kwargs", "rope=axial", "--run-dir", str(first)]) == 0
    output = tmp_path / "table.md"
    assert resolution.main(["--run-root", str(tmp_path / "root"), "--attn", "softmax:rope=axial", "--img-size", "16",
                            "--overlap", "0", "--batch-size", "16", "--output", str(output)]) == 0
    tested = json.loads(output.with_suffix(".json").read_text())["runs"][0]["accuracy"]
    reported = json.loads((first / "summary.json").read_text())["test_acc"]
    assert tested.pop("second stage") is None  # no second stage
    assert tested == {column: reported for column in tested}
    assert 0.2 < reported < 1, reported  # a trained model, so the columns could tell each other apart
    assert "| softmax (rope=axial) | 1 |" in output.read_text()


CLUTTERED = [
    "--dataset", "cluttered-digits", "--dataset-kwargs", "seed=0", "train_size=64", "val_size=20", "test_size=20",
    "digit_size=16", "clutter_size=6", "--patch-size", "4", "--embed-dim", "16", "--depth", "1", "--num-heads", "2",
    "--batch-size", "16", "--epochs", "1", "--warmup-epochs", "0",
]


@pytest.mark.slow
def test_each_column_tests_its_own_images_and_a_failing_column_is_reported(tmp_path, capsys, monkeypatch):
    # Two first stages at 32 px tested at 64 px. A linformer without ref_grid has projections for its own grid
    # only: it cannot be built at 64 px, but its tiles (of 32 px) run. The softmax has a second stage at 64 px.
    root, data = tmp_path / "root", ["--data-dir", str(tmp_path / "data")]
    assert train.main([*CLUTTERED, *data, "--img-size", "32", "--attn", "linformer",
                       "--run-dir", str(root / "linformer" / "seed0-stage1")]) == 0
    for size, run_dir, start in ((32, "seed0-stage1", []), (64, "seed0", ["--initial-checkpoint", str(root / "softmax" / "seed0-stage1")])):
        assert train.main([*CLUTTERED, *data, "--img-size", str(size), "--attn", "softmax",
                           "--run-dir", str(root / "softmax" / run_dir), *start]) == 0
    capsys.readouterr()
    output = tmp_path / "table.md"
    assert resolution.main(["--run-root", str(root), "--attn", "linformer", "softmax", "--img-size", "64",
                            "--overlap", "0", "16", "--output", str(output)]) == 1
    errors = capsys.readouterr().err.strip().splitlines()
    assert [line.split(":")[1].strip() for line in errors] == ["linformer seed 0, upsampled", "linformer seed 0, whole"]
    linformer, softmax = json.loads(output.with_suffix(".json").read_text())["runs"]
    assert set(linformer["errors"]) == {"upsampled", "whole"} and "size mismatch" in linformer["errors"]["whole"]
    assert "| linformer | 1 | " in output.read_text() and "| error | error |" in output.read_text()
    assert not softmax["errors"]

    # every column of the softmax, computed here from its own images and model (a model this small stays near
    # chance, so the columns may agree: which model and images each takes is checked below)
    stage = summarize.read_finished("softmax", 0, root / "softmax" / "seed0-stage1")
    upsampled = larger_size.split_images(stage, (32, 32), 64, {})
    larger = larger_size.split_images(stage, (64, 64), 64, {})
    whole, small = (load_trained_model(stage.run_dir, img_size=size) for size in (64, 32))
    expected = {
        "upsampled": larger_size.accuracy(whole, upsampled, 32),
        "whole": larger_size.accuracy(whole, larger, 32),
        "tiled, overlap 0 px": larger_size.accuracy(TiledViT(small, overlap=0), larger, 32),
        "tiled, overlap 16 px": larger_size.accuracy(TiledViT(small, overlap=16), larger, 32),
        "most confident tile": larger_size.accuracy(larger_size.MostConfidentTile(small, 16), larger, 32),
        "trained size": stage.summary["test_acc"],
        "second stage": json.loads((root / "softmax" / "seed0" / "summary.json").read_text())["test_acc"],
    }
    assert softmax["accuracy"] == expected

    tested = []

    def recorded(model, dataset, batch_size):
        tested.append((model, dataset))
        return 0.5

    monkeypatch.setattr(larger_size, "accuracy", recorded)
    cache = {}
    upsampled, larger = (larger_size.split_images(stage, drawn, 64, cache) for drawn in ((32, 32), (64, 64)))
    evaluation = larger_size.evaluate(stage, 64, [0, 16], "crop", 32, cache)
    assert list(evaluation.accuracy) == ["trained size", "upsampled", "whole", "tiled, overlap 0 px",
                                         "tiled, overlap 16 px", "most confident tile"]
    (up, up_images), (whole, whole_images), (tiled0, images0), (tiled16, images16), (best, best_images) = tested
    assert up_images is upsampled and all(images is larger for images in (whole_images, images0, images16, best_images))
    assert [type(model).__name__ for model in (up, whole, tiled0, tiled16, best)] == \
        ["VisionTransformer", "VisionTransformer", "TiledViT", "TiledViT", "MostConfidentTile"]
    assert up.patch_embed.img_size == whole.patch_embed.img_size == (64, 64)
    assert (tiled0.overlap, tiled16.overlap, best.overlap) == (0, 16, 16)
    assert tiled0.model.patch_embed.img_size == best.model.patch_embed.img_size == (32, 32)

    # the larger canvases are the dataset's at 64 px, normalized with the 32 px training split's statistics
    config = dataclasses.replace(stage.config, img_size=64)
    canvases = load_splits(config).eval
    assert len(larger) == len(canvases) == 20 and larger.tensors[0].shape == (20, 3, 64, 64)
    pixels = torch.from_numpy(np.asarray(canvases[0][0], dtype=np.float32) / 255).permute(2, 0, 1)
    mean, std = (torch.tensor(values)[:, None, None] for values in (stage.mean, stage.std))
    torch.testing.assert_close(larger.tensors[0][0], (pixels - mean) / std)
    assert tuple(load_splits(config).mean) != tuple(stage.mean)  # the larger canvases' own statistics are not the model's
    assert upsampled.tensors[0].shape == (20, 3, 64, 64) and not torch.equal(upsampled.tensors[0], larger.tensors[0])


def test_sizes_the_tiles_cannot_take_name_their_flag():
    stage = summarize.FinishedRun("linear", 0, Path("run"), make_config({"img_size": 32, "patch_size": 4}), {},
                                   (0.5, 0.5, 0.5), (0.2, 0.2, 0.2))
    larger_size.check_sizes(stage, 64, [0, 16, 28])
    for img_size, overlaps, message in [
        (16, [0], "--img-size: must be a multiple of the patch size (4 px) and at least the size run was trained at "
                  "(32x32 px), got 16"),
        (66, [0], "--img-size: must be a multiple of the patch size (4 px)"),
        (64, [0, 6], "--overlap: overlap height must be a multiple of the patch size 4 px"),
        (64, [32], "--overlap: overlap height must be a multiple of the patch size 4 px in [0, tile height 32)"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            larger_size.check_sizes(stage, img_size, overlaps)
    scaled_down = summarize.FinishedRun("linear", 0, Path("run"), make_config({
        "dataset": "cluttered-digits", "img_size": 64, "patch_size": 4, "dataset_kwargs": {"canvas_size": 128},
    }), {}, (0.5, 0.5, 0.5), (0.2, 0.2, 0.2))
    with pytest.raises(ValueError, match=re.escape("--run-root: run drew its images at canvas_size 128 px whatever "
                                                   "its img_size; the columns compare the sizes a generator draws at")):
        larger_size.check_sizes(scaled_down, 128, [0])


def test_a_missing_or_unfinished_run_is_one_line_naming_it(tmp_path, capsys):
    assert resolution.main(["--run-root", str(tmp_path), "--attn", "linear", "--img-size", "32",
                            "--output", str(tmp_path / "t.md")]) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and "linear/seed0-stage1/config.yaml does not exist" in error
    run_dir = tmp_path / "linear" / "seed0-stage1"
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text("attn: linear\n")  # a run that has not finished: no summary.json
    assert resolution.main(["--run-root", str(tmp_path), "--attn", "linear", "--img-size", "32",
                            "--output", str(tmp_path / "t.md")]) == 2
    assert "summary.json does not exist: not a finished training run" in capsys.readouterr().err


def test_a_curriculum_of_several_earlier_stages_is_refused_naming_them(tmp_path, capsys):
    for name in ("seed0-stage1", "seed0-stage2", "seed0-stage10", "seed0"):
        (tmp_path / "linear" / name).mkdir(parents=True)
    assert resolution.main(["--run-root", str(tmp_path), "--attn", "linear", "--img-size", "32",
                            "--output", str(tmp_path / "t.md")]) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0
    assert "holds seed0-stage2, seed0-stage10 beside seed0-stage1" in error
    assert "accepted: a table trained with one --stage" in error


def test_the_table_s_logs_beside_a_one_stage_curriculum_are_no_stages(tmp_path):
    for name in ("seed0-stage1", "seed0"):
        (tmp_path / "linear" / name).mkdir(parents=True)
    for log in ("seed0-stage1.log", "seed0-stage2.log", "seed0.log"):
        (tmp_path / "linear" / log).write_text("")
    assert stages.first_stage(tmp_path / "linear", 0) == tmp_path / "linear" / "seed0-stage1"


@pytest.mark.parametrize("flags, message", [
    (["--overlap", "-4"], "--overlap: pixels >= 0"),
    (["--img-size", "0"], "--img-size: must be >= 1"),
    (["--output", "t.txt"], "--output: a markdown file name"),
    (["--attn", "nosuch"], "unknown attention 'nosuch'"),
    (["--batch-size", "0"], "--batch-size: must be >= 1"),
    (["--overlap", "0", "0"], "--overlap: each value once"),
    (["--seeds", "1", "1"], "--seeds: each value once"),
])
def test_bad_flags_are_refused_by_name(flags, message, capsys):
    base = {"--run-root": ["r"], "--attn": ["linear"], "--img-size": ["32"]}
    base[flags[0]] = flags[1:]
    with pytest.raises(SystemExit):
        resolution.main([word for flag, values in base.items() for word in (flag, *values)])
    assert message in capsys.readouterr().err


def _finished_run(run_dir: Path, img_size: int, seed: int, test_acc: float, start: Path | None = None,
                  **config: object) -> Path:
    """The files the resolution table reads of a finished run (no weights: nothing is tested here); ``start``: the
    checkpoint it started from; ``config``: more fields of its config.yaml."""
    run_dir.mkdir(parents=True)
    fields = {"img_size": img_size, "patch_size": 4, "seed": seed, "run_dir": str(run_dir), **config}
    if start is not None:
        fields["initial_checkpoint"] = str(start)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(fields))
    (run_dir / "summary.json").write_text(json.dumps({"test_acc": test_acc}))
    (run_dir / "model.json").write_text(json.dumps({"model": "visattn_vit_tiny_patch16",
                                                    "kwargs": {"img_size": img_size, "num_classes": 2}}))
    return run_dir


def test_named_runs_are_rows_by_path_with_their_own_seed_and_the_second_stage_they_name(tmp_path):
    first = _finished_run(tmp_path / "pf32-linear", 32, seed=3, test_acc=0.8)
    second = _finished_run(tmp_path / "pf64-linear", 64, seed=3, test_acc=0.6, start=first)
    alone = _finished_run(tmp_path / "pf32-softmax", 32, seed=2, test_acc=0.7)
    found = stages.named_stages([(first, second), (alone, None)], img_size=64)
    assert [(stage.row, stage.seed, stage.second_stage) for stage in found] == [
        (str(first), 3, second), (str(alone), 2, None)]
    assert [stages.second_stage_accuracy(stage, 64) for stage in found] == [0.6, None]


def test_a_second_stage_starts_from_its_first_however_the_path_is_spelled(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first = _finished_run(tmp_path / "runs" / "pf32", 32, seed=0, test_acc=0.8)
    (tmp_path / "link").symlink_to(tmp_path / "runs")
    (first / "model_best.safetensors").write_bytes(b"")
    starts = [Path("runs/pf32"), Path("runs/pf32/"), first, Path("link/pf32"), first / "model_best.safetensors"]
    for number, start in enumerate(starts):
        second = _finished_run(tmp_path / f"second{number}", 64, seed=0, test_acc=0.6, start=start)
        for spelled in (first, Path("runs/pf32"), Path("link/pf32")):
            [stage] = stages.named_stages([(spelled, second)], img_size=64)
            assert stages.second_stage_accuracy(stage, 64) == 0.6, (start, spelled)


def test_a_renamed_first_is_found_by_the_folder_it_recorded_and_only_where_that_checkpoint_is_gone(tmp_path):
    trained_as = tmp_path / "pf32-old-name"
    first = _finished_run(trained_as, 32, seed=0, test_acc=0.8)
    second = _finished_run(tmp_path / "pf64", 64, seed=0, test_acc=0.6, start=trained_as)
    first = first.rename(tmp_path / "pf32")  # its config still records run_dir: .../pf32-old-name
    [stage] = stages.named_stages([(first, second)], img_size=64)
    assert stage.second_stage == second
    # another run now under the old name: the checkpoint exists, and it is not the first's
    _finished_run(trained_as, 32, seed=0, test_acc=0.5)
    with pytest.raises(ValueError, match=re.escape(f"--runs: {second} starts from {trained_as}, not from {first} or the "
                                                   f"folder it recorded as its run_dir ({trained_as}); accepted: a run "
                                                   f"trained with --initial-checkpoint {first}")):
        stages.named_stages([(first, second)], img_size=64)


def test_a_table_of_named_runs_has_a_row_and_the_seed_of_each_run(tmp_path, monkeypatch, capsys):
    first = _finished_run(tmp_path / "pf32-linear", 32, seed=3, test_acc=0.8)
    second = _finished_run(tmp_path / "pf64-linear", 64, seed=3, test_acc=0.6, start=first)
    alone = _finished_run(tmp_path / "pf32-softmax", 32, seed=2, test_acc=0.7)

    def evaluate(stage, img_size, overlaps, merge, batch_size, cache):  # every tested column at 50%
        evaluation = larger_size.Evaluation(stage.row, stage.seed, str(stage.run_dir), stage.config.image_hw)
        evaluation.accuracy = {larger_size.TRAINED: stage.summary["test_acc"], **dict.fromkeys(
            [larger_size.UPSAMPLED, larger_size.WHOLE, larger_size.tiled_column(0), larger_size.MOST_CONFIDENT], 0.5)}
        return evaluation

    monkeypatch.setattr(resolution, "evaluate", evaluate)
    output = tmp_path / "t.md"
    assert resolution.main(["--runs", f"{first}:{second}", str(alone), "--img-size", "64", "--output", str(output)]) == 0
    text = output.read_text()
    assert "one run per row" in text and "| run | seed |" in text
    assert f"| {first} | 3 | 80.00% | 50.00% | 50.00% | 50.00% | 50.00% | 60.00% |" in text
    assert f"| {alone} | 2 | 70.00% | 50.00% | 50.00% | 50.00% | 50.00% | – |" in text
    runs = json.loads(output.with_suffix(".json").read_text())["runs"]
    assert [(run["row"], run["seed"], run["accuracy"]["second stage"]) for run in runs] == [
        (str(first), 3, 0.6), (str(alone), 2, None)]


def test_a_named_second_stage_that_is_not_one_is_one_line_naming_it(tmp_path, capsys):
    first = _finished_run(tmp_path / "pf32-linear", 32, seed=0, test_acc=0.8)
    other_size = _finished_run(tmp_path / "pf48-linear", 48, seed=0, test_acc=0.6, start=first)
    scratch = _finished_run(tmp_path / "pf64-scratch", 64, seed=0, test_acc=0.6)
    elsewhere = _finished_run(tmp_path / "pf64-elsewhere", 64, seed=0, test_acc=0.6, start=other_size)
    other_model = _finished_run(tmp_path / "pf64-other", 64, seed=0, test_acc=0.6, start=first, patch_size=8, attn="linear")
    no_model_file = _finished_run(tmp_path / "pf64-no-model-file", 64, seed=0, test_acc=0.6, start=first)
    (no_model_file / "model.json").unlink()
    bad_config = _finished_run(tmp_path / "pf64-bad-config", 64, seed=0, test_acc=0.6, start=first)
    (bad_config / "config.yaml").write_text("img_size: 64\nno_such_option: 1\n")
    recorded = f"or the folder it recorded as its run_dir ({first})"
    for second, message in [
        (other_size, f"--runs: {other_size} was trained at 48x48 px, not at --img-size 64: not a second stage of {first}"),
        (scratch, f"--runs: {scratch} starts from no checkpoint, not from {first} {recorded}; accepted: a run trained "
                  f"with --initial-checkpoint {first}"),
        (elsewhere, f"--runs: {elsewhere} starts from {other_size}, not from {first} {recorded}"),
        (other_model, f"--runs: {other_model} differs from {first} in attn, patch_size; accepted: the same model and "
                      "data at another image size"),
        (tmp_path / "missing", f"--runs: second stage of {first}: {tmp_path / 'missing' / 'config.yaml'} does not exist: "
                               "not a finished training run"),
        (no_model_file, f"--runs: second stage of {first}: {no_model_file / 'model.json'} does not exist"),
        (bad_config, "no_such_option"),
    ]:
        assert resolution.main(["--runs", f"{first}:{second}", "--img-size", "64", "--output", str(tmp_path / "t.md")]) == 2
        error = capsys.readouterr().err.strip()
        assert error.count("\n") == 0 and message in error, error
    assert not (tmp_path / "t.md").exists()


@pytest.mark.parametrize("flags, message", [
    (["--runs", "a", "--attn", "linear"], "--attn: not with --runs (give one or the other)"),
    (["--runs", "a", "--run-root", "r"], "--run-root: not with --runs (give one or the other)"),
    (["--runs", "a", "--seeds", "0"], "--seeds: not with --runs (each run has the seed it was trained with)"),
    (["--runs", "a:"], "a run folder, or two joined by one ':' (FIRST:SECOND), got 'a:'"),
    (["--runs", "a:b:c"], "a run folder, or two joined by one ':' (FIRST:SECOND), got 'a:b:c'"),
    (["--runs", "a", f"{Path('a').resolve()}:b", "c"], f"--runs: a and {Path('a').resolve()} name the same run; accepted: "
                                                       "each run once, as a FIRST or as a SECOND"),
    (["--runs", "a:b", "c:b"], "--runs: b and b name the same run"),
    (["--runs", "a:c", "c"], "--runs: c and c name the same run"),
    (["--run-root", "r"], "either --run-root with --attn, or --runs"),
    ([], "either --run-root with --attn, or --runs"),
])
def test_named_runs_and_a_run_root_are_refused_together_by_name(flags, message, capsys):
    with pytest.raises(SystemExit):
        resolution.main([*flags, "--img-size", "64"])
    assert message in capsys.readouterr().err
