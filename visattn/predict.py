"""Loading a model trained by ``train.py`` from its run directory.

What this reads from a run directory (the training side writes them; see :mod:`visattn.train.checkpoint`)::

    model.json                timm.create_model name and keywords of the trained model
    model_best.safetensors    weights of the epoch with the best evaluation accuracy
    model_last.safetensors    weights after the last finished epoch
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch.nn as nn
from safetensors.torch import load_file
from timm.models.vision_transformer import checkpoint_filter_fn

from visattn.models import create_model

MODEL_FILE = "model.json"
BEST_WEIGHTS = "model_best.safetensors"
LAST_WEIGHTS = "model_last.safetensors"


def load_trained_model(run_dir: str | Path, which: str = "best", **overrides: Any) -> nn.Module:
    """The model trained in ``run_dir`` with its ``which`` ("best" or "last") weights, in eval mode.

    The model is :func:`visattn.models.create_model` of the name and keywords recorded in
    ``run_dir/model.json`` (a ``visattn_vit_*`` model, or a timm ViT converted), the weights loaded
    strictly through timm's ``checkpoint_filter_fn``; ``overrides`` replace recorded keywords (e.g. ``drop_path_rate=0.0``).
    """
    if which not in ("best", "last"):
        raise ValueError(f"which must be 'best' or 'last', got {which!r}")
    run_dir = Path(run_dir)
    weights = run_dir / (BEST_WEIGHTS if which == "best" else LAST_WEIGHTS)
    if not weights.is_file():
        raise FileNotFoundError(f"{weights} does not exist; is {run_dir} a finished (or checkpointed) visattn run?")
    info = json.loads((run_dir / MODEL_FILE).read_text())
    kwargs = {**info["kwargs"], **overrides}
    model = create_model(info["model"], **kwargs)
    # timm's filter resamples the position embeddings when the overrides change the image size
    model.load_state_dict(checkpoint_filter_fn(load_file(str(weights)), model))
    return model.eval()
