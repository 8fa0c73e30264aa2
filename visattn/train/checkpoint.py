"""Crash-safe, verified checkpoints of a run (in its run directory, :mod:`visattn.train.run_dir`), and the
trained weights.

A checkpoint is written into ``checkpoints/.tmp-step_<N>``; ``trainer_state.json`` comes last and
records the size and SHA-256 of every other file, and a SHA-256 of its own content. The folder is
renamed into place once every file is on disk and its checksums read back true, and only then are
older checkpoints pruned, so a process killed at any moment leaves every ``step_<N>`` complete and
the newest verified one is never deleted for a newer one that is not. ``--resume`` takes the newest
checkpoint that verifies (:func:`verify_checkpoint`), saying which it skipped and why.

Nothing is read back by unpickling arbitrary objects, and every file resume reads is checked here
before accelerate's ``load_state`` reads it again:

==========================  ===============================================================
trainer_state.json          ``json``
model.safetensors           safetensors (accelerate ``load_model``)
optimizer.bin, scaler.pt    ``torch.load(weights_only=True)`` (accelerate's ``load``)
random_states_<i>.pkl       ``torch.load(weights_only=True)`` plus NumPy's array types (accelerate's
                            ``load``); accelerate ignores a random-state file it cannot read, so
                            :func:`load_checkpoint` checks that the states were restored
config.yaml                 ``yaml`` safe loader (:func:`visattn.train.config.read_yaml`)
==========================  ===============================================================

timm's scheduler needs no file: its learning rate is a function of the update count. Objects
registered with ``register_for_checkpointing`` are the one thing accelerate unpickles in full
(``weights_only=False``), so the training script registers none. Under DeepSpeed, the engine's own
checkpoint files are read by DeepSpeed.
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from accelerate import Accelerator
from accelerate.utils import load as accelerate_load
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from visattn.models import merged_state_dict
from visattn.train.run_dir import (
    CHECKPOINT_NAME,
    CHECKPOINTS,
    CONFIG_FILE,
    LOCK_FILE,
    RunDirError,
    RunLock,
    check_run_dir,
    checkpoint_update,
    is_run_dir,
    list_checkpoints,
    os_error_reason,
    start_run_dir,
    unlink_quietly,
    write_atomically,
    write_model_file,
)

# The run directory's names, for the training script that works through this module.
__all__ = [
    "CHECKPOINTS", "CONFIG_FILE", "LOCK_FILE", "TRAINER_STATE", "CheckpointError", "RunDirError", "RunLock",
    "check_run_dir", "checkpoint_update", "choose_checkpoint", "is_run_dir", "list_checkpoints", "load_checkpoint",
    "remove_leftovers", "save_checkpoint", "save_weights", "start_run_dir", "verify_checkpoint", "write_atomically",
    "write_model_file",
]

TRAINER_STATE = "trainer_state.json"
# Keys trainer_state.json adds to the trainer state: the other files' sizes and checksums, its own checksum.
_FILES, _SELF_SHA256 = "files", "sha256"
# What accelerate's load_state sets from random_states_<i>.pkl on every device.
_RANDOM_STATE_KEYS = ("random_state", "numpy_random_seed", "torch_manual_seed")
# Trainer-state entries that must be integers for the loop to pick up where the checkpoint left off.
_STATE_KEYS = ("epoch", "batch", "update", "num_processes")


class CheckpointError(RunDirError):
    """One file of a checkpoint is missing, damaged or refused: ``file`` (a path) and ``problem``."""

    def __init__(self, file: Path, problem: str) -> None:
        super().__init__(f"{file}: {problem}")
        self.file, self.problem = file, problem


# -- run directory ------------------------------------------------------------------------------


# -- run lock -----------------------------------------------------------------------------------


# -- checkpoints --------------------------------------------------------------------------------
def save_checkpoint(accelerator: Accelerator, run_dir: Path, trainer_state: dict[str, Any], keep: int) -> Path:
    """accelerate ``save_state`` plus ``trainer_state`` (JSON, with every file's checksum), written
    crash-safe and verified; then keeps the newest ``keep`` verified checkpoints.

    Call on every process. The optimizer updates so far, the attention transfer's (``transfer_update``) and
    the fine-tune's (``update``), name the checkpoint.
    A disk that refuses the write (full, read-only) raises RunDirError; the checkpoints already there
    stay as they were.
    """
    root = run_dir / CHECKPOINTS
    final = root / f"step_{trainer_state['update'] + trainer_state.get('transfer_update', 0):08d}"
    tmp = root / f".tmp-{final.name}"
    try:
        if accelerator.is_main_process:
            root.mkdir(parents=True, exist_ok=True)
            remove_leftovers(run_dir)
        accelerator.wait_for_everyone()
        accelerator.save_state(str(tmp))
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            files = {name: _describe(tmp / name) for name in _files_of(tmp)}
            record = _sealed({**trainer_state, _FILES: files})
            with open(tmp / TRAINER_STATE, "w") as handle:
                handle.write(json.dumps(record, indent=1))
            _fsync_tree(tmp)
            verify_checkpoint(tmp, read_contents=False)  # what is on disk, read back
            if final.exists():
                _discard(final)
            os.rename(tmp, final)
            _fsync_dir(root)
            _VERIFIED[final] = _identity(final)
            _prune(run_dir, final, keep)
    except (OSError, RuntimeError, SafetensorError, CheckpointError) as error:  # torch.save reports a full disk as RuntimeError
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        newest = ([c.name for c in list_checkpoints(run_dir) if c != final] or ["none"])[-1]
        reason = os_error_reason(error) if isinstance(error, OSError) else f"{_first_line(error)} ({_free_space(root)})"
        raise RunDirError(f"cannot write checkpoint {final}: {reason}; the newest checkpoint is still {newest}") from None
    accelerator.wait_for_everyone()
    return final


def verify_checkpoint(checkpoint: Path, read_contents: bool = True) -> dict[str, Any]:
    """The trainer state of ``checkpoint`` once every file checks out; CheckpointError naming the first
    file that does not and what is wrong with it (missing, unreadable, zero bytes, truncated, checksum
    mismatch, not written by the save, refused).

    ``read_contents`` also reads each file with the loader resume uses (safetensors header; torch's
    ``weights_only`` loader for the rest, which refuses a pickle that would run code) and checks that
    random-state files hold every state; what an attacker who also rewrote ``trainer_state.json``
    could slip past the checksums stops there.
    """
    record = _read_trainer_state(checkpoint)
    files = record.pop(_FILES)
    present = set(_files_of(checkpoint))
    for name, expected in sorted(files.items()):
        _check_file(checkpoint / name, expected)
    for name in sorted(present - set(files) - {TRAINER_STATE}):
        raise CheckpointError(checkpoint / name, "not written by this checkpoint's save (not in trainer_state.json)")
    if read_contents:
        for name in sorted(files):
            _check_contents(checkpoint / name)
    return record


def choose_checkpoint(run_dir: Path, resume_from: str | None, warn: Callable[[str], None]) -> tuple[Path, dict[str, Any]]:
    """(checkpoint, trainer state) to resume from: ``resume_from`` (a path, or a checkpoint name in
    ``run_dir``) when given, else the newest checkpoint that verifies; ``warn`` gets one line per newer
    checkpoint skipped. RunDirError when the one asked for, or every one, fails to verify."""
    root = run_dir / CHECKPOINTS
    if resume_from is not None:
        chosen = Path(resume_from)
        if not chosen.is_dir() and (root / resume_from).is_dir():
            chosen = root / resume_from
        names = ", ".join(c.name for c in list_checkpoints(run_dir)) or "none"
        if not chosen.is_dir() or chosen.resolve().parent != root.resolve() or not CHECKPOINT_NAME.match(chosen.name):
            raise RunDirError(f"--resume-from {resume_from}: not a checkpoint of {run_dir} (its checkpoints: {names})")
        try:
            return chosen, verify_checkpoint(chosen)
        except CheckpointError as error:
            raise RunDirError(f"cannot resume from {chosen}: {error.file.name} {error.problem}") from None
    problems = []
    for checkpoint in reversed(list_checkpoints(run_dir)):
        try:
            state = verify_checkpoint(checkpoint)
        except CheckpointError as error:
            problems.append(f"{checkpoint.name}: {error.file.name} {error.problem}")
            warn(f"warning: skipping checkpoint {checkpoint}: {error.file.name} {error.problem}")
            continue
        _VERIFIED[checkpoint] = _identity(checkpoint)
        return checkpoint, state
    raise RunDirError(
        f"no checkpoint in {root} can be resumed ({'; '.join(problems)}); nothing was changed. "
        "Start over with --overwrite, or restore the files."
    )


def load_checkpoint(accelerator: Accelerator, checkpoint: Path, state: dict[str, Any]) -> dict[str, Any]:
    """Restore model, optimizer, scaler and RNG states (accelerate ``load_state``) from a checkpoint
    :func:`choose_checkpoint` verified; returns its trainer ``state``."""
    if state["num_processes"] != accelerator.num_processes:
        raise RunDirError(
            f"{checkpoint} was written by {state['num_processes']} process(es); resume it with the same number "
            f"(this launch has {accelerator.num_processes}) so the data order and RNG states carry over."
        )
    try:
        accelerator.load_state(str(checkpoint))
    except (RuntimeError, ValueError, KeyError, OSError, pickle.UnpicklingError) as error:
        raise RunDirError(f"cannot resume from {checkpoint}: {_first_line(error)}") from None
    random_states = checkpoint / f"random_states_{accelerator.process_index}.pkl"
    if not torch.equal(torch.get_rng_state(), accelerate_load(random_states)["torch_manual_seed"]):
        raise RunDirError(f"{random_states}: accelerate did not restore the random states it holds")
    return state


_VERIFIED: dict[Path, tuple[int, int]] = {}  # checkpoints verified by this process -> identity of their trainer_state.json


def _prune(run_dir: Path, newest: Path, keep: int) -> None:
    """Keep ``newest`` and the ``keep - 1`` newest older checkpoints that verify; delete the older rest.

    A damaged checkpoint is not counted, so it never pushes a good one out; checkpoints newer than
    ``newest`` (left by a run resumed from further back) are the future's to replace.
    """
    older = [c for c in list_checkpoints(run_dir) if checkpoint_update(c) < checkpoint_update(newest)]
    kept = 1
    for checkpoint in reversed(older):
        if kept >= keep:
            _discard(checkpoint)
        elif _checksums_hold(checkpoint):
            kept += 1


def _checksums_hold(checkpoint: Path) -> bool:
    if _VERIFIED.get(checkpoint) == _identity(checkpoint):
        return True
    try:
        verify_checkpoint(checkpoint, read_contents=False)
    except CheckpointError:
        return False
    _VERIFIED[checkpoint] = _identity(checkpoint)
    return True


def _identity(checkpoint: Path) -> tuple[int, int]:
    stat = (checkpoint / TRAINER_STATE).stat()
    return stat.st_ino, stat.st_mtime_ns


def _sealed(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` with the SHA-256 of its canonical JSON, so that a damaged but parsable file is caught."""
    return {**record, _SELF_SHA256: _canonical_sha256(record)}


def _canonical_sha256(record: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


def _read_trainer_state(checkpoint: Path) -> dict[str, Any]:
    path = checkpoint / TRAINER_STATE
    raw = _read_bytes(path)
    try:
        record = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        truncated = isinstance(error, json.JSONDecodeError) and (
            error.pos >= len(error.doc.rstrip()) or error.msg.startswith("Unterminated string"))
        raise CheckpointError(path, "truncated (its JSON ends early)" if truncated else f"damaged (not valid JSON: {error})") from None
    if not isinstance(record, dict) or _SELF_SHA256 not in record or not isinstance(record.get(_FILES), dict):
        raise CheckpointError(path, "holds no file checksums (not written by this version of visattn); "
                                    "it cannot be verified")
    stored = record.pop(_SELF_SHA256)
    if _canonical_sha256(record) != stored:
        raise CheckpointError(path, "checksum mismatch (its content changed after it was written)")
    malformed = [key for key in _STATE_KEYS if not isinstance(record.get(key), int)] + [
        name for name, entry in record[_FILES].items()
        if name.startswith("/") or ".." in name.split("/") or not isinstance(entry, dict)
        or not isinstance(entry.get("bytes"), int) or not isinstance(entry.get("sha256"), str)
    ]
    if malformed:
        raise CheckpointError(path, f"malformed: bad or missing entries {', '.join(malformed)}")
    return record


def _read_bytes(path: Path) -> bytes:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(path, "missing") from None
    except OSError as error:
        raise CheckpointError(path, f"unreadable ({os_error_reason(error)})") from None
    if not raw:
        raise CheckpointError(path, "zero bytes")
    return raw


def _check_file(path: Path, expected: dict[str, Any]) -> None:
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise CheckpointError(path, "missing") from None
    except OSError as error:
        raise CheckpointError(path, f"unreadable ({os_error_reason(error)})") from None
    if size == 0:
        raise CheckpointError(path, f"zero bytes (written with {expected['bytes']})")
    if size < expected["bytes"]:
        raise CheckpointError(path, f"truncated ({size} of {expected['bytes']} bytes)")
    if size != expected["bytes"]:
        raise CheckpointError(path, f"size changed ({size} bytes, written with {expected['bytes']})")
    try:
        digest = _sha256(path)
    except OSError as error:
        raise CheckpointError(path, f"unreadable ({os_error_reason(error)})") from None
    if digest != expected["sha256"]:
        raise CheckpointError(path, "checksum mismatch (its bytes changed after they were written)")


def _check_contents(path: Path) -> None:
    """Read ``path`` with the loader resume uses; CheckpointError with one line when it refuses."""
    if path.suffix == ".safetensors":
        try:
            with safe_open(str(path), framework="pt") as handle:
                handle.keys()
        except (SafetensorError, OSError) as error:
            raise CheckpointError(path, f"not a readable safetensors file ({_first_line(error)})") from None
        return
    try:
        content = accelerate_load(path, map_location="cpu")
    except pickle.UnpicklingError as error:
        raise CheckpointError(path, f"refused: {_unpickling_problem(error)}") from None
    except (RuntimeError, EOFError, ValueError, OSError) as error:
        raise CheckpointError(path, f"not a readable torch file ({_first_line(error)})") from None
    if path.name.startswith("random_states_"):
        missing = [key for key in _RANDOM_STATE_KEYS if not isinstance(content, dict) or key not in content]
        if missing:
            raise CheckpointError(path, f"holds no {', '.join(missing)}: the random states would not be restored")
        torch_state = content["torch_manual_seed"]
        if not (isinstance(torch_state, torch.Tensor) and torch_state.dtype == torch.uint8):
            raise CheckpointError(path, "torch_manual_seed is not a uint8 tensor: the random states would not be restored")


def _unpickling_problem(error: pickle.UnpicklingError) -> str:
    """torch's weights_only refusal in one line, without its advice to load with weights_only=False."""
    text = str(error)
    called = re.search(r"GLOBAL ([\w.]+)", text)
    if called:
        return f"unpickling it would call {called.group(1)} (only tensors and plain containers are read)"
    details = [line.strip() for line in text.splitlines()
               if line.strip() and "weights_only" not in line and not line.startswith(("Weights only load failed", "Check the"))]
    return f"not plain tensor data ({details[0][:300] if details else 'the weights-only unpickler refused it'})"


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return (lines[0] if lines else type(error).__name__)[:300]


def _free_space(folder: Path) -> str:
    """How full ``folder``'s disk is: torch.save reports a full disk only as a failed write position."""
    try:
        usage = shutil.disk_usage(folder)
    except OSError:
        return "disk usage unknown"
    return f"{usage.free / 2**20:.1f} MiB free of {usage.total / 2**20:.1f} MiB on its disk"


def _describe(path: Path) -> dict[str, Any]:
    return dict(bytes=path.stat().st_size, sha256=_sha256(path))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def _files_of(folder: Path) -> list[str]:
    """Every file under ``folder`` as a relative POSIX path, trainer_state.json excluded."""
    names = [path.relative_to(folder).as_posix() for path in folder.rglob("*") if not path.is_dir()]
    return sorted(name for name in names if name != TRAINER_STATE)


def remove_leftovers(run_dir: Path) -> None:
    """Delete what an interrupted save or prune left in ``run_dir``'s checkpoints (never a complete checkpoint):
    a save does it before it writes, and a resume once it has loaded, for a killed run's last save."""
    for entry in (run_dir / CHECKPOINTS).iterdir():
        if entry.name.startswith((".tmp-", ".trash-")):
            shutil.rmtree(entry, ignore_errors=True)


def _discard(checkpoint: Path) -> None:
    trash = checkpoint.with_name(f".trash-{checkpoint.name}")
    os.rename(checkpoint, trash)
    shutil.rmtree(trash, ignore_errors=True)
    _VERIFIED.pop(checkpoint, None)


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
    """The model's full state dict as safetensors (crash-safe), low-rank adapters merged into their weights (a
    plain model's, which prediction and ``--initial-checkpoint`` load). Call on every process (FSDP gathers).
    RunDirError when the disk refuses the write; the previous file stays."""
    state_dict = merged_state_dict(accelerator.get_state_dict(model))
    if accelerator.is_main_process:
        tmp = path.with_name(f".tmp-{path.name}")
        try:
            save_file({key: value.contiguous() for key, value in state_dict.items()}, str(tmp), metadata={"format": "pt"})
            os.replace(tmp, path)
        except (OSError, SafetensorError) as error:
            unlink_quietly(tmp)
            reason = os_error_reason(error) if isinstance(error, OSError) else _first_line(error)
            raise RunDirError(f"cannot write {path}: {reason}") from None


