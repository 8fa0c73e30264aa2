"""Loading a model trained by ``train.py`` from its run directory.

What this reads from a run directory (the training side writes them; see :mod:`visattn.train.checkpoint`)::

    model.json                timm.create_model name and keywords of the trained model
    model_best.safetensors    weights of the epoch with the best evaluation accuracy
    model_last.safetensors    weights after the last finished epoch

Both are read without unpickling: model.json with ``json``, the weights with safetensors (through
timm's ``load_pretrained``, which picks safetensors by the file name); a file that is not what its
name says is a ValueError naming it.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import timm
import torch.nn as nn
from safetensors import SafetensorError, safe_open

MODEL_FILE = "model.json"
BEST_WEIGHTS = "model_best.safetensors"
LAST_WEIGHTS = "model_last.safetensors"


def load_trained_model(run_dir: str | Path, which: str = "best", **overrides: Any) -> nn.Module:
    """The model trained in ``run_dir`` with its ``which`` ("best" or "last") weights, in eval mode.

    Equivalent to ``timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=...,
    num_classes=...), **kwargs)`` with the name and keywords recorded in ``run_dir/model.json``;
    ``overrides`` replace recorded keywords (e.g. ``drop_path_rate=0.0``).
    """
    if which not in ("best", "last"):
        raise ValueError(f"which must be 'best' or 'last', got {which!r}")
    run_dir = Path(run_dir)
    weights = run_dir / (BEST_WEIGHTS if which == "best" else LAST_WEIGHTS)
    if not weights.is_file():
        raise FileNotFoundError(f"{weights} does not exist; is {run_dir} a finished (or checkpointed) visattn run?")
    try:
        with safe_open(str(weights), framework="pt") as handle:
            handle.keys()
    except SafetensorError as error:
        raise ValueError(f"{weights}: not a readable safetensors file ({error})") from None
    model_file = run_dir / MODEL_FILE
    try:
        info = json.loads(model_file.read_text())
        kwargs = {**info["kwargs"], **overrides}
        name, num_classes = info["model"], kwargs["num_classes"]
    except (UnicodeDecodeError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{model_file}: not the JSON train.py writes ({type(error).__name__}: {error})") from None
    overlay = dict(file=str(weights), num_classes=num_classes)
    return timm.create_model(name, pretrained=True, pretrained_cfg_overlay=overlay, **kwargs).eval()
