"""The run directory: its layout, the checks before a run starts or resumes, the run lock, and files
written whole or not at all.

A run directory holds (:mod:`visattn.predict` loads the trained model back from it)::

    config.yaml               the effective TrainConfig
    model.json                timm.create_model name and keywords, data config and class names of the model
    run.lock                  PID and host of the run writing here (empty once it has ended)
    checkpoints/step_<N>/     accelerate save_state after N optimizer updates (attention transfer's included)
                              + trainer_state.json (:mod:`visattn.train.checkpoint`)
    metrics.jsonl, metrics.png, summary.json
    transfer_metrics.jsonl    per-block losses of each attention-transfer epoch (--transfer-epochs)
    model_best.safetensors, model_last.safetensors
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shutil
import socket
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from visattn.predict import MODEL_FILE

CONFIG_FILE = "config.yaml"
CHECKPOINTS = "checkpoints"
LOCK_FILE = "run.lock"
CHECKPOINT_NAME = re.compile(r"^step_(\d+)$")


class RunDirError(Exception):
    """The run directory does not allow what was asked (start, resume); the message says what to do."""


def is_run_dir(path: Path) -> bool:
    return (path / CONFIG_FILE).is_file()


def checkpoint_update(checkpoint: Path) -> int:
    """The update count in a checkpoint's name (``step_00000012`` -> 12)."""
    return int(CHECKPOINT_NAME.match(checkpoint.name).group(1))


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoint folders (renamed into place, so complete when written; see :func:`verify_checkpoint`), oldest first."""
    root = run_dir / CHECKPOINTS
    if not root.is_dir():
        return []
    return sorted((entry for entry in root.iterdir() if CHECKPOINT_NAME.match(entry.name) and entry.is_dir()),
                  key=checkpoint_update)


def check_run_dir(run_dir: Path, resume: bool, overwrite: bool) -> None:
    """Checks only, changes nothing. Raises RunDirError when ``run_dir`` holds a previous run and neither
    ``resume`` nor ``overwrite`` is given, when there is nothing to resume, or when it holds files that
    are not a run. Which checkpoint to resume from is :func:`choose_checkpoint`'s (under the run lock)."""
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirError(f"run directory {run_dir} exists and is not a directory; choose another --run-dir")
    occupied = run_dir.is_dir() and any(entry.name != LOCK_FILE for entry in run_dir.iterdir())
    if resume:
        if not is_run_dir(run_dir) or not list_checkpoints(run_dir):
            what = "no run" if not is_run_dir(run_dir) else "a run without a complete checkpoint"
            raise RunDirError(f"nothing to resume: {run_dir} holds {what}. Start it without --resume (add --overwrite to replace it).")
        return
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


def start_run_dir(run_dir: Path, overwrite: bool) -> None:
    """Empty (with ``overwrite``) and create ``run_dir``; call after :func:`check_run_dir` passed.
    The run lock stays: this run holds it."""
    if overwrite and run_dir.is_dir() and is_run_dir(run_dir):
        for entry in run_dir.iterdir():
            if entry.name == LOCK_FILE:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
    run_dir.mkdir(parents=True, exist_ok=True)


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename; RunDirError if the disk refuses."""
    tmp = path.with_name(f".tmp-{path.name}")
    try:
        with open(tmp, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except OSError as error:
        unlink_quietly(tmp)
        raise RunDirError(f"cannot write {path}: {os_error_reason(error)}") from None


class RunLock:
    """Exclusive right to write into a run directory, held by one process until :meth:`release`.

    ``run.lock`` is ``flock``-ed for the life of the holder (the kernel lets go when it dies, however
    it dies) and names its PID and host, so a refused run can say who writes there. A run that was
    killed leaves its PID behind; the next one takes the lock over and says so. Only the training
    process holds it (the main one, with several): killing ``accelerate launch`` does not free it
    while an orphaned training process still runs.
    """

    def __init__(self, run_dir: Path, notice: Callable[[str], None] = print) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / LOCK_FILE
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = self._owner()
            os.close(self._fd)
            raise RunDirError(
                f"{run_dir} is in use by a run still going ({owner or 'owner unknown'}, {self.path}); "
                "wait for it to end or stop it, then retry"
            ) from None
        previous = self._owner()
        if previous:
            notice(f"notice: taking over {self.path} from {previous}, which no longer runs (a killed run)")
        me = json.dumps(dict(pid=os.getpid(), host=socket.gethostname()))
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, me.encode(), 0)
        os.fsync(self._fd)

    def _owner(self) -> str:
        """'PID <pid> on <host>' from the lock file, or '' when empty (released)."""
        text = os.pread(self._fd, 4096, 0).decode(errors="replace").strip()
        if not text:
            return ""
        try:
            owner = json.loads(text)
            return f"PID {owner['pid']} on {owner['host']}"
        except (ValueError, KeyError, TypeError):
            return f"an unreadable owner {text[:80]!r}"

    def release(self) -> None:
        """Empty the lock file (a clean end) and let go. The file stays: deleting it would let a run
        that opened it just before lock a file no one else sees."""
        if self._fd < 0:
            return
        try:
            os.ftruncate(self._fd, 0)
        except OSError:
            pass  # a full or read-only disk: the next run reports a taken-over lock, nothing worse
        os.close(self._fd)
        self._fd = -1

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def write_model_file(
    run_dir: Path, model_name: str, model_kwargs: dict[str, Any], data_config: dict[str, Any], class_names: Sequence[str]
) -> None:
    """``model.json``: what :func:`visattn.predict.load_predictor` rebuilds the model from, with the evaluation
    data config (timm's vocabulary: input_size, interpolation, mean, std, crop_pct, crop_mode) and the class names."""
    contents = {"model": model_name, "kwargs": model_kwargs, "data_config": data_config, "class_names": list(class_names)}
    write_atomically(run_dir / MODEL_FILE, json.dumps(contents, indent=1))


def unlink_quietly(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


def os_error_reason(error: OSError) -> str:
    if error.errno == errno.ENOSPC:
        return "no space left on the device"
    if error.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return f"not writable ({error.strerror})"
    return error.strerror or str(error)
