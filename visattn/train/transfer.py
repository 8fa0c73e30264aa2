"""The attention-transfer stage of a run (``--transfer-epochs``), before the fine-tune epochs.

The run's model is the converted one, loaded with the initial weights; its parent is the same model with
softmax attention, loaded with the same weights and, where they are a visattn softmax run's, with the attention
options that run was trained with, its rope among them (:func:`build_parent`). Each transfer step trains the
converted attention layers to reproduce the parent's attention outputs on the step's training images
(:class:`visattn.models.AttentionTransfer`), with an optimizer of its own over those layers' parameters
(AdamW, constant learning rate, no weight decay), prepared by accelerate like the fine-tune's so that both
are in every checkpoint. The stage checkpoints as the epochs do (every ``save_every`` transfer updates and
at the end of each transfer epoch), and ``--resume`` picks it up where it stopped. Each transfer epoch
writes a record to ``transfer_metrics.jsonl``: the mean training MSE of every block
(``transfer_loss_block<i>``) and its MSE on the selection split (``val_transfer_loss_block<i>``, or
``test_`` for a dataset without validation).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from visattn.models import AttentionTransfer, create_model
from visattn.models.transfer import check_something_to_learn, trainable_attention_parameters
from visattn.predict import read_model_file
from visattn.train import checkpoint as ckpt
from visattn.train import run_log
from visattn.train.config import ConfigError, TrainConfig
from visattn.train.initial import InitialWeights, load_initial_weights, read_initial_weights
from visattn.train.loop import POSTFIX_SECONDS, NonFiniteError, Training, evaluate, test_scores
from visattn.train.run_dir import is_run_dir

# The attention the parent runs: what timm's Attention computes, with visattn's grid hook.
PARENT_ATTENTION = "softmax"


def build_transfer_optimizer(config: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    """AdamW over the parameters attention transfer trains; ConfigError (one line) when there are none."""
    try:
        check_something_to_learn(model, config.transfer_projections)
    except ValueError as error:
        raise ConfigError(f"transfer_epochs: {error}") from None
    params = [param for block in trainable_attention_parameters(model, config.transfer_projections) for param in block]
    return torch.optim.AdamW(params, lr=config.transfer_lr, weight_decay=0.0)


def parent_attention_options(config: TrainConfig) -> dict[str, Any]:
    """The options of the parent's softmax attention: those a visattn softmax run recorded in its model.json
    (its rope, ...) where the initial weights are that run's, else none (a weights file records none)."""
    start = config.initial_checkpoint
    if start is None or not is_run_dir(Path(start)):
        return {}
    try:
        recorded = read_model_file(start)["kwargs"]
    except (OSError, ValueError) as error:
        raise ConfigError(f"initial_checkpoint: {error}") from None
    return dict(recorded.get("attn_kwargs") or {}) if recorded.get("attn") == PARENT_ATTENTION else {}


def build_parent(config: TrainConfig, num_classes: int, initial: InitialWeights, device: torch.device) -> nn.Module:
    """The run's model with softmax attention, the options its weights were trained with
    (:func:`parent_attention_options`) and the initial weights, frozen, in eval mode, on ``device``."""
    kwargs = config.model_kwargs_for_timm(num_classes) | {"attn": PARENT_ATTENTION,
                                                          "attn_kwargs": parent_attention_options(config)}
    kwargs.pop("auto_batch_size", None)
    parent = create_model(config.model, **kwargs)
    load_initial_weights(parent, initial)
    return parent.to(device).eval().requires_grad_(False)


@dataclass
class TransferStage:
    """The transfer's pieces: the losses, the prepared optimizer, and the stage's length in updates."""

    transfer: AttentionTransfer
    optimizer: torch.optim.Optimizer
    total_steps: int


def run_transfer_stage(run: Training, optimizer: torch.optim.Optimizer | None, num_classes: int,
                       initial: InitialWeights | None) -> None:
    """What remains of the run's attention-transfer stage (nothing without ``transfer_epochs``, or once it has
    ended): its parent built from the ``initial`` weights (read again when a resumed run needs them), the
    converted layers trained against it with the prepared ``optimizer``."""
    config = run.config
    if not config.transfer_epochs or run.state["transfer_epoch"] >= config.transfer_epochs:
        return
    parent = build_parent(config, num_classes, initial or read_initial_weights(config), run.accelerator.device)
    transfer = AttentionTransfer(parent, run.accelerator.unwrap_model(run.model), config.transfer_mode,
                                 config.transfer_projections)
    run_transfer(run, TransferStage(transfer, optimizer, config.transfer_epochs * len(run.train_loader)))


