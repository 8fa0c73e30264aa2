"""What a run says before and while it trains: the overview, the warm-up warning, the progress bar's
refresh, the CPU threads of a plain run, and a one-line error under accelerate launch."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest
import timm

import visattn.train.loop as loop
from visattn.layers import attention_options, get_attention
from visattn.layers.cost import CostCase, TokenLayout
from visattn.train.attention import resolve_attention
from visattn.train.build import build_model
from visattn.train.config import make_config
from visattn.train.overview import attention_cost_lines, position_options_line
from visattn.train.run_log import significant
from tests.train.test_train import ENV, REPO, TINY, TRAIN, run_train, train

PLAIN_ENV = {key: value for key, value in ENV.items() if key != "OMP_NUM_THREADS"}


def test_the_run_starts_with_an_overview_and_auto_choice(tmp_path):
    args = [*TINY[:-2], "--attn", "auto", "--epochs", "1", "--warmup-epochs", "1", "--run-dir", str(tmp_path / "run")]
    result = subprocess.run(
        [sys.executable, str(TRAIN), *args], cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**PLAIN_ENV, "XDG_CACHE_HOME": str(tmp_path)},  # the built-in thresholds, not this machine's calibration
    )
    assert result.returncode == 0, result.stderr[-3000:]
    model = timm.create_model(
        "visattn_vit_tiny_patch16", attn="softmax", img_size=16, patch_size=4, embed_dim=16, depth=2, num_heads=2,
        mlp_ratio=2.0, num_classes=10, global_pool="avg", class_token=False,
    )
    params = sum(p.numel() for p in model.parameters())
    case = CostCase(TokenLayout((4, 4), 0), 2, 8, attention_options("softmax", {}, (4, 4)))
    mixing = get_attention("softmax").mixing_memory(case)
    # per image: the image and its tokens (2 N C), 2 blocks x (5 N C + 2 N C_mlp activations and what softmax saves),
    # one block's live set
    per_image = 3 * 16 * 16 * 4 + 2 * 16 * 16 * 4 + 2 * ((5 * 16 * 16 + 2 * 16 * 32) * 4 + mixing.train) + max(
        (2 * 16 * 16 + 2 * 16 * 32) * 4, 6 * 16 * 16 * 4 + mixing.infer)
    step_bytes = 16 * params + 2 * mixing.shared + 16 * per_image  # weights, gradients, AdamW's two moments
    overview = result.stdout.splitlines()[:10]
    assert overview == [
        "data: digits, 96 train / 50 validation / 50 test images, 10 classes, resized to 16x16",
        f"model: visattn_vit_tiny_patch16, {params:,} parameters, 4x4 grid of 4x4 patches = 16 tokens",
        "attention: softmax in all 2 blocks (the choice of attn=auto for this model and image size)",
        "position: softmax with rope off",
        # 4 C N^2 per block: 4 x 16 x 16^2 x 2 blocks
        "attention cost: 32,768 FLOPs per image per forward pass (token mixing of all 2 blocks; full softmax "
        "attention: 32,768 FLOPs)",
        "training: 1 process (1 CPU thread each) x batch 16 = 16 images per step; 1 epoch of 6 steps (6 updates each)",
        # 16 images x (3 x (patch projection P = 2 x 16 x 48 x 16 + 2 blocks x (qkv 6 N C^2 + proj 2 N C^2 + MLP
        # 4 N C 32 + mixing 4 C N^2) + head 2 x 16 x 10) - P), N = C = 16
        "cost: 96 images trained, 50 validation and 50 test images evaluated; 16 tokens per image, 256 per step; "
        "8.67 MFLOPs per step (forward and backward, an estimate from the cost models)",
        f"memory per process: a step about {significant(step_bytes / 2**10)} KiB on cpu "
        "(an estimate: weights, gradients, AdamW's moments, the activations kept for the backward); the training loader "
        "up to 48.0 KiB (1 batch of 16 images of 3x16x16 in fp32: read in the training process)",
        f"run directory: {tmp_path / 'run'}",
        "warning: the warm-up (1 epoch) does not end before the run (1 epoch): the learning rate never reaches "
        "lr=0.002; lower --warmup-epochs",
    ], result.stdout


def test_no_warm_up_warning_when_the_warm_up_ends_within_the_run(tiny_run):
    _, result = tiny_run  # 2 epochs, 1 of warm-up
    assert "training: 1 process (1 CPU thread each) x batch 16" in result.stdout
    assert "warm-up" not in result.stdout + result.stderr


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("start") / "run"
    result = run_train(*TINY, "--run-dir", str(run_dir))
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir, result


@pytest.mark.parametrize("omp, threads", [(None, 1), ("2", 2)])
def test_a_plain_run_uses_one_thread_unless_omp_num_threads_says(omp, threads):
    env = PLAIN_ENV | ({"OMP_NUM_THREADS": omp} if omp else {})
    code = "import torch; from visattn.train.build import default_cpu_threads; default_cpu_threads(); print(torch.get_num_threads())"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == str(threads), result.stderr


class RecordingBar(loop.tqdm):
    postfixes: list[dict] = []

    def set_postfix(self, *args, **kwargs):
        RecordingBar.postfixes.append(kwargs)
        super().set_postfix(*args, **kwargs)


@pytest.mark.parametrize("seconds, shown", [(0.0, 6), (3600.0, 2)], ids=["every-step", "first-and-last"])
def test_progress_bar_loss_refreshes_by_time(seconds, shown, tmp_path, monkeypatch):
    """6 steps in the epoch: with no interval every step's loss is shown; with a long one, the first and last."""
    monkeypatch.setattr(loop, "tqdm", RecordingBar)
    monkeypatch.setattr(loop, "POSTFIX_SECONDS", seconds)
    RecordingBar.postfixes = []
    assert train.main([*TINY, "--epochs", "1", "--run-dir", str(tmp_path / "run")]) == 0
    assert len(RecordingBar.postfixes) == shown
    assert all(re.fullmatch(r"\d+\.\d{3}", postfix["loss"]) for postfix in RecordingBar.postfixes)


