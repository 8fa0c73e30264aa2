"""Predicting classes of images with a trained model: the model with its transform and class names
(:class:`Predictor`), and top-k class probabilities for images, batch by batch (:func:`predict`).

    predictor = load_predictor("runs/digits-axial")              # best weights, recorded transform
    for result in predict(predictor, ["a.png", "b.jpg"], top_k=3):
        print(result.path, result.top_k)                        # [("7", 0.93), ("1", 0.04), ("9", 0.01)]
"""
from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn as nn
from PIL import Image
from timm.data import create_transform, resolve_model_data_config

from visattn.predict.images import UnreadableImageError, read_image, to_rgb
from visattn.predict.run_dir import MODEL_FILE, load_trained_model, missing_run_info, read_model_file
from visattn.predict.tiling import Tiling, smaller_than_tile, tiled_input

DEFAULT_BATCH_SIZE = 32


@dataclass(frozen=True)
class Predictor:
    """A model in eval mode on ``device``, with the transform it was evaluated with and its class names.

    ``transform``: PIL RGB image -> (3, H, W) float tensor, timm's ``create_transform`` of ``data_config``
    (timm's vocabulary: input_size, interpolation, mean, std, crop_pct, crop_mode). ``class_names[i]``
    names the model's output ``i``.
    """

    model: nn.Module
    transform: Callable[[Image.Image], torch.Tensor]
    class_names: tuple[str, ...]
    data_config: dict[str, Any]
    device: torch.device

    @classmethod
    def from_model(cls, model: nn.Module, device: str | torch.device | None = None) -> Predictor:
        """``model`` (put in eval mode, moved to ``device`` when given) with the data config of its
        ``pretrained_cfg`` and its ``label_names``, else the class indices as names.

        A model from :func:`~visattn.predict.load_trained_model` carries the run's recorded ones.
        """
        target = resolve_device(device) if device is not None else next(model.parameters()).device
        model = model.to(target).eval()
        data_config = resolve_model_data_config(model)
        names = model.pretrained_cfg.get("label_names") or [str(index) for index in range(model.num_classes)]
        if len(names) != model.num_classes:
            raise ValueError(f"the model has {model.num_classes} classes but its pretrained_cfg {len(names)} label_names")
        return cls(
            model=model, transform=create_transform(is_training=False, **data_config), class_names=tuple(names),
            data_config=data_config, device=target,
        )


