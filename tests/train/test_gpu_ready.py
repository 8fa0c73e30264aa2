"""What a GPU run relies on, checked on CPU: which mixed precision applies, --compile and
--grad-checkpointing, no host read per step, the input pipeline (workers, pinning, non-blocking copies,
--measure-loader) and speeds printed with significant digits."""
from __future__ import annotations

import json
import re
import sys

import pytest
import torch
import yaml
from accelerate.state import AcceleratorState, GradientState
from torch.utils.data import DataLoader

import visattn  # noqa: F401  (registers the visattn_vit_* models with timm)
from tests.train.test_train import REPO, TINY, train
from visattn.train import build, loop, run_log
from visattn.train.cli import LAUNCHER_PRECISION, choose_mixed_precision, resolve_config
from visattn.train.config import ConfigError, make_config
from visattn.train.data import TransformedDataset, load_splits

BF16_RECIPE = str(REPO / "configs" / "cifar10-pixels-1024tok.yaml")  # mixed_precision: bf16


@pytest.fixture
def fresh_accelerate_state():
    """Each test its own AcceleratorState (a process-wide singleton that keeps its first mixed precision and
    dynamo backend), and none left behind for the tests after it."""
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


# -- mixed precision: train.py's flag, else the launcher's, else the recipe's -----------------------------
@pytest.mark.parametrize("configured, from_flag, launcher, expected", [
    ("bf16", True, "fp16", "bf16"),
    ("no", True, "bf16", "no"),
    ("no", False, "bf16", "bf16"),
    ("bf16", False, "fp16", "fp16"),
    ("bf16", False, "no", "bf16"),  # the launcher's "no" is also its default: the recipe stands
    ("bf16", False, None, "bf16"),
    ("no", False, None, "no"),
])
def test_flag_wins_over_launcher_which_wins_over_recipe(configured, from_flag, launcher, expected):
    precision, note = choose_mixed_precision(configured, from_flag, launcher)
    assert precision == expected
    assert note.startswith(f"mixed precision: {expected} (")


def test_resolved_precision_and_its_reason(monkeypatch):
    monkeypatch.setenv(LAUNCHER_PRECISION, "bf16")
    config, options, _ = resolve_config(["--attn", "axial"])
    assert config.mixed_precision == "bf16"
    assert options.precision_note == "mixed precision: bf16 (accelerate launch --mixed_precision, over the recipe's no)"
    config, options, _ = resolve_config(["--attn", "axial", "--mixed-precision", "no"])
    assert config.mixed_precision == "no"
    assert options.precision_note.startswith("mixed precision: no (train.py --mixed-precision")
    monkeypatch.setenv(LAUNCHER_PRECISION, "no")
    config, options, _ = resolve_config(["--config", BF16_RECIPE, "--data-dir", "unused"])
    assert config.mixed_precision == "bf16"
    assert "accelerate launch's 'no', its default, leaves it" in options.precision_note
    monkeypatch.delenv(LAUNCHER_PRECISION)
    config, options, _ = resolve_config(["--attn", "axial"])
    assert (config.mixed_precision, options.precision_note) == ("no", "mixed precision: no (the recipe's)")
    monkeypatch.setenv(LAUNCHER_PRECISION, "fp32")
    with pytest.raises(ConfigError, match="ACCELERATE_MIXED_PRECISION: 'fp32' is not one of no, fp16, bf16, fp8"):
        resolve_config(["--attn", "axial"])


def test_a_launcher_bf16_run_trains_in_bf16_on_cpu_and_records_it(monkeypatch, tmp_path, capsys, fresh_accelerate_state):
    """End to end in one short run: the launcher's bf16 applies (CPU autocast), the log says why, config.yaml
    records it; the loader is measured; the epoch line's speed is the metrics file's to 3 significant digits."""
    monkeypatch.setenv(LAUNCHER_PRECISION, "bf16")
    logits_dtypes = []
    original_evaluate = loop.evaluate

    def evaluate(accelerator, model, loader):
        head = accelerator.unwrap_model(model).head  # accelerate hands the prepared model's outputs back in fp32
        hook = head.register_forward_hook(lambda module, args, output: logits_dtypes.append(output.dtype))
        try:
            return original_evaluate(accelerator, model, loader)
        finally:
            hook.remove()

    monkeypatch.setattr(loop, "evaluate", evaluate)
    run_dir = tmp_path / "run"
    args = [*TINY, "--epochs", "1", "--warmup-epochs", "0", "--measure-loader", "2", "--run-dir", str(run_dir)]
    assert train.main(args) == 0
    out = capsys.readouterr().out
    assert "mixed precision: bf16 (accelerate launch --mixed_precision, over the recipe's no)" in out
    assert set(logits_dtypes) == {torch.bfloat16}  # accelerate's CPU autocast around the prepared model's forward
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["mixed_precision"] == "bf16"
    assert re.search(r"^loader alone: [\d.]+ img/s per process over 2 batches of 16 to \S+ ", out, re.MULTILINE), out
    (record,) = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert f", {run_log.significant(record['images_per_s'])} img/s, " in out


