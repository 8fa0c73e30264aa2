"""Loading a model trained by ``train.py`` from its run directory.

What this reads from a run directory (the training side writes them; see :mod:`visattn.train.checkpoint`)::

    model.json                timm.create_model name and keywords of the trained model ("model", "kwargs"),
                              the evaluation data config in timm's vocabulary ("data_config": input_size,
                              interpolation, mean, std, crop_pct, crop_mode) and the class names ("class_names")
    model_best.safetensors    weights of the epoch with the best validation accuracy
    model_last.safetensors    weights after the last finished epoch

The data config and class names go into the model's ``pretrained_cfg`` (``label_names`` for the class
names), so ``timm.data.resolve_model_data_config(model)`` gives back the transform's settings.

A run written before model.json held them still loads: the input size comes from the recorded
``img_size``, the interpolation and crop are those the training code has always evaluated with, the
mean and std are timm's ImageNet defaults, and the class names are the class indices.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch.nn as nn
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.models.vision_transformer import checkpoint_filter_fn

from visattn.models import create_model

MODEL_FILE = "model.json"
BEST_WEIGHTS = "model_best.safetensors"
LAST_WEIGHTS = "model_last.safetensors"
WEIGHTS = {"best": BEST_WEIGHTS, "last": LAST_WEIGHTS}
DATA_CONFIG_KEYS = ("input_size", "interpolation", "mean", "std", "crop_pct", "crop_mode")


def read_model_file(run_dir: str | Path) -> dict[str, Any]:
    """``run_dir/model.json``, checked: "model" and "kwargs" always; "data_config" and "class_names" where the
    run recorded them. FileNotFoundError or ValueError naming what is missing or malformed."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory {run_dir} does not exist")
    path = run_dir / MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; is {run_dir} a visattn run directory (made by train.py)?")
    try:
        info = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(info, dict):
        raise ValueError(f"{path} holds a {type(info).__name__}, not an object with 'model' and 'kwargs'")
    missing = [key for key in ("model", "kwargs") if key not in info]
    if missing:
        raise ValueError(f"{path} lacks {' and '.join(repr(key) for key in missing)}")
    if "num_classes" not in info["kwargs"]:
        raise ValueError(f"{path} lacks 'num_classes' in 'kwargs'")
    num_classes = info["kwargs"]["num_classes"]
    if "data_config" in info:
        absent = [key for key in DATA_CONFIG_KEYS if key not in info["data_config"]]
        if absent:
            raise ValueError(f"{path}: 'data_config' lacks {', '.join(absent)}")
    if "class_names" in info and len(info["class_names"]) != num_classes:
        raise ValueError(f"{path} has {len(info['class_names'])} class names for {num_classes} classes")
    return info


def missing_run_info(info: dict[str, Any]) -> list[str]:
    """The keys of a current model.json that ``info`` (an older one) lacks: "data_config", "class_names"."""
    return [key for key in ("data_config", "class_names") if key not in info]


def weights_file(run_dir: str | Path, which: str) -> Path:
    """``run_dir``'s ``which`` ("best" or "last") weights; FileNotFoundError if they are not there yet."""
    if which not in WEIGHTS:
        raise ValueError(f"which must be 'best' or 'last', got {which!r}")
    run_dir = Path(run_dir)
    weights = run_dir / WEIGHTS[which]
    if not weights.is_file():
        raise FileNotFoundError(f"{weights} does not exist; is {run_dir} a finished (or checkpointed) visattn run?")
    try:  # only the header: a file that is not safetensors (a pickle, say) is refused before anything reads it
        with safe_open(str(weights), framework="pt") as handle:
            handle.keys()
    except SafetensorError as error:
        raise ValueError(f"{weights}: not a readable safetensors file ({error})") from None
    return weights


def recorded_data_config(info: dict[str, Any]) -> dict[str, Any]:
    """The data config of model.json ``info``, or for an older run the one derived as the module says."""
    if "data_config" in info:
        config = dict(info["data_config"])
    else:
        config = dict(interpolation="bicubic", mean=IMAGENET_DEFAULT_MEAN, std=IMAGENET_DEFAULT_STD, crop_pct=1.0,
                      crop_mode="center")
        size = info["kwargs"].get("img_size")
        if size is not None:
            height, width = (size, size) if isinstance(size, int) else size
            config["input_size"] = (3, height, width)
    return {key: tuple(value) if isinstance(value, list) else value for key, value in config.items()}


def recorded_class_names(info: dict[str, Any]) -> tuple[str, ...]:
    """The class names of model.json ``info``, or the class indices as text for an older run."""
    return tuple(info.get("class_names") or (str(index) for index in range(info["kwargs"]["num_classes"])))


def load_trained_model(run_dir: str | Path, which: str = "best", **overrides: Any) -> nn.Module:
    """The model trained in ``run_dir`` with its ``which`` ("best" or "last") weights, in eval mode.

    The model is :func:`visattn.models.create_model` of the name and keywords ``run_dir/model.json``
    records (a ``visattn_vit_*`` model, or a timm ViT converted), its weights loaded strictly through timm's
    ``checkpoint_filter_fn`` (which resamples the position embeddings when ``overrides`` change the image
    size), and the recorded data config and class names (``label_names``) put into its ``pretrained_cfg``.
    ``overrides`` replace recorded keywords (e.g. ``drop_path_rate=0.0``). FileNotFoundError or ValueError,
    naming the file, for a directory that is not a finished run or a model it cannot build.
    """
    info = read_model_file(run_dir)
    weights = weights_file(run_dir, which)
    try:
        model = create_model(info["model"], **{**info["kwargs"], **overrides})
        model.load_state_dict(checkpoint_filter_fn(load_file(str(weights)), model))
    except (SafetensorError, RuntimeError, TypeError, ValueError) as error:  # unknown model or keyword, mismatched weights
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        reason = " ".join(lines[:2] if lines[0].endswith(":") else lines[:1])  # torch's "Error(s) in loading ...:" + the first
        raise ValueError(f"cannot build {info['model']!r} of {Path(run_dir) / MODEL_FILE} with {weights}: {reason}") from error
    model.pretrained_cfg = {
        **model.pretrained_cfg, "num_classes": info["kwargs"]["num_classes"],
        "label_names": recorded_class_names(info), **recorded_data_config(info),
    }
    return model.eval()
