"""Fine-tuning a stock timm ViT through train.py: its weights arrive unchanged in the converted model at
step 0 (the position embeddings resampled to the larger grid, a new head where the class count differs),
from a safetensors file, a .pth state dict or a visattn run, normalised as those weights expect; the fine-tune
recipe; and the ways a start can fail, each one line."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import timm
import torch
from huggingface_hub import constants as hf_constants
from safetensors.torch import save_file
from timm.layers import resample_abs_pos_embed

import yaml
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD

import train  # the script at the repository root, importable from there as pytest runs the tests
from visattn.models import create_model, load_weights
from visattn.predict import load_trained_model, read_model_file
from visattn.train import prepare
from visattn.train.build import build_model
from visattn.train.cli import resolve_config
from visattn.train.cli import parse_args
from visattn.train.config import ConfigError, make_config
from visattn.train.data import DataSplits, choose_normalization, load_splits
from visattn.train.initial import load_initial_weights, read_initial_weights

REPO = Path(__file__).resolve().parents[2]

MODEL = "vit_tiny_patch16_224"
# The stock ViT of the file: 32 x 32 images, patch 4 (an 8 x 8 grid), class + 1 register token.
SHAPE = dict(patch_size=4, embed_dim=32, depth=2, num_heads=2, mlp_ratio=2.0, class_token=True, global_pool="token",
             reg_tokens=1)
SOURCE_SIZE, TARGET_SIZE = 32, 48  # fine-tuned on a 12 x 12 grid
SHAPE_FLAGS = [
    "--patch-size", "4", "--embed-dim", "32", "--depth", "2", "--num-heads", "2", "--mlp-ratio", "2",
    "--class-token", "--global-pool", "token", "--model-kwargs", "reg_tokens=1",
]
# 32 training digits in batches of 16: two updates.
FINETUNE = [
    "--model", MODEL, "--attn", "linear", "--img-size", str(TARGET_SIZE), *SHAPE_FLAGS, "--max-train-samples", "32",
    "--max-eval-samples", "32", "--batch-size", "16", "--epochs", "1", "--warmup-epochs", "0",
]


def stock_vit(num_classes: int) -> torch.nn.Module:
    torch.manual_seed(1)
    return timm.create_model(MODEL, img_size=SOURCE_SIZE, num_classes=num_classes, **SHAPE)


def write_source(kind: str, folder: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """(what --initial-checkpoint gets, the weights it holds) for a safetensors file (10 classes, the digits'
    count), a timm-style .pth training checkpoint (7 classes: a new head), or a visattn run directory."""
    if kind == "run":
        run_dir = folder / "source-run"
        # a visattn run of the stock ViT with another attention type at the source size
        args = [*FINETUNE, "--attn", "axial", "--img-size", str(SOURCE_SIZE), "--run-dir", str(run_dir)]
        assert train.main(args) == 0
        state = {key: value.clone() for key, value in load_trained_model(run_dir).state_dict().items()}
        return run_dir, state
    model = stock_vit(10 if kind == "safetensors" else 7)
    state = {key: value.detach().clone() for key, value in model.state_dict().items()}
    if kind == "safetensors":
        path = folder / "vit.safetensors"
        save_file(state, str(path))
    else:
        path = folder / "vit.pth"
        torch.save({"state_dict": state, "epoch": 3}, path)
    return path, state


@pytest.mark.parametrize("kind", ["safetensors", "pth", "run"])
def test_finetune_starts_from_the_stock_weights(kind, tmp_path, monkeypatch, capsys):
    source_path, source = write_source(kind, tmp_path)
    capsys.readouterr()

    # The model train.py trains, as its first evaluation (before any update) sees it.
    seen = []
    original_evaluate = prepare.evaluate

    def evaluate_and_keep(accelerator, model, loader):
        seen.append({key: value.detach().clone() for key, value in accelerator.unwrap_model(model).state_dict().items()})
        return original_evaluate(accelerator, model, loader)

    monkeypatch.setattr(prepare, "evaluate", evaluate_and_keep)
    run_dir = tmp_path / "finetuned"
    assert train.main([*FINETUNE, "--initial-checkpoint", str(source_path), "--run-dir", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "resampled to the model's grid: pos_embed" in out
    # A timm model's weights expect its pretrained_cfg's normalisation (augreg: 0.5/0.5); a run's, the one it
    # recorded (here the digits' own statistics, as the source run trained from scratch).
    digits = load_splits(make_config({})).mean
    expected_mean = digits if kind == "run" else (0.5, 0.5, 0.5)
    assert read_model_file(run_dir)["data_config"]["mean"] == pytest.approx(expected_mean, abs=1e-12)
    (line,) = [line for line in out.splitlines() if line.startswith("normalisation: ")]
    assert ("the one " + str(source_path) + " was trained with" in line) == (kind == "run")
    assert ("vit_tiny_patch16_224's pretrained_cfg" in line) == (kind != "run")
    assert "initial weights, before any update: eval loss" in out
    step0 = seen[0]

    new_head = kind == "pth"
    added = {f"blocks.{i}.attn.dwconv.{name}" for i in range(SHAPE["depth"]) for name in ("weight", "bias")}
    assert set(step0) == (set(source) - {"head.weight", "head.bias"} if new_head else set(source)) | added | (
        {"head.weight", "head.bias"} if new_head else set()
    )
    for key, value in source.items():
        if key == "pos_embed":
            # timm's resample of the patch part from 8 x 8 to 12 x 12; class and register tokens as they were
            expected = resample_abs_pos_embed(value, new_size=(12, 12), old_size=(8, 8), num_prefix_tokens=2)
            assert step0[key].shape == (1, 2 + 144, 32)
            torch.testing.assert_close(step0[key], expected, rtol=0, atol=0)
            torch.testing.assert_close(step0[key][:, :2], value[:, :2], rtol=0, atol=0)
        elif key.startswith("head.") and new_head:
            assert step0[key].shape[0] == 10
        else:
            assert torch.equal(step0[key], value), key
    assert ("new head" in out) == new_head

    # after the two updates the run is a converted model that loads back
    trained = load_trained_model(run_dir, "last")
    assert [block.attn.name for block in trained.blocks] == ["linear", "linear"]
    assert not torch.equal(trained.state_dict()["blocks.0.attn.qkv.weight"], step0["blocks.0.attn.qkv.weight"])


def test_a_checkpoint_of_another_shape_is_one_line_naming_the_shapes(tmp_path, capsys):
    other = timm.create_model(MODEL, img_size=SOURCE_SIZE, **{**SHAPE, "embed_dim": 48})
    path = tmp_path / "wide.safetensors"
    save_file(other.state_dict(), str(path))
    run_dir = tmp_path / "run"
    assert train.main([*FINETUNE, "--initial-checkpoint", str(path), "--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert "shapes differ: " in err and "(48,) in the file, (32,) in the model" in err
    assert not run_dir.exists()  # nothing written


def test_a_checkpoint_with_other_prefix_tokens_is_one_line_naming_the_shapes(tmp_path, capsys):
    """timm cannot resample a position embedding whose token count is not prefix + a square grid (its reshape
    fails): the run stops with one line naming pos_embed's two shapes and the class token, not timm's traceback."""
    path = tmp_path / "with-class-token.safetensors"
    save_file(stock_vit(10).state_dict(), str(path))  # 1 class + 1 register token, an 8 x 8 grid: 66 positions
    run_dir = tmp_path / "run"
    args = [*FINETUNE, "--no-class-token", "--global-pool", "avg", "--initial-checkpoint", str(path), "--run-dir", str(run_dir)]
    assert train.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert "pos_embed (1, 66, 32) in the file, (1, 145, 32) in the model" in err
    assert "not in the model: cls_token" in err
    assert "is invalid for input" not in err and not run_dir.exists()


def test_a_pickled_object_is_refused(tmp_path, capsys):
    path = tmp_path / "model.pth"
    torch.save(stock_vit(10), path)  # the whole module, not a state dict
    assert train.main([*FINETUNE, "--initial-checkpoint", str(path), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "weights_only=True" in err


@pytest.mark.parametrize("args, message", [
    (["--model", "resnet18"], "is a ResNet, which convert cannot change"),
    (["--initial-checkpoint", "missing.safetensors"], "missing.safetensors does not exist"),
    (["--initial-checkpoint", "README.md"], "not a weights file"),
    (["--pretrained", "--initial-checkpoint", "x.pth"], "pretrained and initial_checkpoint exclude each other"),
    (["--pretrained", "--model", "visattn_vit_tiny_patch16"], "no weights are published"),
], ids=["not-a-vit", "missing", "not-weights", "both", "visattn-pretrained"])
def test_bad_starts_are_one_line(args, message, tmp_path, capsys):
    assert train.main([*FINETUNE, *args, "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and message in err, err


def test_pretrained_offline_fails_within_seconds_with_one_line(tmp_path, monkeypatch, capsys):
    """No cached file and a hub that cannot be reached (nothing listens on port 9): one line naming the
    ways to give the file, seconds after the start rather than after the hub client's minute of retries."""
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setattr(hf_constants, "ENDPOINT", "http://127.0.0.1:9")
    started = time.perf_counter()
    assert train.main(["--model", MODEL, "--pretrained", "--run-dir", str(tmp_path / "run")]) == 2
    seconds = time.perf_counter() - started
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1
    assert "are not cached" in lines[0] and "--initial-checkpoint PATH" in lines[0] and "pretrained_cfg_overlay" in lines[0]
    assert seconds < 15, f"took {seconds:.1f} s"
    assert not (tmp_path / "run").exists()