# -- --compile and --grad-checkpointing -----------------------------------------------------------------
@pytest.mark.parametrize("compile_flag, launcher, backend", [
    (False, None, None), (True, None, "inductor"), (False, "EAGER", "eager"), (True, "EAGER", "eager"),
    (True, "NO", "inductor"),
])
def test_compile_backend_from_the_flag_or_the_launcher(compile_flag, launcher, backend, monkeypatch):
    if launcher is None:
        monkeypatch.delenv(build.LAUNCHER_DYNAMO, raising=False)
    else:
        monkeypatch.setenv(build.LAUNCHER_DYNAMO, launcher)
    chosen, line = build.compile_backend(make_config({"compile": compile_flag}))
    assert chosen == backend
    who = "accelerate launch --dynamo_backend" if launcher not in (None, "NO") else "--compile"
    assert line == ("torch.compile: off" if backend is None else f"torch.compile: {backend} ({who})")


def test_the_model_compiles_in_place_and_keeps_its_weight_names(tmp_path, monkeypatch, fresh_accelerate_state):
    """accelerate leaves the model alone even when the launcher names a backend; compile_model compiles it in
    place, so the saved weights keep the names an uncompiled model loads."""
    monkeypatch.setenv(build.LAUNCHER_DYNAMO, "EAGER")
    config = make_config({"attn": "axial", "img_size": 16, "patch_size": 4, "embed_dim": 16, "depth": 2, "num_heads": 2})
    accelerator = build.build_accelerator(config, tmp_path)
    model = build.build_model(config, num_classes=10).eval()
    names = list(model.state_dict())
    images = torch.randn(2, 3, 16, 16)
    expected = model(images)
    prepared = accelerator.prepare(model)
    assert prepared is model  # one process: nothing wraps it, accelerate did not compile it
    build.compile_model(prepared, build.compile_backend(config)[0])
    assert prepared._compiled_call_impl is not None
    assert list(accelerator.get_state_dict(prepared)) == names
    assert torch.equal(prepared(images), expected)


