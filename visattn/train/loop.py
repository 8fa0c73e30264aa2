"""The training loop: one epoch of updates with mid-epoch checkpoints, then evaluation, metrics, the
best and last weights and an end-of-epoch checkpoint; the summary of a finished run."""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator
from timm.data import Mixup
from timm.scheduler.scheduler import Scheduler
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from visattn.predict import BEST_WEIGHTS, LAST_WEIGHTS
from visattn.train import checkpoint as ckpt
from visattn.train import run_log
from visattn.train.config import TrainConfig, config_yaml
from visattn.train.data import DataSplits, eval_data_config

# The loss and learning rate in the progress bar are refreshed at most this often.
POSTFIX_SECONDS = 0.5


def write_run_files(run_dir: Path, config: TrainConfig, model_kwargs: dict[str, Any], splits: DataSplits) -> None:
    """The effective config (what --resume reads) and model.json (what visattn.predict reads)."""
    ckpt.write_atomically(run_dir / ckpt.CONFIG_FILE, config_yaml(config))
    ckpt.write_model_file(run_dir, config.model, model_kwargs, eval_data_config(config, splits), splits.named_classes())


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
    tick = shown = time.perf_counter()
    shown -= POSTFIX_SECONDS  # the first step's loss is shown at once
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
        if time.perf_counter() - shown >= POSTFIX_SECONDS or batch_index + 1 == len(loader):
            # by time, not every step: reading the loss waits for the device
            progress.set_postfix(loss=f"{loss.item():.3f}", lr=f"{run.optimizer.param_groups[0]['lr']:.2e}")
            shown = time.perf_counter()
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
        ckpt.save_weights(accelerator, run.model, run.run_dir / BEST_WEIGHTS)
    ckpt.save_weights(accelerator, run.model, run.run_dir / LAST_WEIGHTS)
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
