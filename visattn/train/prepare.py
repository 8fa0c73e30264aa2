"""Preparing a training run, in the steps ``train.py`` takes before its first update:

    build_run          the accelerator, the data, the model and its optimizers, all checked before the run
                       directory changes (:class:`BuiltRun`)
    claim_run_dir      the run lock; the checkpoint a resumed run starts from, or a new run's files
    prepare_training   accelerate's prepare, compilation, the start-up lines, the initial weights' scores, and
                       the :class:`~visattn.train.loop.Training` the loop runs
    resume_training    a resumed run's checkpoint loaded into that Training
    begin_training     the scheduler at the run's update, the metrics so far, the trackers
"""
from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from accelerate import Accelerator
from accelerate.utils import set_seed
from safetensors import safe_open
from torch.utils.data import DataLoader

from visattn.predict import MODEL_FILE
from visattn.train import checkpoint as ckpt
from visattn.train import run_log
from visattn.train.attention import resolve_attention
from visattn.train.build import (
    LoaderSpeed, add_adapters, build_accelerator, build_criterion, build_loaders, build_mixup, build_model,
    build_optimizer, build_scheduler, compile_backend, compile_model, load_data, measure_loader, worker_notice,
)
from visattn.train.cli import RunOptions
from visattn.train.config import TrainConfig, config_yaml
from visattn.train.data import DataSplits, ImageCheck, eval_data_config
from visattn.train.initial import InitialWeights, load_initial_weights, read_initial_weights
from visattn.train.loop import Training, evaluate, new_trainer_state, test_scores
from visattn.train.overview import run_overview
from visattn.train.transfer import build_transfer_optimizer

# A resumed run's start: the checkpoint chosen and the trainer state read from it.
ResumePoint = tuple[Path, dict[str, Any]]


@dataclass
class BuiltRun:
    """What a run is built from (:func:`build_run`), before accelerate prepares it.

    ``initial``: the first weights read (None for fresh ones, and on a resume, whose checkpoint has them);
    ``auto``: whether the config asked for attn="auto" (``config.attn`` now holds the type it chose);
    ``val_loader`` is None for a dataset without a validation split."""

    config: TrainConfig
    accelerator: Accelerator
    run_dir: Path
    initial: InitialWeights | None
    auto: bool
    splits: DataSplits
    image_check: ImageCheck
    model: nn.Module
    model_kwargs: dict[str, Any]
    train_loader: DataLoader
    val_loader: DataLoader | None
    eval_loader: DataLoader
    optimizer: torch.optim.Optimizer
    transfer_optimizer: torch.optim.Optimizer | None


def build_run(config: TrainConfig, options: RunOptions) -> BuiltRun:
    """Builds and checks everything before the run directory is touched, so that a refusal (its run directory,
    a ConfigError, a DataError) leaves nothing written."""
    run_dir = Path(config.run_dir)
    accelerator = build_accelerator(config, run_dir)
    ckpt.check_run_dir(run_dir, options.resume, options.overwrite)  # reads only: a refusal comes before slow work
    # A resumed run takes its weights from its checkpoint; a new one reads its first weights before the rest.
    initial = None if options.resume else read_initial_weights(config)
    # attn="auto" is recorded as the type it chose: another machine's calibration may choose differently.
    auto = config.attn == "auto"
    for notice in resolve_attention(config):
        accelerator.print(notice)
    splits, image_check = load_data(accelerator, config, options.download)
    set_seed(config.seed)  # the same initial weights on every process
    model = build_model(config, splits.num_classes)
    if initial is not None:
        for line in load_initial_weights(model, initial):
            accelerator.print(line)
    for line in add_adapters(config, model):  # on the loaded weights (a resumed run: before its checkpoint loads)
        accelerator.print(line)
    train_loader, val_loader, eval_loader = build_loaders(config, splits, accelerator.num_processes)
    return BuiltRun(
        config=config, accelerator=accelerator, run_dir=run_dir, initial=initial, auto=auto, splits=splits,
        image_check=image_check, model=model, model_kwargs=config.model_kwargs_for_timm(splits.num_classes),
        train_loader=train_loader, val_loader=val_loader, eval_loader=eval_loader,
        optimizer=build_optimizer(config, model),
        transfer_optimizer=build_transfer_optimizer(config, model) if config.transfer_epochs else None,
    )


