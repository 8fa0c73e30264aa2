"""Train a visattn ViT with accelerate.

    python train.py --attn axial                        # embedded digits, finishes in minutes on a CPU
    accelerate launch train.py --config configs/cifar10-vit-s.yaml --attn neighborhood --download
    accelerate launch --multi_gpu --num_processes 2 train.py --attn axial
    python train.py --attn axial --resume               # continue runs/digits-axial from its last checkpoint
    python train.py --config configs/transfer.yaml     # a softmax run's weights, attention transfer, fine-tune

The same command once its run has finished prints where the results are and exits 0; with other settings
it refuses (--resume, --overwrite or another --run-dir say what to do).

Every recipe key is a flag (``python train.py --help``); ``--config FILE`` loads a YAML recipe that flags
override. The run directory gets the effective config, checkpoints (each epoch and every
``--save-every`` updates), per-epoch metrics, a plot, and the best and last weights as safetensors
(load them with :func:`visattn.predict.load_trained_model`). The pieces live in :mod:`visattn.train`.
"""
from __future__ import annotations

import contextlib
import gc
import sys
import time
from pathlib import Path
from typing import Any

from accelerate.utils import set_seed

import visattn  # noqa: F401  (registers the visattn_vit_* models with timm)
from visattn.models import AttentionTransfer
from visattn.train import checkpoint as ckpt
from visattn.train import run_log
from visattn.train.attention import resolve_attention
from visattn.train.build import (
    add_adapters, build_accelerator, build_criterion, build_loaders, build_mixup, build_model, build_optimizer,
    build_scheduler, compile_backend, compile_model, default_cpu_threads, load_data, measure_loader, process_state,
    worker_notice,
)
from visattn.train.cli import RunOptions, finished_run_line, resolve_config
from visattn.train.config import ConfigError, TrainConfig
from visattn.train.data import DataError
from visattn.train.initial import load_initial_weights, read_initial_weights
from visattn.train.loop import (
    NonFiniteError, Training, check_checkpoint_model, evaluate, finish_epoch, finish_run, new_trainer_state, test_scores,
    train_epoch, write_run_files,
)
from visattn.train.overview import run_overview
from visattn.train.transfer import TransferStage, build_parent, build_transfer_optimizer, run_transfer


