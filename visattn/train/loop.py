"""The training loop: one epoch of updates with mid-epoch checkpoints, then evaluation on the validation
split, metrics, the best (by validation accuracy) and last weights and an end-of-epoch checkpoint; the
test split evaluated once on the best weights, and the summary of a finished run."""
from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator
from safetensors.torch import load_file
from timm.data import Mixup
from timm.scheduler.scheduler import Scheduler
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from visattn.models.lora import adapted_state_dict
from visattn.predict import BEST_WEIGHTS, LAST_WEIGHTS
from visattn.train import checkpoint as ckpt
from visattn.train import run_log
from visattn.train.config import TrainConfig
from visattn.train.data import describe_unreadable

# The loss and learning rate in the progress bar are refreshed at most this often.
POSTFIX_SECONDS = 0.5


def new_trainer_state(num_processes: int) -> dict[str, Any]:
    """Where the run stands; JSON in every checkpoint. ``batch``: batches of ``epoch`` already trained;
    ``skipped_updates``: updates left out under ``--skip-nonfinite``; the ``transfer_*`` entries: the same for
    the attention-transfer stage (:mod:`visattn.train.transfer`), whose updates are not counted in ``update``
    (the fine-tune's learning-rate schedule starts after them)."""
    return dict(
        epoch=0, batch=0, update=0, num_processes=num_processes, best_acc=None, best_epoch=None, history=[],
        partial_loss_sum=0.0, partial_samples=0, partial_train_time=0.0, skipped_updates=0,
        transfer_epoch=0, transfer_batch=0, transfer_update=0, transfer_history=[], transfer_partial_sums=[],
        transfer_partial_counts=[], transfer_partial_time=0.0,
    )


class NonFiniteError(RuntimeError):
    """A loss, gradient or weight is not finite; the message names the update and the last good checkpoint."""


def _last_good_checkpoint(run_dir: Path) -> str:
    checkpoints = ckpt.list_checkpoints(run_dir)
    return f"last good checkpoint: {checkpoints[-1]}" if checkpoints else "no checkpoint written yet"


def nonfinite_update(run: Training, loss_is_finite: torch.Tensor) -> torch.Tensor:
    """Whether the update about to be applied has a non-finite loss (``loss_is_finite``: a bool tensor over
    its micro-batches) or gradient, on any process: a bool tensor on the device, left there (reading it waits
    for the step). Under fp16 mixed precision the gradients are left to accelerate's gradient scaler, which
    skips the steps whose scaled gradients overflow."""
    accelerator = run.accelerator
    bad = (~loss_is_finite).to(accelerator.device, torch.float32)
    if accelerator.scaler is None:
        grads = [p.grad for p in run.model.parameters() if p.grad is not None]
        if grads:
            bad = bad + (~torch.stack(torch._foreach_norm(grads)).isfinite()).any().float()
    if accelerator.num_processes > 1:
        bad = accelerator.reduce(bad, reduction="sum")
    return bad > 0


class NonfiniteWatch:
    """The first non-finite update of an epoch, kept on the device so that no step waits for it, and read
    (:meth:`check`) only where the run must know: at the progress bar's refresh, before a checkpoint, at the
    epoch's end. An update with a non-finite loss or gradient does reach the weights in memory; the run then
    stops at the next read, before anything of them is saved."""

    def __init__(self, device: torch.device) -> None:
        self.update = torch.full((), -1, dtype=torch.int64, device=device)  # -1: none yet
        self.loss_was_finite = torch.ones((), dtype=torch.bool, device=device)

    def note(self, bad: torch.Tensor, update: int, loss_is_finite: torch.Tensor) -> None:
        """Records update number ``update`` if ``bad`` (a device bool) and it is the first bad one."""
        first = bad & (self.update < 0)
        self.update = torch.where(first, update, self.update)
        self.loss_was_finite = torch.where(first, loss_is_finite, self.loss_was_finite)

    def check(self, run: Training, progress: tqdm) -> None:
        """NonFiniteError naming the first bad update, if there was one."""
        update = int(self.update.item())
        if update >= 0:
            refuse_nonfinite(run, update, "a gradient" if self.loss_was_finite.item() else "the loss", progress)


