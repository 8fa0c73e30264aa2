"""Train a visattn ViT with accelerate.

    python train.py --attn axial                        # embedded digits, finishes in minutes on a CPU
    accelerate launch train.py --config configs/cifar10_vit_s.yaml --attn neighborhood --download
    accelerate launch --multi_gpu --num_processes 2 train.py --attn axial
    python train.py --attn axial --resume               # continue runs/digits-axial from its last checkpoint

Every recipe key is a flag (``python train.py --help``); ``--config FILE`` loads a YAML recipe that flags
override. The run directory gets the effective config, checkpoints (each epoch and every
``--save-every`` updates), per-epoch metrics, a plot, and the best and last weights as safetensors
(load them with :func:`visattn.checkpoint.load_trained_model`).
"""
from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import timm
import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator, DataLoaderConfiguration, PartialState
from accelerate.utils import ProjectConfiguration, set_seed
from timm.data import Mixup
from timm.optim import create_optimizer_v2
from timm.scheduler import create_scheduler_v2
from timm.scheduler.scheduler import Scheduler
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

import visattn  # noqa: F401  (registers the visattn_vit_* models with timm)
from visattn import checkpoint as ckpt
from visattn import run_log
from visattn.data import DataError, DataSplits, TransformedDataset, build_transform, load_splits
from visattn.train_config import (
    ConfigError,
    RunOptions,
    TrainConfig,
    changed_keys,
    config_yaml,
    make_config,
    parse_args,
    read_yaml,
)


def launched_without_accelerator() -> bool:
    """Several processes on a machine without GPU (or other accelerator).

    ``accelerate launch --multi_gpu`` starts them but leaves each alone (DistributedType.NO) there;
    ``cpu=True`` makes them one gloo process group (MULTI_CPU) instead.
    """
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.accelerator.is_available()


def resolve_config(argv: list[str] | None) -> tuple[TrainConfig, RunOptions]:
    """Defaults <- --config <- flags; with --resume the run's saved config takes the place of the defaults."""
    from_file, from_flags, options = parse_args(argv)
    config = make_config(from_file, from_flags)
    run_dir = config.resolved_run_dir
    if options.resume and ckpt.is_run_dir(run_dir):
        saved = make_config(read_yaml(run_dir / ckpt.CONFIG_FILE))
        config = make_config(saved.to_dict(), from_file, from_flags)
        changes = changed_keys(saved, config)
        if changes and PartialState(cpu=launched_without_accelerator()).is_main_process:
            print(f"resuming {run_dir} with changed settings: {'; '.join(changes)}")
    config.run_dir = str(run_dir)
    return config, options


def load_data(accelerator: Accelerator, config: TrainConfig, download: bool) -> DataSplits:
    """The main process loads (and downloads) first; the others then read what it left on disk."""
    splits, error = None, None
    if accelerator.is_main_process:
        try:
            splits = load_splits(config, download)
        except DataError as caught:
            error = caught
    accelerator.wait_for_everyone()
    if error is not None:
        raise error
    return splits if splits is not None else load_splits(config, download=False)


def build_model(config: TrainConfig, num_classes: int) -> nn.Module:
    try:
        return timm.create_model(config.model, **config.model_kwargs_for_timm(num_classes))
    except (ValueError, TypeError) as error:
        raise ConfigError(f"model {config.model!r} cannot be built from this config: {error}") from None


