"""train.py --lora-rank: a softmax run's weights converted, transferred and fine-tuned with low-rank adapters, its
trained weights frozen; the saved weights merged (a plain model that predicts), a resume that ends where the
whole run ends, and the settings it refuses, each in one line."""
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
from visattn.predict import load_predictor, predict
from visattn.train.config import ConfigError, make_config
from visattn.train.initial import read_state_dict

# 6 transfer updates (the adapters and the learned maps) and 12 fine-tune updates; a checkpoint every 3.
ADAPTED = [
    *TINY, "--attn", "linear", "--attn-kwargs", "feature_map=learned", "--transfer-epochs", "1", "--transfer-lr", "1e-2",
    "--epochs", "2", "--lr", "1e-2", "--lora-rank", "2", "--save-every", "3", "--keep-checkpoints", "20",
    "--test-every-epoch",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(a tiny softmax run, the run converted to linear and fine-tuned with adapters from its weights)."""
    folder = tmp_path_factory.mktemp("lora")
    parent = folder / "softmax"
    assert train.main([*TINY, "--attn", "softmax", "--run-dir", str(parent)]) == 0
    adapted = folder / "linear"
    assert train.main([*ADAPTED, "--initial-checkpoint", str(parent), "--run-dir", str(adapted)]) == 0
    return parent, adapted


def test_the_trained_weights_stay_and_the_projections_move_by_a_low_rank_update(runs):
    parent, run_dir = runs
    weights, source = load_file(str(run_dir / "model_last.safetensors")), load_file(str(parent / "model_best.safetensors"))
    # a plain model's weights: the adapters merged in, the learned maps and the dwconv added by the conversion
    assert not any("parametrizations" in key for key in weights)
    assert set(weights) - set(source) == {f"blocks.{i}.attn.{name}" for i in range(2) for name in
                                          ("learned_map.query", "learned_map.key", "dwconv.weight", "dwconv.bias")}
    projections = {f"blocks.{i}.attn.{name}.weight" for i in range(2) for name in ("qkv", "proj")}
    for key in source:
        if key in projections:
            delta = weights[key] - source[key]
            assert delta.abs().max() > 0 and torch.linalg.matrix_rank(delta) <= 2, key
        elif key.startswith("head."):
            assert not torch.equal(weights[key], source[key]), key
        else:  # frozen: the patch embedding, norms, biases, MLPs, position embedding
            assert torch.equal(weights[key], source[key]), key


def test_the_reported_test_accuracy_is_the_best_epoch_s_weights_loaded_back(runs):
    """The best weights, saved merged, are loaded back into the model with adapters for the final test: it
    computes what it computed at that epoch, whose test the run recorded then."""
    _, run_dir = runs
    summary = json.loads((run_dir / "summary.json").read_text())
    history = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert history[summary["best_epoch"] - 1]["test_acc"] == summary["test_acc"]
    assert history[summary["best_epoch"] - 1]["test_loss"] == pytest.approx(summary["test_loss"], rel=1e-6)


def test_a_checkpoint_s_weights_start_a_run_as_the_saved_weights_do(runs):
    """A checkpoint holds the adapters apart; read as initial weights, they are merged."""
    _, run_dir = runs
    last = sorted((run_dir / "checkpoints").iterdir())[-1] / "model.safetensors"
    assert any("parametrizations" in key for key in load_file(str(last)))
    merged, expected = read_state_dict(last, "initial_checkpoint"), load_file(str(run_dir / "model_last.safetensors"))
    assert merged.keys() == expected.keys()
    assert all(torch.equal(merged[key], expected[key]) for key in expected)


def test_predict_loads_the_adapted_run(runs, tmp_path):
    _, run_dir = runs
    predictor = load_predictor(run_dir, "best", device="cpu")
    image = tmp_path / "digit.png"
    Image.fromarray((np.random.default_rng(0).random((16, 16)) * 255).astype(np.uint8)).save(image)
    (result,) = predict(predictor, [image], top_k=3)
    assert result.error is None and len(result.top_k) == 3


def test_resume_from_mid_fine_tune_ends_where_the_whole_run_ends(runs, tmp_path):
    _, whole = runs
    resumed = tmp_path / "resumed"
    stopped_copy(whole, resumed, "step_00000012",  # the transfer's 6 updates and 6 of the fine-tune's 12
                 ("model_best.safetensors", "model_last.safetensors", "summary.json"))
    assert train.main(["--run-dir", str(resumed), "--resume"]) == 0
    final, expected = load_file(str(resumed / "model_last.safetensors")), load_file(str(whole / "model_last.safetensors"))
    assert final.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(final[key], expected[key], rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize("with_initial_checkpoint", [True, False],
                         ids=["initial-checkpoint-given", "initial-checkpoint-from-saved-settings"])
def test_resume_refuses_changed_adapters(runs, tmp_path, capsys, with_initial_checkpoint):
    parent, whole = runs
    resumed = tmp_path / "resumed"
    shutil.copytree(whole, resumed)
    before = sorted(p.relative_to(resumed) for p in resumed.rglob("*"))
    # without --initial-checkpoint the flag is valid only beside the run's saved one
    given = ["--initial-checkpoint", str(parent)] if with_initial_checkpoint else []
    assert train.main(["--run-dir", str(resumed), "--resume", "--lora-rank", "4", *given]) != 0
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--resume cannot change the low-rank adapters" in error and "lora_rank: 2 -> 4" in error
    assert sorted(p.relative_to(resumed) for p in resumed.rglob("*")) == before


@pytest.mark.parametrize("values, message", [
    (dict(lora_rank=2), "lora_rank: adapters fine-tune trained weights, which stay frozen; give --initial-checkpoint"),
    (dict(lora_rank=-1), "lora_rank: must be >= 0, got -1"),
    (dict(lora_rank=2, initial_checkpoint="x", lora_alpha=0.0), "lora_alpha: must be > 0 or none, got 0.0"),
    (dict(lora_alpha=16.0), "lora_alpha: has no effect without lora_rank; give --lora-rank R too, or drop it"),
    (dict(lora_rank=2, initial_checkpoint="x", transfer_projections=True),
     "transfer_projections: trains the attention's qkv and proj, which lora_rank keeps frozen"),
])
def test_adapter_settings_are_checked(values, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        make_config(values)