def claim_run_dir(built: BuiltRun, options: RunOptions, held: contextlib.ExitStack) -> ResumePoint | None:
    """Takes the run directory: its lock (kept until ``held`` closes), then with ``--resume`` the checkpoint to
    resume from, else a new run's directory and files (and None)."""
    accelerator, run_dir = built.accelerator, built.run_dir
    ckpt.check_run_dir(run_dir, options.resume, options.overwrite)  # before the lock file lands there
    if accelerator.is_main_process:  # one run writes into a run directory at a time; a second one stops here
        held.enter_context(ckpt.RunLock(run_dir))
        ckpt.check_run_dir(run_dir, options.resume, options.overwrite)  # again: a run may have ended just before
    accelerator.wait_for_everyone()  # every process has checked the run directory before it changes
    resume = None
    if options.resume:  # the newest checkpoint that verifies (or the one asked for), checked under the lock
        resume = ckpt.choose_checkpoint(run_dir, options.resume_from, accelerator.print)
    if accelerator.is_main_process and resume is None:
        ckpt.start_run_dir(run_dir, options.overwrite)
        write_run_files(run_dir, built.config, built.model_kwargs, built.splits)
    accelerator.wait_for_everyone()
    return resume


def write_run_files(run_dir: Path, config: TrainConfig, model_kwargs: dict[str, Any], splits: DataSplits) -> None:
    """The effective config (what --resume reads) and model.json (what visattn.predict reads)."""
    ckpt.write_atomically(run_dir / ckpt.CONFIG_FILE, config_yaml(config))
    ckpt.write_model_file(run_dir, config.model, model_kwargs, eval_data_config(config, splits), splits.named_classes())


def prepare_training(built: BuiltRun, options: RunOptions) -> tuple[Training, torch.optim.Optimizer | None]:
    """The run prepared by accelerate (and compiled), the start-up lines printed, the initial weights scored:
    the Training the loop runs, and the attention transfer's prepared optimizer (None without a transfer)."""
    accelerator, config = built.accelerator, built.config
    if built.val_loader is None:
        accelerator.print(f"{config.dataset} has no validation split: the best epoch is chosen on the test split, "
                          "and the last epoch's test accuracy is reported")
    loader_speed = measure_loader(
        built.train_loader, options.measure_loader, accelerator.device, progress=accelerator.is_main_process
    ) if options.measure_loader else None
    model, optimizer, train_loader, eval_loader = accelerator.prepare(
        built.model, built.optimizer, built.train_loader, built.eval_loader
    )
    transfer_optimizer = built.transfer_optimizer
    if transfer_optimizer is not None:  # prepared second: its state is every checkpoint's optimizer_1.bin
        transfer_optimizer = accelerator.prepare(transfer_optimizer)
    backend, compile_note = compile_backend(config)
    if backend is not None:
        compile_model(model, backend)
    selection_split, selection_loader = (
        ("test", eval_loader) if built.val_loader is None else ("val", accelerator.prepare(built.val_loader))
    )
    print_start(built, options, accelerator.unwrap_model(model), len(train_loader), compile_note, loader_speed)
    initial_scores = {} if built.initial is None else score_initial_weights(
        accelerator, config, model, (selection_split, selection_loader), eval_loader
    )
    scheduler = build_scheduler(config, optimizer, len(train_loader))
    mixup = build_mixup(config, built.splits.num_classes)
    set_seed(config.seed + accelerator.process_index)  # dropout, drop path and mixup differ per process
    run = Training(
        accelerator=accelerator, config=config, run_dir=built.run_dir, model=model, optimizer=optimizer,
        scheduler=scheduler, criterion=build_criterion(config, mixup), mixup=mixup,
        train_loader=train_loader, eval_loader=eval_loader, state=new_trainer_state(accelerator.num_processes),
        selection_loader=selection_loader, selection_split=selection_split,
        skipped_images=built.image_check.unreadable,
    )
    run.state.update(initial_scores)
    return run, transfer_optimizer


def print_start(built: BuiltRun, options: RunOptions, model: nn.Module, batches_per_epoch: int, compile_note: str,
                loader_speed: LoaderSpeed | None) -> None:
    """The start-up lines: the run's overview (``model`` unwrapped), mixed precision, compilation, gradient
    checkpointing, the loader's workers and, with ``--measure-loader``, its speed alone."""
    accelerator, config = built.accelerator, built.config
    overview = run_overview(
        config, built.splits, model, accelerator.num_processes, batches_per_epoch, built.auto, built.run_dir,
        accelerator.device, built.image_check,
    )
    accelerator.print("\n".join(overview))
    accelerator.print(options.precision_note)
    checkpointing = "; gradient checkpointing: each block recomputed in backward" if config.grad_checkpointing else ""
    accelerator.print(compile_note + checkpointing)
    for line in worker_notice(config.num_workers):
        accelerator.print(line)
    if loader_speed is not None:
        accelerator.print(
            f"loader alone: {run_log.significant(loader_speed.images_per_s)} img/s per process over "
            f"{loader_speed.batches} batches of {config.batch_size} to {accelerator.device} (no model; the epochs "
            "print the steps' img/s)"
        )