@pytest.mark.parametrize("drop_path_rate", [0.0, 0.2], ids=["plain", "drop-path"])
def test_grad_checkpointing_gives_the_same_loss_and_gradients(drop_path_rate):
    """Checkpointing recomputes each block in backward with the same RNG state (torch's default), from the
    same inputs and by the same kernels, so the loss and every gradient are equal bit for bit."""
    def loss_and_grads(checkpointing: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
        config = make_config({"attn": "axial", "img_size": 16, "patch_size": 4, "embed_dim": 16, "depth": 2,
                              "num_heads": 2, "drop_path_rate": drop_path_rate, "grad_checkpointing": checkpointing})
        torch.manual_seed(0)
        model = build.build_model(config, num_classes=10).train()
        images, targets = torch.randn(4, 3, 16, 16), torch.tensor([0, 3, 5, 9])
        saved = []  # what autograd keeps for backward outside the checkpointed blocks
        torch.manual_seed(1)  # the drop-path draws
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
            loss = torch.nn.functional.cross_entropy(model(images), targets)
        loss.backward()
        return loss.detach(), {name: p.grad for name, p in model.named_parameters()}, sum(saved)

    loss, grads, saved = loss_and_grads(False)
    loss_ckpt, grads_ckpt, saved_ckpt = loss_and_grads(True)
    assert saved_ckpt < saved / 4  # the blocks' activations are recomputed, not kept
    assert torch.equal(loss, loss_ckpt)
    assert grads.keys() == grads_ckpt.keys()
    for name in grads:
        assert torch.equal(grads[name], grads_ckpt[name]), name


# -- no host read per step --------------------------------------------------------------------------------
def test_a_training_step_reads_nothing_back_from_the_device(monkeypatch, tmp_path, fresh_accelerate_state):
    """12 steps per epoch, the progress refresh only at the first and last step: the epoch reads tensors a fixed
    few times (at those refreshes and its end), not once a step as a per-update check would."""
    reads = []
    original_item = torch.Tensor.item

    def item(tensor):
        # the loop's own reads (torch's optimizers read their step count, a CPU tensor, by design)
        if sys._getframe(1).f_globals.get("__name__") == loop.__name__:
            reads.append(sys._getframe(1).f_code.co_name)
        return original_item(tensor)

    original_train_epoch = loop.train_epoch

    def train_epoch(run, epoch):
        monkeypatch.setattr(torch.Tensor, "item", item)
        try:
            return original_train_epoch(run, epoch)
        finally:
            monkeypatch.setattr(torch.Tensor, "item", original_item)

    monkeypatch.setattr(loop, "POSTFIX_SECONDS", 3600.0)
    monkeypatch.setattr(train, "train_epoch", train_epoch)
    args = [*TINY, "--batch-size", "8", "--epochs", "1", "--warmup-epochs", "0", "--run-dir", str(tmp_path / "run")]
    assert train.main(args) == 0
    steps = 12
    # two refreshes (the non-finite watch and the loss), then the watch and the (loss, images) totals at the end
    assert reads == ["check", "train_epoch"] * 2 + ["check", "train_epoch", "train_epoch"]
    assert len(reads) < steps


# -- the input pipeline -----------------------------------------------------------------------------------
def test_workers_are_capped_at_the_cores_persistent_and_pinned_on_cuda(monkeypatch):
    monkeypatch.setattr(build, "available_cpus", lambda: 2)
    config = make_config({"num_workers": 8, "max_train_samples": 64, "max_eval_samples": 16})
    splits = load_splits(config, download=False)
    for loader in build.build_loaders(config, splits, num_processes=1):
        assert (loader.num_workers, loader.persistent_workers) == (2, True)
        assert loader.pin_memory == torch.cuda.is_available()
    assert build.worker_notice(8) == ["notice: num_workers 8 capped at 2, the CPU cores this process can use"]
    assert build.worker_notice(2) == []
    config = make_config({"num_workers": 0, "max_train_samples": 64, "max_eval_samples": 16})
    train_loader, _, _ = build.build_loaders(config, splits, num_processes=1)
    assert (train_loader.num_workers, train_loader.persistent_workers) == (0, False)


def test_batches_are_copied_to_the_device_without_blocking(tmp_path, fresh_accelerate_state):
    assert build.build_accelerator(make_config({}), tmp_path).non_blocking


def _noisy(value: float) -> torch.Tensor:
    """A random transform: what it draws is fixed by the dataset's (seed, epoch, index)."""
    return torch.rand(1) + value


def test_persistent_workers_see_each_new_epoch():
    dataset = TransformedDataset([(float(i), i) for i in range(8)], _noisy, seed=0)
    persistent = DataLoader(dataset, batch_size=4, num_workers=2, persistent_workers=True)
    in_process = DataLoader(dataset, batch_size=4)
    for epoch in range(3):
        dataset.set_epoch(epoch)
        drawn = torch.cat([images for images, _ in persistent])
        assert torch.equal(drawn, torch.cat([images for images, _ in in_process])), epoch
        if epoch:
            assert not torch.equal(drawn, previous)  # the epoch reached the workers
        previous = drawn


def test_measure_loader_times_batches_without_a_model():
    dataset = TransformedDataset([(torch.zeros(3, 4, 4), 0)] * 40, lambda image: image, seed=None)
    loader = DataLoader(dataset, batch_size=8)
    speed = build.measure_loader(loader, batches=3, device=torch.device("cpu"))
    assert (speed.batches, speed.images) == (3, 24)
    assert speed.seconds > 0 and speed.images_per_s == speed.images / speed.seconds
    fewer = build.measure_loader(loader, batches=100, device=torch.device("cpu"))
    assert (fewer.batches, fewer.images) == (4, 32)  # 5 batches, the first untimed


# -- speeds as printed ------------------------------------------------------------------------------------
@pytest.mark.parametrize("value, text", [
    (0.0312, "0.0312"), (0.03125, "0.0312"), (0.4, "0.400"), (12.345, "12.3"), (99.96, "100"), (9.996, "10.0"),
    (456.7, "457"), (4567.8, "4568"), (0.0, "0"),
])
def test_speeds_are_printed_with_three_significant_digits(value, text):
    assert run_log.significant(value) == text
