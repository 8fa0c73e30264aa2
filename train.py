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
from typing import Any

import visattn  # noqa: F401  (registers the visattn_vit_* models with timm)
from visattn.train import checkpoint as ckpt
from visattn.train import run_log
from visattn.train.build import default_cpu_threads, process_state
from visattn.train.cli import RunOptions, finished_run_line, resolve_config
from visattn.train.config import ConfigError, TrainConfig
from visattn.train.data import DataError
from visattn.train.loop import NonFiniteError, finish_epoch, finish_run, train_epoch
from visattn.train.prepare import begin_training, build_run, claim_run_dir, prepare_training, resume_training
from visattn.train.transfer import run_transfer_stage


def training_function(config: TrainConfig, options: RunOptions, held: contextlib.ExitStack) -> dict[str, Any]:
    """Build, check, train; ``held`` keeps the run directory's lock until the caller closes it."""
    started = time.perf_counter()
    built = build_run(config, options)  # everything checked before the run directory is touched
    resume = claim_run_dir(built, options, held)
    run, transfer_optimizer = prepare_training(built, options)
    resume_training(run, built, resume)
    begin_training(run)
    run_transfer_stage(run, transfer_optimizer, built.splits.num_classes, built.initial)

    already_finished = run.state["epoch"] >= config.epochs
    for epoch in range(run.state["epoch"], config.epochs):
        run_log.reset_peak_memory(run.accelerator.device)
        loss_sum, images, train_time = train_epoch(run, epoch)
        finish_epoch(run, epoch, loss_sum, images, train_time)

    summary = finish_run(run, already_finished, time.perf_counter() - started)
    accelerator = run.accelerator
    # Free the wrapped model while the process group is still registered, so that DDP's reducer does not hold
    # its last reference: torch before 2.14 may free a gloo group from the reducer's destructor with the GIL
    # held, where the group waits for worker threads that need the GIL, and the process never exits. A
    # compiled model sits in a reference cycle, hence the collection.
    del run, built
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