def run_transfer(run: Training, stage: TransferStage) -> None:
    """The remaining transfer epochs; the last one ends with :func:`evaluate_transferred`."""
    for epoch in range(run.state["transfer_epoch"], run.config.transfer_epochs):
        train_seconds = transfer_epoch(run, stage, epoch)
        finish_transfer_epoch(run, stage, epoch, train_seconds)


def evaluate_transferred(run: Training) -> None:
    """The accuracy of the transferred model on the selection split (``transfer_eval_acc`` in the trainer state,
    ``transfer_acc`` in the summary) and, with ``test_every_epoch``, on the test split (``transfer_test_acc`` in
    both)."""
    scores = evaluate(run.accelerator, run.model, run.selection_loader)
    run.state["transfer_eval_acc"] = scores["acc"]
    if run.config.test_every_epoch:
        test = test_scores(run.accelerator, run.model, run.selection_split, run.eval_loader, scores)
        run.state["transfer_test_acc"] = test["acc"]
    run.accelerator.print(
        f"after attention transfer: {run.selection_split} loss {scores['loss']:.4f}, "
        f"{run.selection_split} acc {100 * scores['acc']:.2f}%"
    )


def transfer_epoch(run: Training, stage: TransferStage, epoch: int) -> float:
    """Train transfer epoch ``epoch`` (its remaining batches, when resumed mid-epoch). Returns its seconds."""
    accelerator, config, state, loader = run.accelerator, run.config, run.state, run.train_loader
    depth = stage.transfer.depth
    loader.set_epoch(epoch)
    loader.dataset.set_epoch(epoch)
    skip = state["transfer_batch"]
    batches = accelerator.skip_first_batches(loader, skip) if skip else loader
    # per block: the loss sum and steps so far; a mid-epoch checkpoint carries the sums over all processes,
    # restored on the main process
    sums = torch.zeros(depth, dtype=torch.float64, device=accelerator.device)
    counts = torch.zeros(depth, dtype=torch.int64, device=accelerator.device)
    if accelerator.is_main_process and state["transfer_partial_sums"]:
        sums += torch.tensor(state["transfer_partial_sums"], dtype=torch.float64, device=accelerator.device)
        counts += torch.tensor(state["transfer_partial_counts"], dtype=torch.int64, device=accelerator.device)
    train_time = state["transfer_partial_time"]
    params = stage.transfer.parameters()
    run.model.train()
    progress = tqdm(total=len(loader), initial=skip, desc=f"transfer {epoch + 1}/{config.transfer_epochs}",
                    disable=not accelerator.is_local_main_process, dynamic_ncols=True)
    tick = shown = time.perf_counter()
    shown -= POSTFIX_SECONDS
    for batch_index, (images, _) in enumerate(batches, start=skip):
        blocks = stage.transfer.blocks_at(state["transfer_update"], stage.total_steps)
        with accelerator.autocast():
            losses = stage.transfer.losses(images, blocks)  # (len(blocks),)
        accelerator.backward(losses.sum())
        if accelerator.num_processes > 1:  # the layers run outside the model's DDP wrapper: average by hand
            for param in params:
                if param.grad is not None:
                    param.grad = accelerator.reduce(param.grad, reduction="mean")
        stage.optimizer.step()
        stage.optimizer.zero_grad(set_to_none=True)
        stage.transfer.add_losses(sums, counts, blocks, losses)
        state["transfer_update"] += 1
        progress.update(1)
        last_batch = batch_index + 1 == len(loader)
        if time.perf_counter() - shown >= POSTFIX_SECONDS or last_batch:
            _check_finite(run, stage, sums, progress)
            progress.set_postfix(mse=f"{losses.detach().mean().item():.3g}", blocks=",".join(map(str, blocks)))
            shown = time.perf_counter()
        if config.save_every and state["transfer_update"] % config.save_every == 0 and not last_batch:
            train_time += time.perf_counter() - tick
            _check_finite(run, stage, sums, progress)
            state.update(transfer_batch=batch_index + 1, transfer_partial_time=train_time,
                         transfer_partial_sums=accelerator.reduce(sums, reduction="sum").tolist(),
                         transfer_partial_counts=accelerator.reduce(counts, reduction="sum").tolist())
            ckpt.save_checkpoint(accelerator, run.run_dir, state, config.keep_checkpoints)
            tick = time.perf_counter()
    progress.close()
    train_time += time.perf_counter() - tick
    sums, counts = accelerator.reduce(sums, reduction="sum"), accelerator.reduce(counts, reduction="sum")
    state.update(transfer_partial_sums=sums.tolist(), transfer_partial_counts=counts.tolist())
    return train_time


