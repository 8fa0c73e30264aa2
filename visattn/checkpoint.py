"""Moved: loading a trained run to :mod:`visattn.predict`, the training state to
:mod:`visattn.train.checkpoint`; this alias is kept for one release."""
from visattn._moved import warn_moved
from visattn.predict import BEST_WEIGHTS, LAST_WEIGHTS, MODEL_FILE, load_trained_model
from visattn.train.checkpoint import (
    CHECKPOINTS,
    CONFIG_FILE,
    TRAINER_STATE,
    RunDirError,
    check_run_dir,
    is_run_dir,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
    save_weights,
    start_run_dir,
    write_atomically,
    write_model_file,
)

warn_moved(__name__, "visattn.predict (load_trained_model) and visattn.train.checkpoint")

__all__ = [
    "BEST_WEIGHTS",
    "CHECKPOINTS",
    "CONFIG_FILE",
    "LAST_WEIGHTS",
    "MODEL_FILE",
    "TRAINER_STATE",
    "RunDirError",
    "check_run_dir",
    "is_run_dir",
    "list_checkpoints",
    "load_checkpoint",
    "load_trained_model",
    "save_checkpoint",
    "save_weights",
    "start_run_dir",
    "write_atomically",
    "write_model_file",
]