def training_function(config: TrainConfig, options: RunOptions, held: contextlib.ExitStack) -> dict[str, Any]:
    """Build, check, train; ``held`` keeps the run directory's lock until the caller closes it."""
    started = time.perf_counter()
    run_dir = Path(config.run_dir)
    accelerator = build_accelerator(config, run_dir)
    main = accelerator.is_main_process
    ckpt.check_run_dir(run_dir, options.resume, options.overwrite)  # reads only: a refusal comes before slow work
    # A resumed run takes its weights from its checkpoint; a new one reads its first weights before the rest.
    initial = None if options.resume else read_initial_weights(config)

    # Build and check everything before the run directory is touched.
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
    model_kwargs = config.model_kwargs_for_timm(splits.num_classes)
    train_loader, val_loader, eval_loader = build_loaders(config, splits, accelerator.num_processes)
    optimizer = build_optimizer(config, model)
    transfer_optimizer = build_transfer_optimizer(config, model) if config.transfer_epochs else None
    ckpt.check_run_dir(run_dir, options.resume, options.overwrite)  # before the lock file lands there
    if main:  # one run writes into a run directory at a time; a second one stops here
        held.enter_context(ckpt.RunLock(run_dir))
        ckpt.check_run_dir(run_dir, options.resume, options.overwrite)  # again: a run may have ended just before
    accelerator.wait_for_everyone()  # every process has checked the run directory before it changes
    resume_from = None
    if options.resume:  # the newest checkpoint that verifies (or the one asked for), checked under the lock
        resume_from, saved_state = ckpt.choose_checkpoint(run_dir, options.resume_from, accelerator.print)
    if main and resume_from is None:
        ckpt.start_run_dir(run_dir, options.overwrite)
        write_run_files(run_dir, config, model_kwargs, splits)
    accelerator.wait_for_everyone()

    if val_loader is None:
        accelerator.print(f"{config.dataset} has no validation split: the best epoch is chosen on the test split, "
                          "and the last epoch's test accuracy is reported")
    loader_speed = measure_loader(train_loader, options.measure_loader, accelerator.device) if options.measure_loader else None
    model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)
    if transfer_optimizer is not None:  # prepared second: its state is every checkpoint's optimizer_1.bin
        transfer_optimizer = accelerator.prepare(transfer_optimizer)
    backend, compile_note = compile_backend(config)
    if backend is not None:
        compile_model(model, backend)
    selection_split, selection_loader = ("test", eval_loader) if val_loader is None else ("val", accelerator.prepare(val_loader))
    overview = run_overview(
        config, splits, accelerator.unwrap_model(model), accelerator.num_processes, len(train_loader), auto, run_dir,
        accelerator.device, image_check,
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
    initial_eval = initial_test = None
    if initial is not None:
        initial_eval = evaluate(accelerator, model, selection_loader)  # what the converted weights do before training
        accelerator.print(
            f"initial weights, before any update: eval loss {initial_eval['loss']:.4f}, "
            f"eval acc {100 * initial_eval['acc']:.2f}% ({selection_split} split)"
        )
        if config.test_every_epoch:
            initial_test = test_scores(accelerator, model, selection_split, eval_loader, initial_eval)
    scheduler = build_scheduler(config, optimizer, len(train_loader))
    mixup = build_mixup(config, splits.num_classes)
    set_seed(config.seed + accelerator.process_index)  # dropout, drop path and mixup differ per process
    run = Training(
        accelerator=accelerator, config=config, run_dir=run_dir, model=model, optimizer=optimizer,
        scheduler=scheduler, criterion=build_criterion(config, mixup), mixup=mixup,
        train_loader=train_loader, eval_loader=eval_loader, state=new_trainer_state(accelerator.num_processes),
        selection_loader=selection_loader, selection_split=selection_split, skipped_images=image_check.unreadable,
    )
    if initial_eval is not None:
        run.state["initial_eval_acc"] = initial_eval["acc"]
    if initial_test is not None:
        run.state["initial_test_acc"] = initial_test["acc"]
    if resume_from is not None:
        check_checkpoint_model(accelerator, model, run_dir, resume_from, model_kwargs)
        run.state = ckpt.load_checkpoint(accelerator, resume_from, saved_state)
        state = run.state
        accelerator.print(f"resumed from {resume_from} (epoch {state['epoch'] + 1}, batch {state['batch']}, update {state['update']})")
        if main:  # only now that the checkpoint has loaded into this config's model
            write_run_files(run_dir, config, model_kwargs, splits)
            ckpt.remove_leftovers(run_dir)  # a run killed in its last save or prune has no later save to do it
    scheduler.step_update(run.state["update"])
    if main:
        run_log.write_metrics(run_dir, run.state["history"])  # a resumed run redoes what came after its checkpoint
    if config.log_with:
        accelerator.init_trackers("visattn", config={key: value if isinstance(value, (int, float, str, bool)) else str(value)
                                                     for key, value in config.to_dict().items()})

    if config.transfer_epochs and run.state["transfer_epoch"] < config.transfer_epochs:
        # the parent: the initial weights under softmax attention (read again when a resume needs them)
        parent = build_parent(config, splits.num_classes, initial or read_initial_weights(config), accelerator.device)
        transfer = AttentionTransfer(parent, accelerator.unwrap_model(model), config.transfer_mode, config.transfer_projections)
        run_transfer(run, TransferStage(transfer, transfer_optimizer, config.transfer_epochs * len(train_loader)))
        del parent, transfer

    already_finished = run.state["epoch"] >= config.epochs
    for epoch in range(run.state["epoch"], config.epochs):
        run_log.reset_peak_memory(accelerator.device)
        loss_sum, images, train_time = train_epoch(run, epoch)
        finish_epoch(run, epoch, loss_sum, images, train_time)

    summary = finish_run(run, already_finished, time.perf_counter() - started)
    # Free the wrapped model while the process group is still registered, so that DDP's reducer does not hold
    # its last reference: torch before 2.14 may free a gloo group from the reducer's destructor with the GIL
    # held, where the group waits for worker threads that need the GIL, and the process never exits. A
    # compiled model sits in a reference cycle, hence the collection.
    del model, run
    gc.collect()
    accelerator.end_training()
    return summary


def main(argv: list[str] | None = None) -> int:
    try:
        config, options, changes = resolve_config(argv)
        finished = None if options.resume or options.overwrite else finished_run_line(config)
        if finished is not None:  # the same command again: nothing to train, and no reason to fail
            if process_state().is_main_process:
                print(finished)
            return 0
        if changes and process_state().is_main_process:
            print(f"resuming {config.run_dir} with changed settings: {'; '.join(changes)}")
        with contextlib.ExitStack() as held:
            training_function(config, options, held)
    except (ConfigError, DataError, ckpt.RunDirError, NonFiniteError) as error:
        # Every process reports: a launcher stops the others as soon as one exits, main process included.
        state = process_state()
        where = "" if state.num_processes == 1 else f"[process {state.process_index}] "
        print(f"{where}error: {error}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    default_cpu_threads()
    sys.exit(main())