def finish_transfer_epoch(run: Training, stage: TransferStage, epoch: int, train_time: float) -> None:
    """Per-block MSE on the selection split; the epoch's record, printed and written; after the last epoch, the
    transferred model's accuracy (:func:`evaluate_transferred`); a checkpoint."""
    accelerator, state, split = run.accelerator, run.state, run.selection_split
    eval_started = time.perf_counter()
    held_out = held_out_losses(run, stage.transfer, run.selection_loader)
    eval_time = time.perf_counter() - eval_started
    train = [total / count if count else float("nan")
             for total, count in zip(state["transfer_partial_sums"], state["transfer_partial_counts"])]
    # the training loader drops its last partial batch: every step of every process takes a full one
    images = len(run.train_loader) * run.config.batch_size * accelerator.num_processes
    record: dict[str, Any] = dict(transfer_epoch=epoch + 1, transfer_update=state["transfer_update"],
                                  mode=stage.transfer.mode, lr=stage.optimizer.param_groups[0]["lr"],
                                  train_images=images)
    record |= {f"transfer_loss_block{index}": value for index, value in enumerate(train)}
    record |= {f"{split}_transfer_loss_block{index}": value for index, value in enumerate(held_out)}
    record |= dict(train_time_s=train_time, eval_time_s=eval_time)
    state["transfer_history"].append(record)
    accelerator.print(
        f"transfer epoch {epoch + 1}: attention output MSE per block, train "
        f"{' '.join(f'{value:.3g}' for value in train)}, {split} {' '.join(f'{value:.3g}' for value in held_out)}; "
        f"{train_time:.1f} s training + {eval_time:.1f} s {split}"
    )
    state.update(transfer_epoch=epoch + 1, transfer_batch=0, transfer_partial_sums=[], transfer_partial_counts=[],
                 transfer_partial_time=0.0)
    if epoch + 1 == run.config.transfer_epochs:  # before the stage's last checkpoint: a resume from it has them
        evaluate_transferred(run)
    ckpt.save_checkpoint(accelerator, run.run_dir, state, run.config.keep_checkpoints)
    if accelerator.is_main_process:
        run_log.write_transfer_metrics(run.run_dir, state["transfer_history"])


@torch.no_grad()
def held_out_losses(run: Training, transfer: AttentionTransfer, loader: DataLoader) -> list[float]:
    """Every block's mean attention-output MSE over ``loader``'s split (NaN for a block with nothing to
    train), the model in eval mode; summed over the processes."""
    accelerator = run.accelerator
    run.model.eval()
    sums = torch.zeros(len(transfer.trained_blocks), dtype=torch.float64, device=accelerator.device)
    count = torch.zeros((), dtype=torch.int64, device=accelerator.device)
    for images, _ in loader:
        with accelerator.autocast():
            sums += transfer.losses(images).double() * len(images)
        count += len(images)
    sums, count = accelerator.reduce(sums, reduction="sum"), accelerator.reduce(count, reduction="sum").item()
    means = [float("nan")] * transfer.depth
    for index, total in zip(transfer.trained_blocks, sums.tolist()):
        means[index] = total / max(count, 1)
    return means


def _check_finite(run: Training, stage: TransferStage, sums: torch.Tensor, progress: tqdm) -> None:
    """Refuses to go on (and so to save) when a transfer loss or a trained weight is not finite: an update with
    finite losses can still overflow the weights."""
    weights = torch.stack(torch._foreach_norm([param.detach() for param in stage.transfer.parameters()]))
    if not (torch.isfinite(sums).all() and weights.isfinite().all()):
        progress.close()
        raise NonFiniteError(
            f"attention transfer update {run.state['transfer_update']} (transfer epoch {run.state['transfer_epoch'] + 1}): "
            "the loss or the transferred weights are not finite; nothing of it was saved. Lower --transfer-lr"
        )
