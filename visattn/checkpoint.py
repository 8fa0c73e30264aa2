"""Moved: loading a trained run to :mod:`visattn.predict`, the training state to
:mod:`visattn.train.checkpoint`; this alias is kept for one release. The training names load on first
use, so that ``load_trained_model`` needs no training dependency here either."""
from visattn._moved import moved_attributes, warn_moved
from visattn.predict import BEST_WEIGHTS, LAST_WEIGHTS, MODEL_FILE, load_trained_model

warn_moved(__name__, "visattn.predict (load_trained_model) and visattn.train.checkpoint")

_TRAINING_NAMES = (
    "CHECKPOINTS", "CONFIG_FILE", "TRAINER_STATE", "RunDirError", "check_run_dir", "is_run_dir", "list_checkpoints",
    "load_checkpoint", "save_checkpoint", "save_weights", "start_run_dir", "write_atomically", "write_model_file",
)
__getattr__ = moved_attributes(__name__, {name: f"visattn.train.checkpoint:{name}" for name in _TRAINING_NAMES}, warn=False)

__all__ = ["BEST_WEIGHTS", "LAST_WEIGHTS", "MODEL_FILE", "load_trained_model", *_TRAINING_NAMES]