def refuse_nonfinite(run: Training, update: int, what: str, progress: tqdm) -> None:
    """Stops the run, saying which update went wrong and where to resume from (below the closed progress bar)."""
    progress.close()
    raise NonFiniteError(
        f"update {update} (epoch {run.state['epoch'] + 1}): {what} is not finite; stopped before anything of it "
        f"was saved; {_last_good_checkpoint(run.run_dir)}. Lower --lr or set --clip-grad, or pass "
        "--skip-nonfinite to skip such updates"
    )


def check_finite_weights(run: Training, progress: tqdm | None = None) -> None:
    """Refuses to save weights that are not finite (an update with finite gradients can still overflow them)."""
    params = [p.detach() for p in run.model.parameters()]
    if not torch.stack(torch._foreach_norm(params)).isfinite().all():
        if progress is not None:
            progress.close()
        raise NonFiniteError(
            f"after update {run.state['update']} (epoch {run.state['epoch'] + 1}) the weights are not finite; "
            f"nothing was saved; {_last_good_checkpoint(run.run_dir)}. Lower --lr"
        )


@torch.no_grad()
def evaluate(accelerator: Accelerator, model: nn.Module, loader: DataLoader) -> dict[str, float]:
    """Loss and top-1 accuracy over the whole of ``loader``'s split, each sample counted once (gather_for_metrics)."""
    model.eval()
    # summed on the device, read once at the end: no batch waits for the one before
    loss_sum = torch.zeros((), dtype=torch.float64, device=accelerator.device)
    correct = torch.zeros((), dtype=torch.int64, device=accelerator.device)
    count = 0
    for images, targets in loader:
        logits, targets = accelerator.gather_for_metrics((model(images), targets))
        loss_sum += F.cross_entropy(logits.float(), targets, reduction="sum")
        correct += (logits.argmax(dim=-1) == targets).sum()
        count += len(targets)
    return dict(loss=loss_sum.item() / count, acc=correct.item() / count, samples=count)


def test_scores(accelerator: Accelerator, model: nn.Module, selection_split: str, eval_loader: DataLoader,
                selection_scores: dict[str, float]) -> dict[str, float]:
    """The test split's scores of ``model`` as it stands, given its ``selection_scores``: those where the test
    split is the one evaluated every epoch, else an evaluation of the test split."""
    return selection_scores if selection_split == "test" else evaluate(accelerator, model, eval_loader)


@dataclass
class Training:
    """The prepared pieces of a run, and ``state``: where it stands (saved as JSON in every checkpoint).

    ``selection_loader`` is evaluated every epoch and chooses the best weights: the validation split
    (``selection_split`` "val"), or the test split (``eval_loader``, "test") for a dataset without one.
    ``skipped_images``: the image files left out as unreadable (path -> what is wrong), under skip_bad_images.
    """

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
    selection_loader: DataLoader
    selection_split: str
    skipped_images: dict[str, str] = field(default_factory=dict)


