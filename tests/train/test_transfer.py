"""train.py --transfer-epochs: attention transfer from a softmax run's weights, then the fine-tune; its
per-block metrics; a resume from a checkpoint taken mid-transfer that ends where the uninterrupted run ends;
visattn.predict on the result; and the configurations it refuses, each in one line."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

import train  # the script at the repository root, importable from there as pytest runs the tests
from tests.helpers import TINY, stopped_copy
from visattn.predict import load_predictor, load_trained_model, predict
from visattn.train.cli import resolve_config
from visattn.train.config import ConfigError, make_config
from visattn.train.initial import read_initial_weights
from visattn.train.transfer import build_parent

# 6 transfer updates and 6 fine-tune updates; a checkpoint every 2 updates, every one kept.
TRANSFER = [
    *TINY, "--attn", "linear", "--attn-kwargs", "feature_map=learned", "--transfer-epochs", "1", "--transfer-lr", "1e-2",
    "--save-every", "2", "--keep-checkpoints", "20",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(a tiny softmax run, the run transferred and fine-tuned from its weights)."""
    folder = tmp_path_factory.mktemp("transfer")
    parent = folder / "softmax"
    assert train.main([*TINY, "--attn", "softmax", "--run-dir", str(parent)]) == 0
    transferred = folder / "linear"
    assert train.main([*TRANSFER, "--initial-checkpoint", str(parent), "--run-dir", str(transferred)]) == 0
    return parent, transferred


def test_transfer_then_fine_tune_writes_per_block_losses(runs):
    parent, run_dir = runs
    (record,) = [json.loads(line) for line in (run_dir / "transfer_metrics.jsonl").read_text().splitlines()]
    assert record["transfer_epoch"] == 1 and record["transfer_update"] == 6 and record["mode"] == "joint"
    for block in range(2):
        assert 0 < record[f"transfer_loss_block{block}"] < 1
        assert 0 < record[f"val_transfer_loss_block{block}"] < 1
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 1  # the fine-tune epoch alone
    summary = json.loads((run_dir / "summary.json").read_text())
    assert 0 <= summary["transfer_acc"] <= 1 and 0 <= summary["initial_acc"] <= 1
    # 6 transfer + 6 fine-tune updates, named by their sum
    assert sorted(path.name for path in (run_dir / "checkpoints").iterdir()) == [
        f"step_{n:08d}" for n in (2, 4, 6, 8, 10, 12)
    ]
    # the transfer trained the learned maps; the fine-tune everything; softmax weights went in
    weights, source = load_file(str(run_dir / "model_last.safetensors")), load_file(str(parent / "model_best.safetensors"))
    identity = torch.eye(8).expand(2, 8, 8)
    assert not torch.equal(weights["blocks.0.attn.learned_map.query"], identity)
    assert set(weights) - set(source) == {f"blocks.{i}.attn.{name}" for i in range(2) for name in
                                          ("learned_map.query", "learned_map.key", "dwconv.weight", "dwconv.bias")}


def test_test_every_epoch_records_the_test_split_at_every_evaluation(runs, tmp_path):
    """softmax to softmax: the weights are the parent's, and a transfer whose every loss is exactly 0 leaves
    them so; the test accuracy before any update and after the transfer is the parent's own."""
    parent, _ = runs
    run_dir = tmp_path / "softmax"
    assert train.main([*TINY, "--attn", "softmax", "--initial-checkpoint", str(parent), "--transfer-epochs", "1",
                       "--transfer-projections", "--test-every-epoch", "--epochs", "2", "--run-dir", str(run_dir)]) == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    parent_acc = json.loads((parent / "summary.json").read_text())["test_acc"]
    assert summary["initial_test_acc"] == summary["transfer_test_acc"] == parent_acc
    history = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(record["test_samples"], record["val_samples"]) for record in history] == [(50, 50), (50, 50)]
    assert all(record["test_time_s"] > 0 for record in history)
    assert history[summary["best_epoch"] - 1]["test_acc"] == summary["test_acc"]  # the same weights, tested twice
    (transfer,) = [json.loads(line) for line in (run_dir / "transfer_metrics.jsonl").read_text().splitlines()]
    assert transfer["train_images"] == 96  # 6 steps of 16


def test_without_test_every_epoch_the_test_split_waits_for_the_end(runs):
    _, run_dir = runs
    history = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert not any(key.startswith("test_") for record in history for key in record)
    assert not {"initial_test_acc", "transfer_test_acc"} & set(json.loads((run_dir / "summary.json").read_text()))


def test_the_parent_computes_what_its_run_trained_rope_included(tmp_path):
    """The parent is the softmax run's model, with the options that run recorded, whatever the converted
    model's."""
    parent_dir = tmp_path / "softmax-rope"
    assert train.main([*TINY, "--attn", "softmax", "--attn-kwargs", "rope=axial", "--run-dir", str(parent_dir)]) == 0
    config = resolve_config([*TINY, "--attn", "linear", "--attn-kwargs", "feature_map=learned",
                             "--initial-checkpoint", str(parent_dir), "--transfer-epochs", "1"])[0]
    assert "rope" not in config.attn_kwargs
    parent = build_parent(config, 10, read_initial_weights(config), torch.device("cpu"))
    assert all(block.attn.rope is not None for block in parent.blocks)
    images = torch.randn(2, 3, 16, 16)
    assert torch.equal(parent(images), load_trained_model(parent_dir).eval()(images))


