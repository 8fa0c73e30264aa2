"""Run directories, crash-safe checkpoints and the trained weights they save.

A run directory holds (:mod:`visattn.predict` loads the trained model back from it)::

    config.yaml               the effective TrainConfig
    model.json                timm.create_model name and keywords, data config and class names of the model
    checkpoints/step_<N>/     accelerate save_state after N optimizer updates + trainer_state.json
    metrics.jsonl, metrics.png, summary.json
    model_best.safetensors, model_last.safetensors

A checkpoint is written into ``checkpoints/.tmp-step_<N>`` and renamed into place only once every file
is on disk, and old checkpoints are renamed away before they are deleted, so a process killed at any
moment leaves every ``step_<N>`` directory complete.

Nothing is read back by unpickling arbitrary objects: weights are safetensors, the trainer state
(position in the data, update count, metrics so far) is JSON, and accelerate's ``load_state`` reads
the optimizer, gradient-scaler and RNG files with ``torch.load(weights_only=True)`` (allowing the
NumPy array types of the RNG state). timm's scheduler needs no file: its learning rate is a function
of the update count. Objects registered with ``register_for_checkpointing`` are the one thing
accelerate unpickles in full (``weights_only=False``), so the training script registers none. Under
DeepSpeed, the engine's own checkpoint files are read by DeepSpeed.
"""
from __future__ import annotations

import json
import os
import pickle
import re
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch.nn as nn
from accelerate import Accelerator
from safetensors.torch import save_file

from visattn.predict import MODEL_FILE

CONFIG_FILE = "config.yaml"
CHECKPOINTS = "checkpoints"
TRAINER_STATE = "trainer_state.json"
_CHECKPOINT_NAME = re.compile(r"^step_(\d+)$")


class RunDirError(Exception):
    """The run directory does not allow what was asked (start, resume); the message says what to do."""


# -- run directory ------------------------------------------------------------------------------
def is_run_dir(path: Path) -> bool:
    return (path / CONFIG_FILE).is_file()


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = run_dir / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [
        (int(match.group(1)), entry)
        for entry in root.iterdir()
        if (match := _CHECKPOINT_NAME.match(entry.name)) and (entry / TRAINER_STATE).is_file()
    ]
    return [entry for _, entry in sorted(found)]


def check_run_dir(run_dir: Path, resume: bool, overwrite: bool) -> Path | None:
    """Checks only, changes nothing: the checkpoint to resume from, or None for a new run.

    Raises RunDirError when ``run_dir`` holds a previous run and neither ``resume`` nor ``overwrite``
    is given, when there is nothing to resume, or when it holds files that are not a run.
    """
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirError(f"run directory {run_dir} exists and is not a directory; choose another --run-dir")
    occupied = run_dir.is_dir() and any(run_dir.iterdir())
    if resume:
        checkpoints = list_checkpoints(run_dir) if is_run_dir(run_dir) else []
        if not checkpoints:
            what = "no run" if not is_run_dir(run_dir) else "a run without a complete checkpoint"
            raise RunDirError(f"nothing to resume: {run_dir} holds {what}. Start it without --resume (add --overwrite to replace it).")
        return checkpoints[-1]
    if occupied and not is_run_dir(run_dir):
        raise RunDirError(
            f"{run_dir} is not empty and holds no visattn run (no {CONFIG_FILE}); refusing to write or delete "
            "anything there. Choose another --run-dir."
        )
    if occupied and not overwrite:
        checkpoints = list_checkpoints(run_dir)
        last = f"last checkpoint {checkpoints[-1].name}" if checkpoints else "no checkpoint yet"
        raise RunDirError(
            f"{run_dir} holds a previous run ({last}). Pass --resume to continue it, --overwrite to replace it, "
            "or choose another --run-dir."
        )
    return None


def start_run_dir(run_dir: Path, overwrite: bool) -> None:
    """Empty (with ``overwrite``) and create ``run_dir``; call after :func:`check_run_dir` passed."""
    if overwrite and run_dir.is_dir() and is_run_dir(run_dir):
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename."""
    tmp = path.with_name(f".tmp-{path.name}")
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


# -- checkpoints --------------------------------------------------------------------------------
def save_checkpoint(accelerator: Accelerator, run_dir: Path, trainer_state: dict[str, Any], keep: int) -> Path:
    """accelerate ``save_state`` plus ``trainer_state`` (JSON), written crash-safe; keeps the newest ``keep``.

    Call on every process. ``trainer_state["update"]`` (optimizer updates so far) names the checkpoint.
    """
    root = run_dir / CHECKPOINTS
    final = root / f"step_{trainer_state['update']:08d}"
    tmp = root / f".tmp-{final.name}"
    if accelerator.is_main_process:
        root.mkdir(parents=True, exist_ok=True)
        _remove_leftovers(root)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (tmp / TRAINER_STATE).write_text(json.dumps(trainer_state, indent=1))
        _fsync_tree(tmp)
        if final.exists():
            _discard(final)
        os.rename(tmp, final)
        _fsync_dir(root)
        for old in list_checkpoints(run_dir)[:-keep]:
            _discard(old)
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(accelerator: Accelerator, checkpoint: Path) -> dict[str, Any]:
    """Restore model, optimizer, scaler and RNG states (accelerate ``load_state``); the trainer state."""
    state = json.loads((checkpoint / TRAINER_STATE).read_text())
    if state["num_processes"] != accelerator.num_processes:
        raise RunDirError(
            f"{checkpoint} was written by {state['num_processes']} process(es); resume it with the same number "
            f"(this launch has {accelerator.num_processes}) so the data order and RNG states carry over."
        )
    try:
        accelerator.load_state(str(checkpoint))
    except (RuntimeError, ValueError, KeyError, OSError, pickle.UnpicklingError) as error:
        raise RunDirError(f"cannot resume from {checkpoint}: {error}") from None
    return state


def _remove_leftovers(root: Path) -> None:
    """Delete what an interrupted save or prune left behind (never a complete checkpoint)."""
    for entry in root.iterdir():
        if entry.name.startswith((".tmp-", ".trash-")):
            shutil.rmtree(entry, ignore_errors=True)


def _discard(checkpoint: Path) -> None:
    trash = checkpoint.with_name(f".trash-{checkpoint.name}")
    os.rename(checkpoint, trash)
    shutil.rmtree(trash, ignore_errors=True)


def _fsync_tree(path: Path) -> None:
    for folder, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(folder, name), "rb") as handle:
                os.fsync(handle.fileno())
        _fsync_dir(Path(folder))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- trained weights ----------------------------------------------------------------------------
def save_weights(accelerator: Accelerator, model: nn.Module, path: Path) -> None:
    """The model's full state dict as safetensors (crash-safe). Call on every process (FSDP gathers)."""
    state_dict = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        tmp = path.with_name(f".tmp-{path.name}")
        save_file({key: value.contiguous() for key, value in state_dict.items()}, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, path)


def write_model_file(
    run_dir: Path, model_name: str, model_kwargs: dict[str, Any], data_config: dict[str, Any], class_names: Sequence[str]
) -> None:
    """``model.json``: what :func:`visattn.predict.load_predictor` rebuilds the model from, with the evaluation
    data config (timm's vocabulary: input_size, interpolation, mean, std, crop_pct, crop_mode) and the class names."""
    contents = {"model": model_name, "kwargs": model_kwargs, "data_config": data_config, "class_names": list(class_names)}
    write_atomically(run_dir / MODEL_FILE, json.dumps(contents, indent=1))