def build_optimizer(config: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    try:
        return create_optimizer_v2(model, opt=config.opt, lr=config.lr, weight_decay=config.weight_decay, **config.opt_kwargs)
    except TypeError as error:
        raise ConfigError(f"opt_kwargs: {error}") from None


def build_loaders(config: TrainConfig, splits: DataSplits, num_processes: int) -> tuple[DataLoader, DataLoader]:
    global_batch = config.batch_size * num_processes
    if len(splits.train) < global_batch:
        raise ConfigError(
            f"batch_size: {config.batch_size} x {num_processes} process(es) is more than the {len(splits.train)} "
            "training images; no full batch to train on"
        )
    train_set = TransformedDataset(splits.train, build_transform(config, splits, training=True), seed=config.seed)
    eval_set = TransformedDataset(splits.eval, build_transform(config, splits, training=False), seed=None)
    # Own generators, so that creating a loader iterator never draws from the process RNG.
    common = dict(batch_size=config.batch_size, num_workers=config.num_workers, pin_memory=torch.cuda.is_available())
    train_loader = DataLoader(
        train_set, shuffle=True, drop_last=True, generator=torch.Generator().manual_seed(config.seed), **common
    )
    eval_loader = DataLoader(eval_set, shuffle=False, generator=torch.Generator().manual_seed(config.seed), **common)
    return train_loader, eval_loader


def build_mixup(config: TrainConfig, num_classes: int) -> Mixup | None:
    if config.mixup == 0 and config.cutmix == 0:
        return None
    return Mixup(
        mixup_alpha=config.mixup, cutmix_alpha=config.cutmix, prob=config.mixup_prob,
        switch_prob=config.mixup_switch_prob, label_smoothing=config.label_smoothing, num_classes=num_classes,
    )


def write_run_files(run_dir: Path, config: TrainConfig, model_kwargs: dict[str, Any]) -> None:
    ckpt.write_atomically(run_dir / ckpt.CONFIG_FILE, config_yaml(config))
    ckpt.write_model_file(run_dir, config.model, model_kwargs)


def new_trainer_state(num_processes: int) -> dict[str, Any]:
    """Where the run stands; JSON in every checkpoint. ``batch``: batches of ``epoch`` already trained."""
    return dict(
        epoch=0, batch=0, update=0, num_processes=num_processes, best_acc=None, best_epoch=None, history=[],
        partial_loss_sum=0.0, partial_samples=0, partial_train_time=0.0,
    )


@torch.no_grad()
def evaluate(accelerator: Accelerator, model: nn.Module, loader: DataLoader) -> dict[str, float]:
    """Loss and top-1 accuracy over the whole eval set, each sample counted once (gather_for_metrics)."""
    model.eval()
    loss_sum = correct = count = 0.0
    for images, targets in loader:
        logits, targets = accelerator.gather_for_metrics((model(images), targets))
        loss_sum += F.cross_entropy(logits.float(), targets, reduction="sum").item()
        correct += (logits.argmax(dim=-1) == targets).sum().item()
        count += len(targets)
    return dict(eval_loss=loss_sum / count, eval_acc=correct / count, eval_samples=int(count))


@dataclass
class Training:
    """The prepared pieces of a run, and ``state``: where it stands (saved as JSON in every checkpoint)."""

    accelerator: Accelerator
    config: TrainConfig
    run_dir: Path
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Scheduler
    criterion: nn.Module
    mixup: Mixup | None
    train_loader: DataLoader
    eval_loader: DataLoader
    state: dict[str, Any]


def train_epoch(run: Training, epoch: int) -> tuple[float, int, float]:
    """Train ``epoch`` (its remaining batches, when resumed mid-epoch), checkpointing every
    ``save_every`` updates. Returns the epoch's loss sum and image count over all processes, and seconds."""
    accelerator, config, state, loader = run.accelerator, run.config, run.state, run.train_loader
    loader.set_epoch(epoch)  # the seeded sampler's order for this epoch
    loader.dataset.set_epoch(epoch)  # the augmentation seeds for this epoch
    skip = state["batch"]
    batches = accelerator.skip_first_batches(loader, skip) if skip else loader
    # (loss sum, images): a mid-epoch checkpoint carries the global sums so far, restored on the main process
    sums = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
    if accelerator.is_main_process:
        sums += torch.tensor([state["partial_loss_sum"], state["partial_samples"]], dtype=torch.float64, device=sums.device)
    train_time = state["partial_train_time"]
    run.model.train()
    progress = tqdm(total=len(loader), initial=skip, desc=f"epoch {epoch + 1}/{config.epochs}",
                    disable=not accelerator.is_local_main_process, dynamic_ncols=True)
    tick = time.perf_counter()
    for batch_index, (images, targets) in enumerate(batches, start=skip):
        if run.mixup is not None:
            images, targets = run.mixup(images, targets)
        with accelerator.accumulate(run.model):
            loss = run.criterion(run.model(images), targets)
            accelerator.backward(loss)
            if accelerator.sync_gradients and config.clip_grad is not None:
                accelerator.clip_grad_norm_(run.model.parameters(), config.clip_grad)
            run.optimizer.step()
            run.optimizer.zero_grad()
        sums[0] += loss.detach().double() * len(images)
        sums[1] += len(images)
        progress.update(1)
        if batch_index % 10 == 0:
            progress.set_postfix(loss=f"{loss.item():.3f}", lr=f"{run.optimizer.param_groups[0]['lr']:.2e}")
        if not accelerator.sync_gradients:
            continue
        state["update"] += 1
        run.scheduler.step_update(state["update"])
        last_batch = batch_index + 1 == len(loader)  # the end-of-epoch checkpoint follows
        if config.save_every and state["update"] % config.save_every == 0 and not last_batch:
            train_time += time.perf_counter() - tick
            totals = accelerator.reduce(sums, reduction="sum")
            state.update(batch=batch_index + 1, partial_loss_sum=totals[0].item(),
                         partial_samples=int(totals[1].item()), partial_train_time=train_time)
            ckpt.save_checkpoint(accelerator, run.run_dir, state, config.keep_checkpoints)
            tick = time.perf_counter()
    progress.close()
    train_time += time.perf_counter() - tick
    totals = accelerator.reduce(sums, reduction="sum")
    return totals[0].item(), int(totals[1].item()), train_time


def finish_epoch(run: Training, epoch: int, loss_sum: float, images: int, train_time: float) -> None:
    """Evaluate, log, write the best and last weights, checkpoint the end of ``epoch``."""
    accelerator, state = run.accelerator, run.state
    peak_mib, mem_kind = run_log.peak_memory_mib(accelerator.device)
    record = dict(
        epoch=epoch + 1, update=state["update"], train_loss=loss_sum / images,
        **evaluate(accelerator, run.model, run.eval_loader),
        lr=run.optimizer.param_groups[0]["lr"], train_images=images, train_time_s=train_time,
        images_per_s=images / train_time, peak_mem_mib=peak_mib, mem_kind=mem_kind,
    )
    state["history"].append(record)
    accelerator.print(
        f"epoch {epoch + 1}: train loss {record['train_loss']:.4f}, eval loss {record['eval_loss']:.4f}, "
        f"eval acc {100 * record['eval_acc']:.2f}%, {record['images_per_s']:.0f} img/s, lr {record['lr']:.2e}, "
        f"peak mem {peak_mib:.0f} MiB"
    )
    if state["best_acc"] is None or record["eval_acc"] > state["best_acc"]:
        state.update(best_acc=record["eval_acc"], best_epoch=epoch + 1)
        ckpt.save_weights(accelerator, run.model, run.run_dir / ckpt.BEST_WEIGHTS)
    ckpt.save_weights(accelerator, run.model, run.run_dir / ckpt.LAST_WEIGHTS)
    state.update(epoch=epoch + 1, batch=0, partial_loss_sum=0.0, partial_samples=0, partial_train_time=0.0)
    ckpt.save_checkpoint(accelerator, run.run_dir, state, run.config.keep_checkpoints)
    if accelerator.is_main_process:
        run_log.write_metrics(run.run_dir, state["history"])
    accelerator.log({key: value for key, value in record.items() if isinstance(value, (int, float))}, step=epoch + 1)


def summarize(run: Training, seconds: float) -> dict[str, Any]:
    history, config = run.state["history"], run.config
    return dict(
        dataset=config.dataset, attn=config.attn, epochs=config.epochs, num_processes=run.accelerator.num_processes,
        test_acc=history[-1]["eval_acc"], best_acc=run.state["best_acc"], best_epoch=run.state["best_epoch"],
        images_per_s=sum(r["train_images"] for r in history) / sum(r["train_time_s"] for r in history),
        peak_mem_mib=max(r["peak_mem_mib"] for r in history), mem_kind=history[-1]["mem_kind"],
        wall_time_s=seconds,
    )


def training_function(config: TrainConfig, options: RunOptions) -> dict[str, Any]:
    started = time.perf_counter()
    run_dir = Path(config.run_dir)
    accelerator = Accelerator(
        cpu=launched_without_accelerator(),
        mixed_precision=config.mixed_precision,
        gradient_accumulation_steps=config.grad_accum_steps,
        log_with=config.log_with or None,
        project_config=ProjectConfiguration(project_dir=str(run_dir), logging_dir=str(run_dir / "tensorboard")),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=config.seed),
    )
    main = accelerator.is_main_process

    # Build and check everything before the run directory is touched.
    splits = load_data(accelerator, config, options.download)
    set_seed(config.seed)  # the same initial weights on every process
    model = build_model(config, splits.num_classes)
    if config.attn == "auto":  # record the choice: another machine's calibration may choose differently
        chosen = [block.attn.name for block in model.blocks]
        config.attn = chosen[0] if len(set(chosen)) == 1 else chosen
        accelerator.print(f"attn auto: {config.attn}")
    model_kwargs = config.model_kwargs_for_timm(splits.num_classes)
    train_loader, eval_loader = build_loaders(config, splits, accelerator.num_processes)
    optimizer = build_optimizer(config, model)
    resume_from = ckpt.check_run_dir(run_dir, options.resume, options.overwrite)
    accelerator.wait_for_everyone()  # every process has checked the run directory before it changes
    if main and resume_from is None:
        ckpt.start_run_dir(run_dir, options.overwrite)
        write_run_files(run_dir, config, model_kwargs)
    accelerator.wait_for_everyone()

    model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)
    # timm's scheduler is stateless but for the update count, which the trainer state carries.
    scheduler, _ = create_scheduler_v2(
        optimizer, sched=config.sched, num_epochs=config.epochs, warmup_epochs=config.warmup_epochs,
        warmup_lr=config.warmup_lr, min_lr=config.min_lr, step_on_epochs=False,
        updates_per_epoch=math.ceil(len(train_loader) / config.grad_accum_steps),
    )
    mixup = build_mixup(config, splits.num_classes)
    set_seed(config.seed + accelerator.process_index)  # dropout, drop path and mixup differ per process
    run = Training(
        accelerator=accelerator, config=config, run_dir=run_dir, model=model, optimizer=optimizer,
        scheduler=scheduler, criterion=nn.CrossEntropyLoss(label_smoothing=0.0 if mixup else config.label_smoothing),
        mixup=mixup, train_loader=train_loader, eval_loader=eval_loader,
        state=new_trainer_state(accelerator.num_processes),
    )
    if resume_from is not None:
        run.state = ckpt.load_checkpoint(accelerator, resume_from)
        state = run.state
        accelerator.print(f"resumed from {resume_from} (epoch {state['epoch'] + 1}, batch {state['batch']}, update {state['update']})")
        if main:  # only now that the checkpoint has loaded into this config's model
            write_run_files(run_dir, config, model_kwargs)
    scheduler.step_update(run.state["update"])
    if main:
        run_log.write_metrics(run_dir, run.state["history"])  # a resumed run redoes what came after its checkpoint
    if config.log_with:
        accelerator.init_trackers("visattn", config={key: value if isinstance(value, (int, float, str, bool)) else str(value)
                                                     for key, value in config.to_dict().items()})

    for epoch in range(run.state["epoch"], config.epochs):
        run_log.reset_peak_memory(accelerator.device)
        loss_sum, images, train_time = train_epoch(run, epoch)
        finish_epoch(run, epoch, loss_sum, images, train_time)

    summary = summarize(run, time.perf_counter() - started)
    if main:
        run_log.write_summary(run_dir, summary)
        run_log.plot_metrics(run_dir, run.state["history"])
    accelerator.print(
        f"test accuracy: {100 * summary['test_acc']:.2f}% (best {100 * summary['best_acc']:.2f}% at epoch "
        f"{summary['best_epoch']}); {summary['images_per_s']:.0f} train img/s; run directory: {run_dir}"
    )
    accelerator.end_training()
    return summary


def main(argv: list[str] | None = None) -> int:
    try:
        config, options = resolve_config(argv)
        training_function(config, options)
    except (ConfigError, DataError, ckpt.RunDirError) as error:
        # Every process reports: a launcher stops the others as soon as one exits, main process included.
        state = PartialState(cpu=launched_without_accelerator())
        where = "" if state.num_processes == 1 else f"[process {state.process_index}] "
        print(f"{where}error: {error}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
