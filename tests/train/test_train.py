"""train.py end to end: a tiny run and its files, resume after SIGKILL, two processes vs one, and the
errors that must stop a run before it writes anything."""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
import yaml
from accelerate.utils import load as accelerate_load
from safetensors.torch import load_file
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import visattn
from tests.helpers import rms_rel_err
import train  # the script at the repository root, importable from there as pytest runs the tests
from visattn.models import create_model
from visattn.predict import load_trained_model
from visattn.train import build, data, loop, prepare
from visattn.train.cli import build_parser, parse_args
from visattn.train.config import ConfigError, TrainConfig, make_config, run_dir_of
from visattn.train.data import TransformedDataset, build_transform, load_splits

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "train.py"

# 96 train / 50 validation / 50 test digits at 16x16, patch 4 (4x4 grid): 6 steps of 16 per epoch.
TINY = [
    "--max-train-samples", "96", "--max-eval-samples", "50", "--img-size", "16", "--patch-size", "4",
    "--embed-dim", "16", "--depth", "2", "--num-heads", "2", "--batch-size", "16", "--epochs", "2",
    "--warmup-epochs", "1", "--attn", "axial",
]
# One thread per process: steadier on a shared CPU, and what two processes on two cores would use.
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def run_train(*args: str, launcher: list[str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    command = (launcher or [sys.executable]) + [str(TRAIN), *args]
    return subprocess.run(command, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=timeout)


def start_train(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(TRAIN), *args], cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    )


def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``folder`` with its size and modification time."""
    return {
        str(path.relative_to(folder)): (path.stat().st_size, path.stat().st_mtime_ns)
        for path in sorted(folder.rglob("*")) if path.is_file()
    }


def weights_of(run_dir: Path, which: str = "last") -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / f"model_{which}.safetensors"))


def assert_same_weights(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], tol: float) -> None:
    assert actual.keys() == expected.keys()
    for key in expected:
        err = rms_rel_err(actual[key], expected[key])
        assert err <= tol, f"{key}: RMS-relative difference {err:.3g} > {tol:.1g}"


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    run_dir = tmp_path_factory.mktemp("tiny") / "run"
    result = run_train(*TINY, "--run-dir", str(run_dir), "--save-every", "4", "--keep-checkpoints", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir, result


# -- a run and what it leaves behind ---------------------------------------------------------------
def test_tiny_run_writes_config_metrics_plot_and_checkpoints(tiny_run):
    run_dir, result = tiny_run
    assert "test accuracy:" in result.stdout
    assert "epoch 2/2" in result.stderr  # the progress bar

    saved = TrainConfig(**yaml.safe_load((run_dir / "config.yaml").read_text()))
    assert (saved.attn, saved.epochs, saved.embed_dim, saved.run_dir) == ("axial", 2, 16, str(run_dir))

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == [1, 2]
    for record in records:
        assert record["val_samples"] == 50 and record["train_images"] == 96
        assert record["images_per_s"] > 0 and record["peak_mem_mib"] > 0 and record["lr"] > 0
        assert record["images_per_s"] == record["train_images"] / record["train_time_s"] and record["eval_time_s"] > 0
        assert 0 <= record["val_acc"] <= 1 and record["train_loss"] > 0
        assert not any(key.startswith("test_") for key in record)  # the test split is not looked at every epoch
    assert (run_dir / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((run_dir / "summary.json").read_text())
    val_accs = [r["val_acc"] for r in records]
    assert summary["best_acc"] == max(val_accs) and summary["best_epoch"] == val_accs.index(max(val_accs)) + 1
    assert summary["selected_on"] == "val" and summary["test_samples"] == 50 and 0 <= summary["test_acc"] <= 1

    # updates 4 (mid-epoch 1), 6 (end of 1), 8 (mid-epoch 2), 12 (end of 2); the last two are kept
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert checkpoints == ["step_00000008", "step_00000012"]
    last = run_dir / "checkpoints" / "step_00000012"
    for name in ("model.safetensors", "optimizer.bin", "random_states_0.pkl", "trainer_state.json"):
        assert (last / name).is_file(), name
    state = json.loads((last / "trainer_state.json").read_text())
    assert (state["epoch"], state["batch"], state["update"]) == (2, 0, 12)
    # What resuming reads back needs no unpickling of arbitrary objects: torch's weights_only loader
    # (accelerate adds the NumPy array types of the RNG state and nothing else).
    assert "state" in torch.load(last / "optimizer.bin", weights_only=True)
    assert "torch_manual_seed" in accelerate_load(last / "random_states_0.pkl")
    mid = json.loads((run_dir / "checkpoints" / "step_00000008" / "trainer_state.json").read_text())
    assert (mid["epoch"], mid["batch"]) == (1, 2)


def test_saved_weights_load_with_timm_and_reproduce_the_test_accuracy(tiny_run):
    run_dir, _ = tiny_run
    info = json.loads((run_dir / "model.json").read_text())
    weights = run_dir / "model_last.safetensors"
    model = timm.create_model(
        info["model"], pretrained=True,
        pretrained_cfg_overlay=dict(file=str(weights), num_classes=info["kwargs"]["num_classes"]), **info["kwargs"],
    )
    expected = load_file(str(weights))
    assert_same_weights(model.state_dict(), expected, tol=0.0)

    model = load_trained_model(run_dir, "best")  # the test accuracy is of the weights chosen on validation
    config = TrainConfig(**yaml.safe_load((run_dir / "config.yaml").read_text()))
    splits = load_splits(config)
    dataset = TransformedDataset(splits.eval, build_transform(config, splits, training=False), seed=None)
    images = torch.stack([dataset[i][0] for i in range(len(dataset))])
    labels = torch.tensor([dataset[i][1] for i in range(len(dataset))])
    with torch.no_grad():
        accuracy = (model(images).argmax(-1) == labels).float().mean().item()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert accuracy == pytest.approx(summary["test_acc"], abs=1e-6)


# -- resume ----------------------------------------------------------------------------------------
def test_resume_after_sigkill_mid_epoch_matches_uninterrupted_run(tmp_path):
    # Everything random stays on: RandAugment, random crops, mixup, drop path; gradient accumulation too.
    recipe = [
        *TINY, "--epochs", "3", "--grad-accum-steps", "2", "--save-every", "2", "--auto-augment",
        "rand-m9-mstd0.5-inc1-mmax9", "--mixup", "0.8", "--cutmix", "1.0", "--drop-path-rate", "0.2",
    ]
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    uninterrupted = start_train(*recipe, "--run-dir", str(whole))
    victim = start_train(*recipe, "--run-dir", str(killed))
    first = killed / "checkpoints" / "step_00000002"  # update 2 = batch 4 of 6 in epoch 1
    deadline = time.monotonic() + 240
    while not first.exists() and victim.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    victim.send_signal(signal.SIGKILL)
    victim_log = victim.communicate()[0]
    assert victim.returncode == -signal.SIGKILL, f"the run ended before it could be killed:\n{victim_log[-2000:]}"
    assert uninterrupted.wait(timeout=300) == 0, uninterrupted.communicate()[0][-3000:]

    latest = sorted((killed / "checkpoints").glob("step_*"))[-1]
    position = json.loads((latest / "trainer_state.json").read_text())
    assert position["batch"] > 0, "the kill should leave a mid-epoch checkpoint to resume from"

    resumed = run_train(*recipe, "--run-dir", str(killed), "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {latest}" in resumed.stdout
    assert_same_weights(weights_of(killed), weights_of(whole), tol=0.0)
    assert_same_weights(weights_of(killed, "best"), weights_of(whole, "best"), tol=0.0)
    killed_metrics = [json.loads(line) for line in (killed / "metrics.jsonl").read_text().splitlines()]
    whole_metrics = [json.loads(line) for line in (whole / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in killed_metrics] == [1, 2, 3]
    for a, b in zip(killed_metrics, whole_metrics):
        assert a["val_acc"] == b["val_acc"] and a["train_images"] == b["train_images"]
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-5)


def test_resume_of_a_finished_run_changes_no_weights(tiny_run):
    run_dir, _ = tiny_run
    before = weights_of(run_dir)
    result = run_train(*TINY, "--run-dir", str(run_dir), "--resume")
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_weights(weights_of(run_dir), before, tol=0.0)


# -- two processes -----------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_processes_match_one_process_with_the_same_global_batch(tmp_path):
    # No random augmentation, dropout or mixup; the seeded sampler gives both the same data order.
    # Global batch 16 = 2 processes x 8 = 1 process x 8 x 2 accumulation steps, one thread each (ENV):
    # DDP's (g0 + g1) / 2 and accumulation's g0 / 2 + g1 / 2 are the same fp32 operations (halving is
    # exact, a + b == b + a), so the weights must be bit-identical. Not against one batch of 16: it sums
    # in another order (as does a second thread), and the key third of qkv.bias, whose exact gradient is 0
    # (softmax ignores a shift shared by all keys), is made of that rounding alone (AdamW steps of about
    # lr * g / eps, g ~ 3e-13): 100% apart between two orders, 1e-5 of the tensor's RMS.
    recipe = [*TINY, "--no-augment", "--drop-path-rate", "0", "--label-smoothing", "0.1", "--batch-size", "8"]
    one, two = tmp_path / "one", tmp_path / "two"
    launcher = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", str(_free_port()),
    ]
    single = start_train(*recipe, "--grad-accum-steps", "2", "--run-dir", str(one))
    double = run_train(*recipe, "--run-dir", str(two), launcher=launcher)
    assert double.returncode == 0, double.stderr[-3000:]
    assert single.wait(timeout=300) == 0, single.communicate()[0][-3000:]

    assert json.loads((two / "summary.json").read_text())["num_processes"] == 2
    assert json.loads((two / "summary.json").read_text())["test_acc"] == json.loads((one / "summary.json").read_text())["test_acc"]
    assert {p.name for p in (two / "checkpoints" / "step_00000012").glob("random_states_*")} == {
        "random_states_0.pkl", "random_states_1.pkl"
    }
    assert_same_weights(weights_of(two), weights_of(one), tol=0.0)
    for a, b in zip(*[[json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()] for d in (two, one)]):
        assert a["val_samples"] == b["val_samples"] == 50  # gather_for_metrics drops the padding
        assert a["train_images"] == b["train_images"] == 96
        assert a["val_acc"] == b["val_acc"]
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-5)


# -- errors that write nothing -----------------------------------------------------------------
@pytest.fixture
def bad_yaml(tmp_path: Path):
    def write(text: str) -> str:
        path = tmp_path / "recipe.yaml"
        path.write_text(text)
        return str(path)

    return write


@pytest.mark.parametrize(
    "args, expected",
    [
        pytest.param(["--config", "{yaml}:lrr: 0.1\n"], "unknown config key 'lrr' (did you mean 'lr'?)", id="yaml-unknown-key"),
        pytest.param(["--config", "{yaml}:epochs: two\n"], "epochs: expected int, got str 'two'", id="yaml-wrong-type"),
        pytest.param(["--attn", "axial,softmax,axial"], "attn: 3 names given for depth=2", id="flag-attn-list-length"),
        pytest.param(["--epochs", "2.5"], "--epochs: expected int, got '2.5'", id="flag-wrong-type"),
        pytest.param(["--attn", "nope"], "attn: unknown attention 'nope'; valid:", id="flag-unknown-attention"),
        pytest.param(["--attn-kwargs", "bogus=1"], "unknown option(s) bogus", id="flag-unknown-attention-option"),
        pytest.param(["--auto-augment", "rand-m9-mstd0.5-inc1"], "can posterize to 0 bits", id="augment-policy-pillow-rejects"),
        pytest.param(["--img-size", "18"], "must be a positive multiple of patch_size=4", id="flag-img-size-not-multiple"),
        pytest.param(["--dataset", "cifar10", "--data-dir", "{empty}"], "Pass --download to fetch it", id="cifar10-missing"),
        pytest.param(["--dataset", "cifar100", "--data-dir", "{empty}"], "CIFAR-100 was not found", id="cifar100-missing"),
        pytest.param(["--dataset", "cifar10", "--data-dir", "{corrupt}"], "incomplete or corrupted", id="cifar10-corrupted"),
        pytest.param(["--dataset", "imagefolder", "--data-dir", "{empty}/nowhere"], "does not exist", id="imagefolder-missing"),
        pytest.param(["--dataset", "imagefolder"], "needs --data-dir", id="imagefolder-without-dir"),
        pytest.param(["--resume"], "nothing to resume", id="resume-without-run"),
    ],
)
def test_bad_input_is_one_clear_message_and_writes_nothing(args, expected, tmp_path, bad_yaml, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    corrupt = tmp_path / "corrupt"
    (corrupt / "cifar-10-batches-py").mkdir(parents=True)
    (corrupt / "cifar-10-batches-py" / "data_batch_1").write_bytes(b"not a batch")
    args = [
        bad_yaml(arg.split(":", 1)[1]) if arg.startswith("{yaml}:")
        else arg.replace("{empty}", str(empty)).replace("{corrupt}", str(corrupt))
        for arg in args
    ]
    run_dir = tmp_path / "run"
    assert train.main([*TINY, *args, "--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert expected in err and err.startswith("error: ") and "Traceback" not in err
    assert not run_dir.exists()
    assert not any(empty.iterdir())
    assert [p.name for p in corrupt.rglob("*")] == ["cifar-10-batches-py", "data_batch_1"]


def test_bad_input_on_the_command_line_gives_no_traceback(tmp_path):
    result = run_train(*TINY, "--dataset", "cifar10", "--data-dir", str(tmp_path), "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and "--download" in result.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "args, expected",
    [
        pytest.param([], "holds a previous run (last checkpoint step_00000012). Pass --resume", id="restart-refused"),
        pytest.param(["--overwrite", "--config", "{yaml}"], "unknown config key 'lrr'", id="overwrite-bad-key"),
        pytest.param(["--overwrite", "--epochs", "many"], "--epochs: expected int", id="overwrite-bad-type"),
        pytest.param(["--overwrite", "--dataset", "cifar10", "--data-dir", "{tmp}"], "CIFAR-10 was not found", id="overwrite-missing-data"),
        pytest.param(["--overwrite", "--attn-kwargs", "bogus=1"], "unknown option(s) bogus", id="overwrite-bad-model"),
        pytest.param(["--overwrite", "--batch-size", "512"], "no full batch to train on", id="overwrite-batch-too-big"),
        pytest.param(["--resume", "--lr", "fast"], "--lr: expected float", id="resume-bad-type"),
        pytest.param(["--resume", "--overwrite"], "exclude each other", id="resume-and-overwrite"),
    ],
)
def test_previous_run_survives_bad_input_and_refused_restarts(args, expected, tiny_run, tmp_path, capsys):
    run_dir, _ = tiny_run
    before = snapshot(run_dir)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("lrr: 0.1\n")
    args = [str(recipe) if arg == "{yaml}" else arg.replace("{tmp}", str(tmp_path)) for arg in args]
    assert train.main([*TINY, "--run-dir", str(run_dir), *args]) == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err
    assert snapshot(run_dir) == before


def test_the_same_command_after_a_finished_run_says_where_its_results_are(tiny_run, capsys):
    """make train twice: the second run of the same settings changes nothing and exits 0 with one line."""
    run_dir, _ = tiny_run
    before = snapshot(run_dir)
    assert train.main([*TINY, "--run-dir", str(run_dir), "--save-every", "4", "--keep-checkpoints", "2"]) == 0
    out, err = capsys.readouterr()
    test_acc = json.loads((run_dir / "summary.json").read_text())["test_acc"]
    assert out.strip() == (f"{run_dir} holds this run, finished: test accuracy {100 * test_acc:.2f}%, results in "
                           f"{run_dir / 'summary.json'} (--overwrite trains it again)")
    assert err == "" and snapshot(run_dir) == before
    # other settings: still refused (the restart-refused case above), naming --resume


def test_overwrite_refuses_a_folder_that_is_not_a_run(tmp_path, capsys):
    folder = tmp_path / "precious"
    folder.mkdir()
    (folder / "notes.txt").write_text("keep me")
    assert train.main([*TINY, "--run-dir", str(folder), "--overwrite"]) == 2
    assert "holds no visattn run" in capsys.readouterr().err
    assert (folder / "notes.txt").read_text() == "keep me"


# -- data --------------------------------------------------------------------------------------
def _image_folder(root: Path, layout: str) -> Path:
    """Three classes of random images of assorted sizes, split into train/ and val/ or not."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for c, name in enumerate(("cats", "dogs", "owls")):
        for i in range(10):
            folder = root / ("train" if i < 7 else "val") / name if layout == "split" else root / name
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(rng.integers(0, 255, (20 + i, 30 - c, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    return root


# train/ + val/: val/ is the test split; one folder: eval_fraction is; validation is cut from what is left.
@pytest.mark.parametrize("layout, train_size, eval_size", [("split", 18, 9), ("flat", 21, 6)])
def test_image_folder_at_a_non_square_size(layout, train_size, eval_size, tmp_path):
    config = make_config({"dataset": "imagefolder", "data_dir": str(_image_folder(tmp_path, layout)),
                          "img_size": [16, 24], "patch_size": 4, "eval_fraction": 0.2})
    splits = load_splits(config)
    assert (len(splits.train), len(splits.val), len(splits.eval), splits.num_classes) == (train_size, 3, eval_size, 3)
    assert sorted(splits.val[i][1] for i in range(3)) == [0, 1, 2]  # stratified: one image per class
    assert not set(splits.val.indices) & set(splits.train.indices)
    for training, part in ((True, splits.train), (False, splits.eval)):
        image, label = TransformedDataset(part, build_transform(config, splits, training), seed=0)[0]
        assert image.shape == (3, 16, 24) and 0 <= label < 3


def test_digits_split_is_fixed_and_stratified():
    splits = load_splits(TrainConfig())
    assert (len(splits.train), len(splits.val), len(splits.eval), splits.num_classes) == (1293, 144, 360, 10)
    eval_labels = [splits.eval[i][1] for i in range(len(splits.eval))]
    assert sorted(set(eval_labels)) == list(range(10)) and min(np.bincount(eval_labels)) >= 35
    again = load_splits(TrainConfig())
    assert np.array_equal(np.asarray(splits.eval[0][0]), np.asarray(again.eval[0][0]))
    # the test split is the 20% of sklearn's stratified split (seed 0); train and validation share the rest
    digits = load_digits()
    _, x_test, _, y_test = train_test_split(
        digits.images, digits.target, test_size=0.2, stratify=digits.target, random_state=0
    )
    assert np.array_equal(splits.eval.images, np.rint(x_test * (255.0 / 16.0)).astype(np.uint8))
    assert np.array_equal(splits.eval.labels, y_test)
    assert splits.train.dataset is splits.val.dataset and len(splits.train.dataset) == 1437
    assert sorted(splits.train.indices + splits.val.indices) == list(range(1437))  # disjoint, all of train
    assert (splits.train.indices, splits.val.indices) == (again.train.indices, again.val.indices)
    train_counts = np.bincount([splits.train[i][1] for i in range(len(splits.train))])
    val_counts = np.bincount([splits.val[i][1] for i in range(len(splits.val))])
    share = (train_counts + val_counts) * 144 / 1437  # each class's share of the validation split
    assert np.all(np.abs(val_counts - share) < 1)


def test_best_weights_are_chosen_on_validation_and_the_test_split_is_evaluated_once_at_the_end(tmp_path, monkeypatch):
    # No --max-eval-samples: 144 validation and 360 test images tell the two loaders apart.
    seen = []  # (images in the evaluated split, weights evaluated, accuracy)
    original_evaluate = loop.evaluate

    def evaluate_and_keep(accelerator, model, loader):
        scores = original_evaluate(accelerator, model, loader)
        weights = {key: value.detach().clone() for key, value in accelerator.unwrap_model(model).state_dict().items()}
        seen.append((len(loader.dataset), weights, scores["acc"]))
        return scores

    monkeypatch.setattr(loop, "evaluate", evaluate_and_keep)
    recipe = [arg for arg in TINY if arg not in ("--max-eval-samples", "50")]
    run_dir = tmp_path / "run"
    assert train.main([*recipe, "--epochs", "4", "--lr", "1e-2", "--run-dir", str(run_dir)]) == 0
    assert [size for size, _, _ in seen] == [144] * 4 + [360]
    val_accs = [acc for _, _, acc in seen[:4]]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["best_epoch"] == val_accs.index(max(val_accs)) + 1 and summary["best_acc"] == max(val_accs)
    assert summary["test_acc"] == seen[-1][2] and summary["test_samples"] == 360
    assert_same_weights(seen[-1][1], weights_of(run_dir, "best"), tol=0.0)
    assert_same_weights(seen[-1][1], seen[summary["best_epoch"] - 1][1], tol=0.0)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["val_acc"] for r in records] == val_accs


def test_a_dataset_without_validation_chooses_on_test_and_says_so(tmp_path, monkeypatch, capsys):
    original_load = data.load_splits

    def without_validation(config, download=False, progress=False):
        return dataclasses.replace(original_load(config, download, progress), val=None)

    monkeypatch.setattr(build, "load_splits", without_validation)
    run_dir = tmp_path / "run"
    assert train.main([*TINY, "--run-dir", str(run_dir)]) == 0
    assert "digits has no validation split: the best epoch is chosen on the test split" in capsys.readouterr().out
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["selected_on"] == "test" and summary["test_acc"] == records[-1]["test_acc"]
    assert summary["best_acc"] == max(r["test_acc"] for r in records)


def test_augmentation_is_fixed_by_seed_epoch_and_index_and_leaves_the_process_rng_alone():
    config = make_config({"auto_augment": "rand-m9-mstd0.5-inc1-mmax9", "re_prob": 0.5})
    splits = load_splits(config)
    dataset = TransformedDataset(splits.train, build_transform(config, splits, training=True), seed=3)
    torch.manual_seed(0)
    expected_draws = torch.rand(4)
    torch.manual_seed(0)
    first = dataset[5][0]
    assert torch.equal(torch.rand(4), expected_draws)
    assert torch.equal(dataset[5][0], first)
    dataset.set_epoch(1)
    assert not torch.equal(dataset[5][0], first)
    other_seed = TransformedDataset(splits.train, build_transform(config, splits, training=True), seed=4)
    assert not torch.equal(other_seed[5][0], first)


# -- configuration -----------------------------------------------------------------------------
def test_flags_override_the_config_file_which_overrides_the_defaults(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("lr: 1e-3\nepochs: 7\nattn_kwargs: {kernel_size: 5}\n")
    from_file, from_flags, options = parse_args(["--config", str(recipe), "--epochs", "9", "--attn", "axial,softmax"])
    config = make_config(from_file, from_flags, {"depth": 2})
    assert (config.lr, config.epochs, config.attn, config.attn_kwargs) == (1e-3, 9, ["axial", "softmax"], {"kernel_size": 5})
    assert config.batch_size == TrainConfig().batch_size
    assert options.config_file == str(recipe)


def test_the_run_folder_is_run_dir_or_named_by_dataset_and_attention(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("dataset: cluttered-digits\n")
    assert run_dir_of({}) == Path("runs/digits-softmax")
    from_file, from_flags, _ = parse_args(["--config", str(recipe), "--attn", "axial,softmax,axial"])
    assert run_dir_of({**from_file, **from_flags}) == Path("runs/cluttered-digits-axial+softmax")
    _, from_flags, _ = parse_args(["--attn", "linear", "--run-dir", str(tmp_path / "mine")])
    assert run_dir_of(from_flags) == tmp_path / "mine"


def test_a_named_timm_model_brings_its_own_shape():
    """--model vit_tiny_patch16_224 is ViT-Ti (width 192, depth 12, 3 heads, patch 16, class token), not the digits
    recipe's small ViT under the stock name; a flag given with it still wins."""
    _, from_flags, _ = parse_args(["--model", "vit_tiny_patch16_224", "--attn", "linear"])
    config = make_config(from_flags)
    assert (config.patch_size, config.embed_dim, config.depth, config.num_heads, config.mlp_ratio) == (16, 192, 12, 3, 4.0)
    assert (config.global_pool, config.class_token) == ("token", True)
    model = build.build_model(config, num_classes=10)
    assert sum(p.numel() for p in model.parameters()) == sum(
        p.numel() for p in create_model("vit_tiny_patch16_224", attn="linear", img_size=16, num_classes=10).parameters()
    )
    _, from_flags, _ = parse_args(["--model", "vit_small_patch16_224", "--depth", "2", "--patch-size", "4"])
    config = make_config(from_flags)
    assert (config.patch_size, config.embed_dim, config.depth, config.num_heads) == (4, 384, 2, 6)


def test_a_recipe_keeps_its_shape_unless_another_model_is_named(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("model: visattn_vit_small_patch16\npatch_size: 4\nembed_dim: 96\n")
    from_file, _, _ = parse_args(["--config", str(recipe)])
    # the recipe's model: its own shape where the recipe gives none, the recipe's where it does
    assert (make_config(from_file).patch_size, make_config(from_file).embed_dim, make_config(from_file).depth) == (4, 96, 12)
    from_file, from_flags, _ = parse_args(["--config", str(recipe), "--model", "visattn_vit_small_patch16", "--depth", "3"])
    assert (make_config(from_file, from_flags).patch_size, make_config(from_file, from_flags).depth) == (4, 3)
    from_file, from_flags, _ = parse_args(["--config", str(recipe), "--model", "vit_tiny_patch16_224"])
    assert (make_config(from_file, from_flags).patch_size, make_config(from_file, from_flags).embed_dim) == (16, 192)
    # the defaults' model named again keeps the defaults' shape
    assert make_config({"model": TrainConfig().model}) == TrainConfig()


def test_mapping_flags_take_key_value_words_or_a_mapping():
    _, from_flags, _ = parse_args(
        ["--attn-kwargs", "kernel_size=5", "dilation=2", "--model-kwargs", "reg_tokens=4,qk_norm=true",
         "--opt-kwargs", '{"eps": 1e-6}']
    )
    assert from_flags == {
        "attn_kwargs": {"kernel_size": 5, "dilation": 2}, "model_kwargs": {"reg_tokens": 4, "qk_norm": True},
        "opt_kwargs": {"eps": 1e-6},
    }
    with pytest.raises(ConfigError, match="--attn-kwargs: expected KEY=VALUE pairs, got 'kernel_size'"):
        parse_args(["--attn-kwargs", "kernel_size"])


def test_help_lists_every_config_key_as_a_flag_with_its_default():
    help_text = " ".join(build_parser().format_help().split())
    for key in TrainConfig().to_dict():
        assert f"--{key.replace('_', '-')}" in help_text, key
    for shown in ("--embed-dim EMBED_DIM token width (default: 64)", "(default: 0.7,1.0)", "(default: none)",
                  "--augment, --no-augment random augmentation of training images (default: true)"):
        assert shown in help_text


def test_every_shipped_recipe_is_a_valid_config():
    recipes = sorted((REPO / "configs").glob("*.yaml"))
    assert recipes, "configs/*.yaml"
    for recipe in recipes:
        from_file, _, _ = parse_args(["--config", str(recipe)])
        make_config(from_file)


def test_the_digits_recipe_is_the_default():
    from_file, _, _ = parse_args(["--config", str(REPO / "configs" / "digits.yaml")])
    assert make_config(from_file) == TrainConfig()


def test_config_rejects_unknown_keys_and_wrong_types_by_name():
    with pytest.raises(ConfigError, match="unknown config key 'embed_dims'"):
        make_config({"embed_dims": 64})
    with pytest.raises(ConfigError, match="clip_grad: expected float or none, got str"):
        make_config({"clip_grad": "1.0"})
    with pytest.raises(ConfigError, match="augment: expected bool, got int"):
        make_config({"augment": 1})
    assert set(visattn.list_attentions()) >= {"softmax", "axial"}


@pytest.mark.parametrize("config, message", [
    ({"stem": "cnn"}, "stem: 'cnn' is not one of patch, conv"),
    ({"stem": "conv", "img_size": 15, "patch_size": 5}, "stem: 'conv' strides by 2 and needs an even patch_size, got 5"),
    ({"stem": "conv", "pretrained": True}, "stem: 'conv' has no pretrained weights"),
    ({"model_kwargs": {"embed_layer": "conv"}}, "model_kwargs: embed_layer is chosen by stem, one of patch, conv"),
])
def test_stem_errors_are_one_line_naming_the_accepted_values(config, message):
    with pytest.raises(ConfigError, match=message):
        make_config(config)


@pytest.mark.parametrize("name", ["visattn_vit_tiny_patch16", "vit_tiny_patch16_224"])
def test_a_conv_stem_is_refused_pretrained_weights(name):
    with pytest.raises(ValueError, match="stem 'conv' has no pretrained weights"):
        create_model(name, stem="conv", pretrained=True)


# -- numerical faults --------------------------------------------------------------------------------
class _NanGradient(torch.autograd.Function):
    """The identity whose backward returns NaN: a finite loss with a non-finite gradient."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return torch.full_like(grad, float("nan"))


def _poison_criterion(monkeypatch, faults: dict[int, str]) -> None:
    """Makes the training loss of the listed updates (1-based, one batch an update) NaN ("loss"), or
    its gradient NaN ("gradient"), 0 ("zero") or 1e10 times larger ("huge")."""
    build = prepare.build_criterion
    calls = [0]

    def build_poisoned(config, mixup):
        criterion = build(config, mixup)

        def poisoned(logits, targets):
            calls[0] += 1
            fault = faults.get(calls[0])
            if fault == "gradient":
                logits = _NanGradient.apply(logits)
            loss = criterion(logits, targets)
            if fault == "loss":
                return loss * float("nan")
            return loss * {"huge": 1e10, "zero": 0.0}.get(fault, 1.0)

        return poisoned

    monkeypatch.setattr(prepare, "build_criterion", build_poisoned)


def _error_line(stderr: str) -> str:
    """The one error line among the progress bar's lines (which redraw after carriage returns); no traceback."""
    assert "Traceback" not in stderr
    errors = [line for line in stderr.replace("\r", "\n").splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, stderr[-3000:]
    return errors[0]


def _all_checkpoint_weights_finite(run_dir: Path) -> list[str]:
    checked = []
    for checkpoint in sorted((run_dir / "checkpoints").glob("step_*")):
        for key, value in load_file(str(checkpoint / "model.safetensors")).items():
            assert torch.isfinite(value).all(), f"{checkpoint.name}: {key} is not finite"
        checked.append(checkpoint.name)
    return checked


@pytest.mark.parametrize("fault, what", [("loss", "the loss"), ("gradient", "a gradient")])
def test_nonfinite_update_stops_the_run_naming_update_and_last_good_checkpoint(fault, what, monkeypatch, tmp_path, capsys):
    _poison_criterion(monkeypatch, {5: fault})
    run_dir = tmp_path / "run"
    assert train.main([*TINY, "--run-dir", str(run_dir), "--save-every", "2"]) == 2
    last_good = run_dir / "checkpoints" / "step_00000004"
    assert _error_line(capsys.readouterr().err) == (
        f"error: update 5 (epoch 1): {what} is not finite; stopped before anything of it was saved; last good "
        f"checkpoint: {last_good}. Lower --lr or set --clip-grad, or pass --skip-nonfinite to skip such updates"
    )
    assert _all_checkpoint_weights_finite(run_dir) == ["step_00000002", "step_00000004"]


def test_skip_nonfinite_skips_counts_and_prints_the_skipped_updates(monkeypatch, tmp_path, capsys):
    _poison_criterion(monkeypatch, {3: "loss", 8: "gradient"})
    run_dir = tmp_path / "run"
    assert train.main([*TINY, "--run-dir", str(run_dir), "--skip-nonfinite"]) == 0
    out = capsys.readouterr().out
    assert "update 3: non-finite loss or gradient, skipped" in out
    assert "update 7: non-finite loss or gradient, skipped" in out  # the 8th batch, after one skipped update
    assert "2 update(s) skipped for a non-finite loss or gradient" in out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["skipped_updates"] == 2
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["update"] for m in metrics] == [5, 10]  # 12 batches, 2 of them skipped
    assert [m["train_images"] for m in metrics] == [80, 80]  # the skipped batches' images are not counted
    assert all(np.isfinite(m["train_loss"]) for m in metrics)
    assert _all_checkpoint_weights_finite(run_dir) == ["step_00000005", "step_00000010"]
    assert all(torch.isfinite(value).all() for value in weights_of(run_dir).values())


def test_weights_that_overflow_are_never_saved(monkeypatch, tmp_path, capsys):
    """A finite loss and gradient can still overflow the weights (here an SGD step of lr 1e30 x a gradient
    1e10 times too large): the save refuses them. The updates before it change nothing (zero loss), and
    update 4 is saved at once, before a forward could see its weights."""
    _poison_criterion(monkeypatch, {1: "zero", 2: "zero", 3: "zero", 4: "huge"})
    run_dir = tmp_path / "run"
    args = ["--opt", "sgd", "--lr", "1e30", "--clip-grad", "none", "--weight-decay", "0", "--warmup-epochs", "0"]
    assert train.main([*TINY, *args, "--run-dir", str(run_dir), "--save-every", "2"]) == 2
    assert _error_line(capsys.readouterr().err) == (
        "error: after update 4 (epoch 1) the weights are not finite; nothing was saved; last good checkpoint: "
        f"{run_dir / 'checkpoints' / 'step_00000002'}. Lower --lr"
    )
    assert _all_checkpoint_weights_finite(run_dir) == ["step_00000002"]


# -- smaller promises ---------------------------------------------------------------------------------
def test_resume_of_a_finished_run_keeps_its_summary(tiny_run):
    run_dir, _ = tiny_run
    summary = run_dir / "summary.json"
    before = (summary.read_bytes(), summary.stat().st_mtime_ns)
    result = run_train(*TINY, "--run-dir", str(run_dir), "--resume")
    assert result.returncode == 0, result.stderr[-3000:]
    assert (summary.read_bytes(), summary.stat().st_mtime_ns) == before


def test_resume_with_another_model_is_one_line_naming_the_setting(tiny_run, capsys):
    run_dir, _ = tiny_run
    before = snapshot(run_dir)
    assert train.main([*TINY, "--run-dir", str(run_dir), "--resume", "--embed-dim", "8"]) == 2
    checkpoint = run_dir / "checkpoints" / "step_00000012"
    assert _error_line(capsys.readouterr().err) == (
        f"error: cannot resume from {checkpoint}: it holds another model (30 tensor(s) differ, e.g. blocks.0.attn.proj.bias: "
        "(16,) in the checkpoint, (8,) here); changed model settings: embed_dim: 16 -> 8. Resume with the run's "
        "settings, or start a new --run-dir"
    )
    # the refused resume held the run lock while it chose the checkpoint; nothing else was touched
    assert {k: v for k, v in snapshot(run_dir).items() if k != "run.lock"} == {
        k: v for k, v in before.items() if k != "run.lock"
    }


@pytest.mark.slow
@pytest.mark.parametrize("attn", ["linear", "axial"])
def test_bf16_training_at_4096_tokens_keeps_a_finite_loss(attn):
    """50 AdamW updates under bf16 autocast on a 64 x 64 grid (4,096 tokens, patch 1) at width 16: the
    sums over 4,096 tokens stay finite, and the loss of the fixed batch falls."""
    torch.manual_seed(0)
    model = timm.create_model(
        "visattn_vit_tiny_patch16", img_size=64, patch_size=1, embed_dim=16, depth=1, num_heads=2, num_classes=10,
        attn=attn,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    images, targets = torch.randn(1, 3, 64, 64), torch.tensor([3])
    losses = []
    for _ in range(50):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(images).float(), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert all(np.isfinite(losses)), losses
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert losses[-1] < 0.5 * losses[0], losses


def test_same_command_and_seed_give_identical_weights(tiny_run, tmp_path):
    """The determinism the README promises: the same command, seed and thread count, bit for bit."""
    run_dir, _ = tiny_run
    again = tmp_path / "again"
    result = run_train(*TINY, "--run-dir", str(again), "--save-every", "4", "--keep-checkpoints", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_weights(weights_of(again), weights_of(run_dir), tol=0.0)
    assert_same_weights(weights_of(again, "best"), weights_of(run_dir, "best"), tol=0.0)
