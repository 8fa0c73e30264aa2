"""train.py --lora-rank: a softmax run's weights converted, transferred and fine-tuned with low-rank adapters, its
trained weights frozen; the saved weights merged (a plain model that predicts), a resume that ends where the
whole run ends, and the settings it refuses, each in one line."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

import train  # the script at the repository root, importable from there as pytest runs the tests
from tests.helpers import TINY
from visattn.predict import load_predictor, predict
from visattn.train.config import ConfigError, make_config

# 6 transfer updates (the adapters and the learned maps) and 12 fine-tune updates; a checkpoint every 3.
ADAPTED = [
    *TINY, "--attn", "linear", "--attn-kwargs", "feature_map=learned", "--transfer-epochs", "1", "--transfer-lr", "1e-2",
    "--epochs", "2", "--lr", "1e-2", "--lora-rank", "2", "--save-every", "3", "--keep-checkpoints", "20",
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
    shutil.copytree(whole, resumed)
    for path in (resumed / "checkpoints").iterdir():
        if path.name != "step_00000012":  # the transfer's 6 updates and 6 of the fine-tune's 12
            shutil.rmtree(path)
    for name in ("model_best.safetensors", "model_last.safetensors", "summary.json"):
        (resumed / name).unlink()
    assert train.main(["--run-dir", str(resumed), "--resume"]) == 0
    final, expected = load_file(str(resumed / "model_last.safetensors")), load_file(str(whole / "model_last.safetensors"))
    assert final.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(final[key], expected[key], rtol=1e-5, atol=1e-6, msg=key)


def test_resume_refuses_changed_adapters(runs, tmp_path, capsys):
    _, whole = runs
    resumed = tmp_path / "resumed"
    shutil.copytree(whole, resumed)
    before = sorted(p.relative_to(resumed) for p in resumed.rglob("*"))
    assert train.main(["--run-dir", str(resumed), "--resume", "--lora-alpha", "8"]) != 0
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--resume cannot change the low-rank adapters" in error and "lora_alpha: None -> 8.0" in error
    assert sorted(p.relative_to(resumed) for p in resumed.rglob("*")) == before


@pytest.mark.parametrize("values, message", [
    (dict(lora_rank=2), "lora_rank: adapters fine-tune trained weights, which stay frozen; give --initial-checkpoint"),
    (dict(lora_rank=-1), "lora_rank: must be >= 0, got -1"),
    (dict(lora_rank=2, initial_checkpoint="x", lora_alpha=0.0), "lora_alpha: must be > 0 or none, got 0.0"),
    (dict(lora_rank=2, initial_checkpoint="x", transfer_projections=True),
     "transfer_projections: trains the attention's qkv and proj, which lora_rank keeps frozen"),
])
def test_adapter_settings_are_checked(values, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        make_config(values)