class Prediction(NamedTuple):
    """One image's result: ``top_k`` (class name, probability) pairs, most probable first; or, for an image
    that could not be read, no pairs and the reason in ``error``. ``path`` is None for an in-memory image."""

    path: str | None
    top_k: list[tuple[str, float]]
    error: str | None = None


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``device``, or this machine's accelerator (CUDA, MPS, ...) where there is one, else the CPU.

    ValueError for a name torch does not know or a device this machine does not have.
    """
    available = ["cpu"]
    if torch.accelerator.is_available():
        available.append(torch.accelerator.current_accelerator().type)
    if device is None:
        return torch.device(available[-1])
    try:
        chosen = torch.device(device)
    except RuntimeError:
        raise ValueError(f"device {device!r} is not a torch device; this machine has {', '.join(available)}") from None
    if chosen.type not in available:
        raise ValueError(f"device {device!r} is not available here; this machine has {', '.join(available)}")
    if chosen.type != "cpu" and chosen.index is not None and chosen.index >= torch.accelerator.device_count():
        raise ValueError(f"device {device!r} is not available here; this machine has {torch.accelerator.device_count()} "
                         f"{chosen.type} device(s), {chosen.type}:0 to {chosen.type}:{torch.accelerator.device_count() - 1}")
    return chosen


def load_predictor(
    run_dir: str | Path, which: str = "best", device: str | torch.device | None = None, **overrides: Any
) -> Predictor:
    """The model trained in ``run_dir`` (``which``: "best" or "last" weights) on ``device`` (default: the
    accelerator where there is one, else the CPU), with its recorded transform and class names.

    For a run whose model.json predates the data config and class names, a UserWarning says what was
    derived instead (see :mod:`visattn.predict.run_dir`). FileNotFoundError or ValueError, naming the
    file, for a directory that is not a finished run.
    """
    target = resolve_device(device)
    missing = missing_run_info(read_model_file(run_dir))
    if missing:
        warnings.warn(
            f"{Path(run_dir) / MODEL_FILE} has no {' or '.join(missing)} (written by an older visattn): using the "
            "model's img_size, bicubic resize with crop_pct 1.0, ImageNet mean/std and class indices as names; "
            f"`python train.py --run-dir {run_dir} --resume` records them",
            UserWarning,
            stacklevel=2,
        )
    return Predictor.from_model(load_trained_model(run_dir, which, **overrides), target)


def iter_predictions(
    model_or_predictor: nn.Module | Predictor,
    images: Iterable[str | Path | Image.Image],
    top_k: int = 5,
    batch_size: int = DEFAULT_BATCH_SIZE,
    tiling: Tiling | None = None,
) -> Iterator[Prediction]:
    """:func:`predict`, one result at a time, reading only ``batch_size`` images ahead (one image at a time
    with ``tiling``)."""
    if top_k < 1:
        raise ValueError(f"top_k must be at least 1, got {top_k}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    predictor = model_or_predictor if isinstance(model_or_predictor, Predictor) else Predictor.from_model(model_or_predictor)
    k = min(top_k, len(predictor.class_names))
    if tiling is not None:
        yield from _iter_tiled_predictions(predictor, images, k, tiling.wrap(predictor.model, batch_size))
        return
    items = iter(images)
    while chunk := list(islice(items, batch_size)):
        errors: list[str | None] = []
        tensors: list[torch.Tensor] = []  # each (3, H, W)
        for item in chunk:
            try:
                image = _read(item)
            except UnreadableImageError as error:
                errors.append(str(error))
                continue
            errors.append(None)
            tensors.append(predictor.transform(image))
        ranked = iter(_top_k(predictor, predictor.model, tensors, k))
        for item, error in zip(chunk, errors):
            path = _path(item)
            yield Prediction(path, [], error) if error is not None else Prediction(path, next(ranked))


def _iter_tiled_predictions(
    predictor: Predictor, images: Iterable[str | Path | Image.Image], k: int, tiled: nn.Module
) -> Iterator[Prediction]:
    """Each image alone (sizes differ), at its own size, through ``tiled`` (a TiledViT of the predictor's model)."""
    patch_size = tuple(predictor.model.patch_embed.patch_size)
    for item in images:
        try:
            image = _read(item)
        except UnreadableImageError as error:
            yield Prediction(_path(item), [], str(error))
            continue
        reason = smaller_than_tile(image, tiled.tile)
        if reason is not None:
            yield Prediction(_path(item), [], reason)
            continue
        tensor = tiled_input(image, predictor.data_config, patch_size)  # (3, H, W)
        yield Prediction(_path(item), _top_k(predictor, tiled, [tensor], k)[0])


def _read(item: str | Path | Image.Image) -> Image.Image:
    return to_rgb(item) if isinstance(item, Image.Image) else read_image(item)


def _path(item: str | Path | Image.Image) -> str | None:
    return None if isinstance(item, Image.Image) else str(item)


def _top_k(predictor: Predictor, model: nn.Module, tensors: list[torch.Tensor], k: int) -> list[list[tuple[str, float]]]:
    """The ``k`` most probable (class name, probability) pairs of ``model`` on each image of ``tensors``
    (each (3, H, W), stacked into one batch)."""
    if not tensors:
        return []
    with torch.inference_mode():
        logits = model(torch.stack(tensors).to(predictor.device))  # (B, num_classes)
    probabilities, indices = logits.float().softmax(dim=-1).topk(k, dim=-1)  # each (B, k)
    return [
        [(predictor.class_names[index], probability) for probability, index in zip(row_probs, row_indices)]
        for row_probs, row_indices in zip(probabilities.tolist(), indices.tolist())
    ]


def predict(
    model_or_predictor: nn.Module | Predictor,
    images: Iterable[str | Path | Image.Image],
    top_k: int = 5,
    batch_size: int = DEFAULT_BATCH_SIZE,
    tiling: Tiling | None = None,
) -> list[Prediction]:
    """The ``top_k`` most probable classes of each image, in the order given, ``batch_size`` images a forward.

    ``images``: file paths or PIL images. A file that cannot be read gives a :class:`Prediction` with its
    ``error`` and no classes; the others are predicted all the same. A bare model is used with
    :meth:`Predictor.from_model` (its ``pretrained_cfg`` data config, on the device it is on). ``top_k``
    beyond the number of classes gives them all.

    ``tiling``: each image at its own size, cut into tiles merged by :class:`visattn.tiled.TiledViT`
    (:mod:`visattn.predict.tiling`), ``batch_size`` tiles a forward; the model must take the tile size (its
    ``img_size``, or any with ``dynamic_img_size=True``). ValueError for a tile or overlap it cannot take.
    """
    return list(iter_predictions(model_or_predictor, images, top_k, batch_size, tiling))