def test_one_line_error_under_accelerate_launch():
    """`make train`'s launcher, given a bad flag: the script's one line, nothing from accelerate, a failing status."""
    makefile = (REPO / "Makefile").read_text().replace("\\\n", " ")
    (launch,) = re.findall(r"accelerate launch (.*?)\s+train\.py", makefile)
    command = [sys.executable, "-m", "accelerate.commands.launch", *launch.split(), str(TRAIN), "--epochs", "two"]
    result = subprocess.run(command, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert result.stderr == "error: --epochs: expected int, got 'two'\n"


def test_a_dataset_without_a_recipe_gets_a_patch_size_of_at_most_4096_tokens():
    assert make_config({}).patch_size == 2  # the digits: 16 px, an 8 x 8 grid
    config = make_config({"dataset": "imagefolder", "data_dir": "images"})  # 512 px
    assert (config.img_size, config.patch_size) == (512, 8)  # 64 x 64 = 4,096 tokens, not 65,536
    assert make_config({"dataset": "imagefolder", "data_dir": "images", "img_size": [224, 160]}).patch_size == 4  # 56 x 40
    assert make_config({"dataset": "imagefolder", "data_dir": "images", "patch_size": 2}).patch_size == 2  # given: kept


def test_the_start_states_the_attention_cost_and_warns_past_4096_tokens():
    """512 px images in 2 x 2 patches: a 256 x 256 grid. The line sums the type's cost model over the blocks and
    sets full softmax attention beside it (4 C N^2 per block)."""
    config = make_config({"dataset": "imagefolder", "data_dir": "images", "patch_size": 2, "attn": "axial",
                          "embed_dim": 16, "depth": 2, "num_heads": 2})
    resolve_attention(config)
    model = build_model(config, num_classes=3)
    lines = attention_cost_lines(config, model)
    layout = TokenLayout((256, 256), 0)
    axial = get_attention("axial").mixing_flops(CostCase(layout, 2, 8, attention_options("axial", {}, (256, 256))))
    softmax = 4 * 16 * 65536**2
    assert axial < softmax / 100
    assert lines == [
        f"attention cost: {significant(2 * axial / 1e9)} GFLOPs per image per forward pass (token mixing of all 2 "
        "blocks; full softmax attention: 550 GFLOPs)",  # 2 x 4 x 16 x 65,536^2
        "warning: 65,536 tokens per image, more than the 4,096 a default patch size makes: a larger --patch-size "
        "or a smaller --img-size cuts the cost",
    ]
    config = make_config({"dataset": "imagefolder", "data_dir": "images", "attn": "axial", "embed_dim": 16,
                          "depth": 2, "num_heads": 2})
    resolve_attention(config)
    assert len(attention_cost_lines(config, build_model(config, num_classes=3))) == 1  # patch 8: no warning


@pytest.mark.parametrize("values, line", [
    ({"attn": "linear", "attn_kwargs": {"decay": True, "rope": "axial"}}, "position: linear with rope axial, decay on"),
    ({"attn": "linear"}, "position: linear with rope off, decay off"),
    ({"attn": ["linear", "axial"], "depth": 2, "attn_kwargs": {"rope": "mixed"}},
     "position: linear with rope mixed, decay off; axial with rope mixed"),
    ({"attn": "floor"}, None),  # takes neither
    ({"attn": "timm"}, None),  # timm's own Attention
], ids=["linear-rope-decay", "linear-plain", "per-block", "floor", "timm"])
def test_the_start_says_whether_rope_and_decay_are_on(values, line):
    config = make_config(values)
    resolve_attention(config)
    assert position_options_line(config) == line