def score_initial_weights(accelerator: Accelerator, config: TrainConfig, model: nn.Module,
                          selection: tuple[str, DataLoader], eval_loader: DataLoader) -> dict[str, float]:
    """What the prepared ``model`` does with its initial weights, before any update, printed: the trainer state's
    ``initial_eval_acc`` on the ``selection`` split (its name, its loader) and, with ``test_every_epoch``,
    ``initial_test_acc``."""
    selection_split, selection_loader = selection
    scores = evaluate(accelerator, model, selection_loader)
    accelerator.print(
        f"initial weights, before any update: eval loss {scores['loss']:.4f}, "
        f"eval acc {100 * scores['acc']:.2f}% ({selection_split} split)"
    )
    initial = {"initial_eval_acc": scores["acc"]}
    if config.test_every_epoch:
        initial["initial_test_acc"] = test_scores(accelerator, model, selection_split, eval_loader, scores)["acc"]
    return initial


def resume_training(run: Training, built: BuiltRun, resume: ResumePoint | None) -> None:
    """With ``--resume``: the chosen checkpoint (its weights, optimizers, random states and trainer state) loaded
    into ``run`` once its weights are known to fit this config's model, then the run's files rewritten for this
    config. Nothing without one."""
    if resume is None:
        return
    checkpoint, saved_state = resume
    accelerator = run.accelerator
    check_checkpoint_model(accelerator, run.model, built.run_dir, checkpoint, built.model_kwargs)
    run.state = ckpt.load_checkpoint(accelerator, checkpoint, saved_state)
    state = run.state
    accelerator.print(f"resumed from {checkpoint} (epoch {state['epoch'] + 1}, batch {state['batch']}, update {state['update']})")
    if accelerator.is_main_process:  # only now that the checkpoint has loaded into this config's model
        write_run_files(built.run_dir, built.config, built.model_kwargs, built.splits)
        ckpt.remove_leftovers(built.run_dir)  # a run killed in its last save or prune has no later save to do it


def check_checkpoint_model(accelerator: Accelerator, model: nn.Module, run_dir: Path, checkpoint: Path,
                           model_kwargs: dict[str, Any]) -> None:
    """Before ``--resume`` loads ``checkpoint``: a RunDirError in one line when its weights do not fit this
    config's model, naming the model settings that changed since the run started (its model.json)."""
    weights = checkpoint / "model.safetensors"
    if not weights.is_file():
        return  # what is missing is reported by the load itself
    with safe_open(str(weights), framework="pt") as saved:
        saved_shapes = {key: tuple(saved.get_slice(key).get_shape()) for key in saved.keys()}
    shapes = {key: tuple(value.shape) for key, value in accelerator.unwrap_model(model).state_dict().items()}
    if saved_shapes == shapes:
        return
    differing = sorted(key for key in saved_shapes.keys() | shapes.keys() if saved_shapes.get(key) != shapes.get(key))
    first = differing[0]
    try:
        saved_kwargs = json.loads((run_dir / MODEL_FILE).read_text())["kwargs"]
    except (OSError, ValueError, KeyError, TypeError):
        saved_kwargs = {}  # the shapes alone then say that the model differs
    as_json = json.loads(json.dumps(model_kwargs))  # tuples as lists, as model.json holds them
    changed = [f"{key}: {saved_kwargs[key]} -> {value}" for key, value in as_json.items()
               if key in saved_kwargs and saved_kwargs[key] != value]
    raise ckpt.RunDirError(
        f"cannot resume from {checkpoint}: it holds another model ({len(differing)} tensor(s) differ, e.g. {first}: "
        f"{saved_shapes.get(first, 'absent')} in the checkpoint, {shapes.get(first, 'absent')} here); "
        f"{'changed model settings: ' + '; '.join(changed) if changed else 'no model setting changed'}. "
        "Resume with the run's settings, or start a new --run-dir"
    )


def begin_training(run: Training) -> None:
    """What every run does before its first update: the scheduler set to the run's update count, metrics.jsonl
    written as the trainer state has it (a resumed run redoes what came after its checkpoint), the trackers
    started (``--log-with``)."""
    run.scheduler.step_update(run.state["update"])
    if run.accelerator.is_main_process:
        run_log.write_metrics(run.run_dir, run.state["history"])
    if run.config.log_with:
        run.accelerator.init_trackers("visattn", config={key: value if isinstance(value, (int, float, str, bool)) else str(value)
                                                         for key, value in run.config.to_dict().items()})