def test_pretrained_offline_is_one_line_from_the_command_line_too(tmp_path):
    """The same through a fresh interpreter, where the hub client reads its settings from the environment:
    no retry warnings, no traceback (the bound leaves room for the imports on a busy machine)."""
    env = {
        "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO),
        "HF_HUB_CACHE": str(tmp_path / "empty-cache"), "HF_ENDPOINT": "http://127.0.0.1:9",
    }
    started = time.perf_counter()
    result = subprocess.run(
        [sys.executable, str(REPO / "train.py"), "--model", MODEL, "--pretrained", "--run-dir", str(tmp_path / "run")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "are not cached" in result.stderr
    assert time.perf_counter() - started < 45  # the hub client alone retries for over 50 s


def test_pretrained_reads_the_hugging_face_cache_without_network(tmp_path, monkeypatch):
    """A file in the hub cache is used as it is: no request is made (the endpoint is unreachable)."""
    source = stock_vit(1000)
    snapshot = tmp_path / "models--timm--vit_tiny_patch16_224.augreg_in21k_ft_in1k" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    save_file(source.state_dict(), str(snapshot / "model.safetensors"))
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(hf_constants, "ENDPOINT", "http://127.0.0.1:9")

    config, _, _ = resolve_config(["--model", MODEL, "--pretrained", "--attn", "linformer", "--img-size", "32", *SHAPE_FLAGS])
    model = build_model(config, num_classes=10)
    lines = load_initial_weights(model, read_initial_weights(config))
    assert lines[0].endswith("model.safetensors") and any("new head" in line for line in lines)
    state = model.state_dict()
    assert torch.equal(state["blocks.1.mlp.fc2.weight"], source.state_dict()["blocks.1.mlp.fc2.weight"])
    assert torch.equal(state["pos_embed"], source.state_dict()["pos_embed"])  # same grid: not resampled


def test_load_weights_keeps_attention_parameters_of_the_same_shape_and_leaves_out_the_others():
    """linformer -> linformer at the same grid loads the projections; linformer -> linear leaves them out
    and keeps the convolution's initialisation."""
    kwargs = dict(img_size=SOURCE_SIZE, num_classes=10, **SHAPE)
    source = create_model(MODEL, attn="linformer", attn_kwargs=dict(k=16), **kwargs)
    with torch.no_grad():
        source.blocks[0].attn.proj_k.add_(1.0)
    same = create_model(MODEL, attn="linformer", attn_kwargs=dict(k=16), **kwargs)
    report = load_weights(same, source.state_dict())
    assert report.kept_init == [] and report.left_out == []
    assert torch.equal(same.blocks[0].attn.proj_k, source.blocks[0].attn.proj_k)

    linear = create_model(MODEL, attn="linear", **kwargs)
    conv_before = linear.blocks[0].attn.dwconv.weight.detach().clone()
    report = load_weights(linear, source.state_dict())
    assert report.left_out == [f"blocks.{i}.attn.proj_{w}" for i in range(2) for w in ("k", "v")]
    assert report.kept_init == [f"blocks.{i}.attn.dwconv.{p}" for i in range(2) for p in ("bias", "weight")]
    assert torch.equal(linear.blocks[0].attn.dwconv.weight, conv_before)


def test_create_model_refuses_a_model_convert_cannot_change():
    with pytest.raises(ValueError, match="is a ResNet"):
        create_model("resnet18", attn="linear")
    with pytest.raises(ValueError, match="not a timm model"):
        create_model("no_such_model", attn="linear")


def test_pretrained_and_initial_checkpoint_exclude_each_other():
    with pytest.raises(ConfigError, match="exclude each other"):
        resolve_config(["--pretrained", "--initial-checkpoint", "x.pth"])


# -- normalisation and the fine-tune recipe -------------------------------------------------------------
DATASET_STATS = DataSplits(train=[], eval=[], num_classes=10, mean=(0.3, 0.3, 0.3), std=(0.4, 0.4, 0.4))


@pytest.mark.parametrize("values, mean, std, why", [
    ({}, (0.3,) * 3, (0.4,) * 3, "the digits dataset's"),
    ({"model": "vit_small_patch16_224"}, (0.3,) * 3, (0.4,) * 3, "the digits dataset's"),  # fresh weights
    ({"model": "vit_small_patch16_224", "pretrained": True}, (0.5,) * 3, (0.5,) * 3,
     "vit_small_patch16_224's pretrained_cfg (timm/vit_small_patch16_224.augreg_in21k_ft_in1k), what the weights of "
     "--pretrained expect, not the digits dataset's own"),
    ({"model": "deit_small_patch16_224", "initial_checkpoint": "deit.pth"}, IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD,
     "deit_small_patch16_224's pretrained_cfg (timm/deit_small_patch16_224.fb_in1k), what the weights of "
     "--initial-checkpoint expect, not the digits dataset's own"),
    ({"model": "vit_small_patch16_224", "pretrained": True,
      "model_kwargs": {"pretrained_cfg_overlay": {"file": "w.safetensors", "mean": [0.1, 0.2, 0.3]}}},
     (0.1, 0.2, 0.3), (0.5,) * 3, "vit_small_patch16_224's pretrained_cfg"),
    ({"initial_checkpoint": "weights.safetensors"}, (0.3,) * 3, (0.4,) * 3, "the digits dataset's"),  # no timm cfg
], ids=["fresh-visattn", "fresh-timm", "pretrained-augreg", "initial-deit", "overlay", "initial-visattn"])
def test_normalisation_is_the_weights_own_when_a_named_timm_model_starts_from_them(values, mean, std, why):
    chosen = choose_normalization(make_config(values), DATASET_STATS)
    assert chosen.mean == pytest.approx(mean) and chosen.std == pytest.approx(std)
    assert chosen.reason.startswith(why)


def test_the_finetune_recipe_is_a_pretrained_vit_s_at_a_fine_tuning_learning_rate():
    from_file, _, _ = parse_args(["--config", str(REPO / "configs" / "finetune.yaml")])
    config = make_config(from_file)
    assert (config.model, config.attn, config.img_size, config.patch_size) == ("vit_small_patch16_224", "linear", 224, 16)
    assert (config.embed_dim, config.depth, config.num_heads, config.class_token) == (384, 12, 6, True)  # ViT-S's own
    assert (config.opt, config.lr, config.sched, config.warmup_epochs, config.epochs) == ("adamw", 1e-4, "cosine", 1, 10)
    assert config.mixed_precision == "bf16" and not config.pretrained and config.initial_checkpoint is None
    assert "196 tokens" in (REPO / "configs" / "finetune.yaml").read_text()
    with_weights = make_config(from_file, {"pretrained": True})
    assert choose_normalization(with_weights, DATASET_STATS).mean == (0.5, 0.5, 0.5)
    # another named model brings its shape, the recipe's image size stays
    base = make_config(from_file, {"model": "vit_base_patch16_224"})
    assert (base.embed_dim, base.num_heads, base.img_size) == (768, 12, 224)


def test_the_finetune_recipe_trains_with_the_weights_normalisation(tmp_path, capsys):
    """The recipe, shrunk to the digits and a 2-block ViT, from a file of stock weights: one epoch on the CPU."""
    source_path, _ = write_source("safetensors", tmp_path)
    run_dir = tmp_path / "run"
    args = ["--config", str(REPO / "configs" / "finetune.yaml"), "--dataset", "digits", "--model", MODEL,
            *FINETUNE[FINETUNE.index("--img-size"):], "--mixed-precision", "no", "--num-workers", "0",
            "--initial-checkpoint", str(source_path), "--run-dir", str(run_dir)]
    assert train.main(args) == 0
    out = capsys.readouterr().out
    assert "normalisation: mean (0.5, 0.5, 0.5), std (0.5, 0.5, 0.5): vit_tiny_patch16_224's pretrained_cfg" in out
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert (saved["lr"], saved["sched"], saved["attn"]) == (1e-4, "cosine", "linear")
    assert read_model_file(run_dir)["data_config"]["std"] == [0.5, 0.5, 0.5]