def train_epoch(run: Training, epoch: int) -> tuple[float, int, float]:
    """Train ``epoch`` (its remaining batches, when resumed mid-epoch), checkpointing every
    ``save_every`` updates. Returns the epoch's loss sum and image count over all processes, and seconds."""
    accelerator, config, state, loader = run.accelerator, run.config, run.state, run.train_loader
    batches, skip, sums = _start_epoch(run, epoch)
    train_time = state["partial_train_time"]
    run.model.train()
    progress = tqdm(total=len(loader), initial=skip, desc=f"epoch {epoch + 1}/{config.epochs}",
                    disable=not accelerator.is_local_main_process, dynamic_ncols=True)
    tick = shown = time.perf_counter()
    shown -= POSTFIX_SECONDS  # the first step's loss is shown at once
    # the update's micro-batches so far: whether every loss was finite, and their (loss sum, images), added
    # to ``sums`` once the update is applied
    loss_is_finite = torch.ones((), dtype=torch.bool, device=accelerator.device)
    pending = torch.zeros_like(sums)
    watch = NonfiniteWatch(accelerator.device)
    for batch_index, (images, targets) in enumerate(batches, start=skip):
        loss, skipped = _train_step(run, images, targets, loss_is_finite, watch)
        pending[0] += loss.detach().double() * len(images)
        pending[1] += len(images)
        if accelerator.sync_gradients:
            _settle_update(run, skipped, sums, pending, loss_is_finite)
        progress.update(1)
        if time.perf_counter() - shown >= POSTFIX_SECONDS or batch_index + 1 == len(loader):
            # by time, not every step: reading the loss waits for the device
            watch.check(run, progress)
            progress.set_postfix(loss=f"{loss.item():.3f}", lr=f"{run.optimizer.param_groups[0]['lr']:.2e}")
            shown = time.perf_counter()
        if not accelerator.sync_gradients or skipped:
            continue
        state["update"] += 1
        run.scheduler.step_update(state["update"])
        last_batch = batch_index + 1 == len(loader)  # the end-of-epoch checkpoint follows
        if config.save_every and state["update"] % config.save_every == 0 and not last_batch:
            train_time += time.perf_counter() - tick
            _save_mid_epoch(run, batch_index + 1, sums, train_time, watch, progress)
            tick = time.perf_counter()
    watch.check(run, progress)
    progress.close()
    train_time += time.perf_counter() - tick
    totals = accelerator.reduce(sums, reduction="sum")
    return totals[0].item(), int(totals[1].item()), train_time


def _start_epoch(run: Training, epoch: int) -> tuple[Iterable[Any], int, torch.Tensor]:
    """The loader set to ``epoch``: (its batches still to train, the batches already trained, the (loss sum,
    images) so far: a mid-epoch checkpoint carries the global sums, restored on the main process)."""
    accelerator, state, loader = run.accelerator, run.state, run.train_loader
    loader.set_epoch(epoch)  # the seeded sampler's order for this epoch
    loader.dataset.set_epoch(epoch)  # the augmentation seeds for this epoch
    skip = state["batch"]
    batches = accelerator.skip_first_batches(loader, skip) if skip else loader
    sums = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
    if accelerator.is_main_process:
        sums += torch.tensor([state["partial_loss_sum"], state["partial_samples"]], dtype=torch.float64, device=sums.device)
    return batches, skip, sums


def _train_step(run: Training, images: torch.Tensor, targets: torch.Tensor, loss_is_finite: torch.Tensor,
                watch: NonfiniteWatch) -> tuple[torch.Tensor, bool]:
    """One micro-batch: mixup, forward, backward and, where it completes an update, the non-finite check,
    gradient clipping and the optimizer step. ``loss_is_finite`` (the update's so far) is updated in place.
    Returns (the loss, whether the update was skipped under ``skip_nonfinite``)."""
    accelerator, config = run.accelerator, run.config
    if run.mixup is not None:
        images, targets = run.mixup(images, targets)
    with accelerator.accumulate(run.model):
        loss = run.criterion(run.model(images), targets)
        accelerator.backward(loss)
        loss_is_finite &= loss.detach().isfinite()
        skipped = False
        if accelerator.sync_gradients:
            bad = nonfinite_update(run, loss_is_finite)
            if config.skip_nonfinite:
                skipped = bool(bad.item())  # skipping must know before the step: one wait per update
            else:
                watch.note(bad, run.state["update"] + 1, loss_is_finite)
        if accelerator.sync_gradients and config.clip_grad is not None and not skipped:
            accelerator.clip_grad_norm_(run.model.parameters(), config.clip_grad)
        if not skipped:
            run.optimizer.step()
        run.optimizer.zero_grad()
    return loss, skipped