def test_resume_from_mid_transfer_ends_where_the_whole_run_ends(runs, tmp_path):
    parent, whole = runs
    resumed = tmp_path / "resumed"
    state = stopped_copy(whole, resumed, "step_00000004",  # taken after 4 of the 6 transfer updates
                         ("model_best.safetensors", "model_last.safetensors", "summary.json", "transfer_metrics.jsonl"))
    assert (state["transfer_epoch"], state["transfer_batch"], state["transfer_update"], state["update"]) == (0, 4, 4, 0)
    assert train.main(["--run-dir", str(resumed), "--resume"]) == 0
    final, expected = load_file(str(resumed / "model_last.safetensors")), load_file(str(whole / "model_last.safetensors"))
    assert final.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(final[key], expected[key], rtol=1e-5, atol=1e-6, msg=key)
    (resumed_record,) = [json.loads(line) for line in (resumed / "transfer_metrics.jsonl").read_text().splitlines()]
    (whole_record,) = [json.loads(line) for line in (whole / "transfer_metrics.jsonl").read_text().splitlines()]
    for block in range(2):
        for key in (f"transfer_loss_block{block}", f"val_transfer_loss_block{block}"):
            assert resumed_record[key] == pytest.approx(whole_record[key], rel=1e-5)


def test_resume_from_the_last_transfer_checkpoint_keeps_the_transferred_accuracy(runs, tmp_path):
    """A run stopped after the transfer's last checkpoint, before any fine-tune update: the resumed run reports the
    accuracies after transfer that the uninterrupted run measured (the checkpoint holds them) and ends where it
    ends."""
    parent, _ = runs
    whole = tmp_path / "whole"
    assert train.main([*TRANSFER, "--initial-checkpoint", str(parent), "--test-every-epoch", "--run-dir", str(whole)]) == 0
    resumed = tmp_path / "resumed"
    state = stopped_copy(whole, resumed, "step_00000006",  # taken after the 6th and last transfer update
                         ("model_best.safetensors", "model_last.safetensors", "summary.json"))
    assert (state["transfer_epoch"], state["update"]) == (1, 0)
    assert train.main(["--run-dir", str(resumed), "--resume"]) == 0
    summary, expected = (json.loads((run / "summary.json").read_text()) for run in (resumed, whole))
    assert summary["transfer_acc"] == expected["transfer_acc"] == state["transfer_eval_acc"]
    assert summary["transfer_test_acc"] == expected["transfer_test_acc"] == state["transfer_test_acc"]
    assert summary["initial_test_acc"] == expected["initial_test_acc"]
    final, expected_weights = (load_file(str(run / "model_last.safetensors")) for run in (resumed, whole))
    for key in expected_weights:
        torch.testing.assert_close(final[key], expected_weights[key], rtol=1e-5, atol=1e-6, msg=key)


def test_predict_loads_the_transferred_run(runs, tmp_path):
    _, run_dir = runs
    predictor = load_predictor(run_dir, "last", device="cpu")
    assert [block.attn.feature_map for block in predictor.model.blocks] == ["learned", "learned"]
    image = tmp_path / "digit.png"
    Image.fromarray((np.random.default_rng(0).random((16, 16)) * 255).astype(np.uint8)).save(image)
    (result,) = predict(predictor, [image], top_k=3)
    assert result.error is None and len(result.top_k) == 3
    assert 0 < sum(probability for _, probability in result.top_k) <= 1 + 1e-6


def test_a_type_with_nothing_to_learn_stops_before_the_run_starts(runs, tmp_path, capsys):
    parent, _ = runs
    run_dir = tmp_path / "elu"
    args = [*TINY, "--attn", "linear", "--attn-kwargs", "dwconv_kernel=null", "--transfer-epochs", "1",
            "--initial-checkpoint", str(parent), "--run-dir", str(run_dir)]
    assert train.main(args) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: transfer_epochs: attention transfer: 'linear' add(s) no parameters") and "nothing to learn" in line
    assert not run_dir.exists()


@pytest.mark.parametrize("values, message", [
    (dict(transfer_epochs=1), "transfer_epochs: attention transfer learns from trained softmax weights"),
    (dict(transfer_epochs=1, initial_checkpoint="x", attn="timm"), "transfer_epochs: attn 'timm' keeps timm's Attention"),
    (dict(transfer_mode="blockwise"), "transfer_mode: 'blockwise' is not one of joint, layerwise"),
    (dict(transfer_lr=0.0), "transfer_lr: must be > 0, got 0.0"),
    (dict(transfer_epochs=-1), "transfer_epochs: must be >= 0, got -1"),
])
def test_transfer_settings_are_checked(values, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        make_config(values)


def test_resume_refuses_changed_transfer_settings(runs, tmp_path, capsys):
    """The checkpoints hold the transfer stage's progress: --resume with other transfer settings is one line,
    and the run directory is left as it was."""
    _, whole = runs
    resumed = tmp_path / "resumed"
    shutil.copytree(whole, resumed)
    before = sorted(p.relative_to(resumed) for p in resumed.rglob("*"))
    assert train.main(["--run-dir", str(resumed), "--resume", "--transfer-lr", "0.5"]) != 0
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--resume cannot change the attention-transfer settings" in error and "transfer_lr: 0.01 -> 0.5" in error
    assert sorted(p.relative_to(resumed) for p in resumed.rglob("*")) == before