def _settle_update(run: Training, skipped: bool, sums: torch.Tensor, pending: torch.Tensor,
                   loss_is_finite: torch.Tensor) -> None:
    """At the end of an update: its micro-batches' (loss sum, images) ``pending`` added to ``sums``, or the update
    counted as skipped; ``pending`` and ``loss_is_finite`` reset in place for the next one."""
    if skipped:
        run.state["skipped_updates"] = run.state.get("skipped_updates", 0) + 1
        run.accelerator.print(f"update {run.state['update'] + 1}: non-finite loss or gradient, skipped")
    else:
        sums += pending
    pending.zero_()
    loss_is_finite.fill_(True)


def _save_mid_epoch(run: Training, batches_done: int, sums: torch.Tensor, train_time: float, watch: NonfiniteWatch,
                    progress: tqdm) -> None:
    """A checkpoint after ``batches_done`` batches of the epoch, with the global sums and seconds so far; only once
    the watch and the weights show nothing non-finite."""
    accelerator, state = run.accelerator, run.state
    watch.check(run, progress)
    totals = accelerator.reduce(sums, reduction="sum")
    state.update(batch=batches_done, partial_loss_sum=totals[0].item(),
                 partial_samples=int(totals[1].item()), partial_train_time=train_time)
    check_finite_weights(run, progress)
    ckpt.save_checkpoint(accelerator, run.run_dir, state, run.config.keep_checkpoints)


def finish_epoch(run: Training, epoch: int, loss_sum: float, images: int, train_time: float) -> None:
    """Evaluate on the selection split, log, write the best and last weights, checkpoint the end of ``epoch``."""
    accelerator, state, split = run.accelerator, run.state, run.selection_split
    peak_mib, mem_kind = run_log.peak_memory_mib(accelerator.device)
    eval_started = time.perf_counter()
    scores = evaluate(accelerator, run.model, run.selection_loader)
    eval_time = time.perf_counter() - eval_started
    record = dict(
        epoch=epoch + 1, update=state["update"], train_loss=loss_sum / images if images else float("nan"),
        **{f"{split}_{key}": value for key, value in scores.items()},
        lr=run.optimizer.param_groups[0]["lr"], train_images=images, train_time_s=train_time,
        images_per_s=images / train_time if images else 0.0, eval_time_s=eval_time, peak_mem_mib=peak_mib,
        mem_kind=mem_kind,
    )
    if run.config.test_every_epoch and split != "test":
        test_started = time.perf_counter()
        record |= {f"test_{key}": value for key, value in evaluate(accelerator, run.model, run.eval_loader).items()}
        record["test_time_s"] = time.perf_counter() - test_started
    state["history"].append(record)
    accelerator.print(
        f"epoch {epoch + 1}: train loss {record['train_loss']:.4f}, {split} loss {scores['loss']:.4f}, "
        f"{split} acc {100 * scores['acc']:.2f}%, {run_log.significant(record['images_per_s'])} img/s, lr {record['lr']:.2e}, "
        f"peak mem {peak_mib:.0f} MiB, {train_time:.1f} s training + {eval_time:.1f} s {split}"
    )
    check_finite_weights(run)
    if state["best_acc"] is None or scores["acc"] > state["best_acc"]:
        state.update(best_acc=scores["acc"], best_epoch=epoch + 1)
        ckpt.save_weights(accelerator, run.model, run.run_dir / BEST_WEIGHTS)
    ckpt.save_weights(accelerator, run.model, run.run_dir / LAST_WEIGHTS)
    state.update(epoch=epoch + 1, batch=0, partial_loss_sum=0.0, partial_samples=0, partial_train_time=0.0)
    ckpt.save_checkpoint(accelerator, run.run_dir, state, run.config.keep_checkpoints)
    if accelerator.is_main_process:
        run_log.write_metrics(run.run_dir, state["history"])
    accelerator.log({key: value for key, value in record.items() if isinstance(value, (int, float))}, step=epoch + 1)


def test_best_weights(run: Training) -> dict[str, float]:
    """Loads the best weights (chosen on validation) into the model and evaluates them on the test split:
    the run's one look at it. Without a validation split the last epoch's test scores stand, as recorded."""
    if run.selection_split == "test":
        return {key: run.state["history"][-1][f"test_{key}"] for key in ("loss", "acc", "samples")}
    accelerator = run.accelerator
    accelerator.wait_for_everyone()  # the main process has written the best weights
    model = accelerator.unwrap_model(run.model)
    model.load_state_dict(adapted_state_dict(model, load_file(str(run.run_dir / BEST_WEIGHTS))))
    return evaluate(accelerator, run.model, run.eval_loader)


def summarize(run: Training, test: dict[str, float], seconds: float) -> dict[str, Any]:
    """``test``: the test scores of the reported weights (:func:`test_best_weights`)."""
    history, config = run.state["history"], run.config
    return dict(
        dataset=config.dataset, attn=config.attn, epochs=config.epochs, num_processes=run.accelerator.num_processes,
        test_acc=test["acc"], test_loss=test["loss"], test_samples=test["samples"], best_acc=run.state["best_acc"],
        best_epoch=run.state["best_epoch"], selected_on=run.selection_split,
        images_per_s=sum(r["train_images"] for r in history) / sum(r["train_time_s"] for r in history),
        peak_mem_mib=max(r["peak_mem_mib"] for r in history), mem_kind=history[-1]["mem_kind"],
        wall_time_s=seconds, skipped_updates=run.state.get("skipped_updates", 0),
        skipped_images=len(run.skipped_images), skipped_image_files=run.skipped_images,
    )


def finish_run(run: Training, already_finished: bool, seconds: float) -> dict[str, Any]:
    """The run's summary, printed: read back as it stands when nothing was trained (a finished run resumed),
    else the best weights tested once (:func:`test_best_weights`) and the summary and plot written."""
    accelerator, run_dir = run.accelerator, run.run_dir
    summary_file = run_dir / run_log.SUMMARY_FILE
    if already_finished and summary_file.is_file():
        summary = json.loads(summary_file.read_text())  # its wall time stands too
    else:
        summary = summarize(run, test_best_weights(run), seconds)
        if "initial_eval_acc" in run.state:
            summary["initial_acc"] = run.state["initial_eval_acc"]
        if "transfer_eval_acc" in run.state:
            summary["transfer_acc"] = run.state["transfer_eval_acc"]
        for key in ("initial_test_acc", "transfer_test_acc"):  # test_every_epoch
            if key in run.state:
                summary[key] = run.state[key]
        if accelerator.is_main_process:  # the summary last: a resume takes a run that has one as finished
            run_log.plot_metrics(run_dir, run.state["history"])
            run_log.write_summary(run_dir, summary)
    accelerator.print(
        f"test accuracy: {100 * summary['test_acc']:.2f}% ({selection_note(summary)}); "
        f"{run_log.significant(summary['images_per_s'])} train img/s; run directory: {run_dir}"
    )
    if summary.get("skipped_updates"):
        accelerator.print(f"{summary['skipped_updates']} update(s) skipped for a non-finite loss or gradient")
    if summary.get("skipped_images"):
        accelerator.print(f"left out (--skip-bad-images): {describe_unreadable(summary['skipped_image_files'], listed=3)} "
                          f"(all of them in {run_log.SUMMARY_FILE})")
    return summary


def selection_note(summary: dict[str, Any]) -> str:
    """Which weights the test accuracy is of, and how they were chosen."""
    best = f"{100 * summary['best_acc']:.2f}%"
    if summary.get("selected_on") == "val":
        return f"the weights of epoch {summary['best_epoch']}, best on validation at {best}"
    return f"the last epoch; best on test {best} at epoch {summary['best_epoch']}"
