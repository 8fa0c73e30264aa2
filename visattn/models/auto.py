"""``attn="auto"``: the fastest attention type for a model, an image size and a batch size.

The choice depends on the number of patch tokens and on the batch size. It comes from a calibration
measured on this machine (``visattn-bench --calibrate`` writes ``calibration.json`` under
``$XDG_CACHE_HOME/visattn``, by default ``~/.cache/visattn``) or, for a model without calibration, from
:data:`DEFAULT_CALIBRATION` (batch 1). Only speed is considered; the types differ in what they can learn,
which the caller may weigh differently.

Batch sizes: a calibration holds token thresholds per measured batch size (``visattn-bench --calibrate
--batch-size 1 16`` measures two; a later run at another batch size adds its own, as long as mode, device
and dtype agree). A model is chosen for with the thresholds of the calibrated batch size nearest to its
own (by ratio: 16 is nearer 64 than 1), so calibrate at the batch size you run at. A batch size or a
token count outside the calibrated range is still served, by the nearest batch size's thresholds, and
logged as a warning.

Devices: the thresholds above were measured on a CPU and apply to CPU models only. On CUDA a
calibration measured on a GPU (``visattn-bench --device cuda --calibrate``) is used where there is one;
without it, :func:`cuda_choice` decides from the layers' cost models by a provisional rule, not yet
checked against a GPU measurement. The device is the ``device`` argument of :func:`select_attention`,
else torch's default device (``with torch.device("cuda"): timm.create_model(..., attn="auto")``).

The choice is made once, when the model is built, for the image size it is built with
(``timm.create_model(..., img_size=...)``). It does not follow the grid of later inputs
(``dynamic_img_size=True``): the candidate types carry different parameters (linear's locality
convolution, linformer's projections), so a model trained with one type cannot switch to another at
a new image size without weights it never learned. Build the model at the size it will run at.
"""
from __future__ import annotations

import json
import logging
import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from visattn.layers import get_attention, list_attentions
from visattn.layers.registry import attention_options
from visattn.layers.cost import CostCase, TokenLayout
from visattn.models.shapes import MODEL_SHAPES, patch_grid

logger = logging.getLogger(__name__)

CALIBRATION_VERSION = 2
# A model's calibration holds one setting; its batch sizes are merged only within it.
SETTING_KEYS = ("mode", "device", "dtype")


@dataclass(frozen=True)
class BatchCalibration:
    """The thresholds measured at one batch size: ``(from this many patch tokens on, use this type)``,
    ascending from 0, and the smallest and largest token counts they were measured at."""

    thresholds: tuple[tuple[int, str], ...]
    tokens: tuple[int, int]
    # the measurements behind them, kept in the file for reference: {tokens: {type: seconds per image}}
    seconds_per_image: Mapping[int, Mapping[str, float]] = field(default_factory=dict, compare=False)


# (from this many patch tokens on, use this type), ascending: the calibration of ViT-S/16 that
# `visattn-bench --sizes 224 384 512 1024 2048 --train-sizes 224 384 512 1024 --calibrate` writes on a
# 2-core CPU (fp32, batch 1, training steps at 196 to 4,096 tokens), the README's benchmark run; each
# switch sits at the geometric midpoint of the two measured sizes around it.
DEFAULT_THRESHOLDS: tuple[tuple[int, str], ...] = ((0, "softmax"), (336, "linear"), (2048, "linformer"))
DEFAULT_CALIBRATION: dict[int, BatchCalibration] = {1: BatchCalibration(DEFAULT_THRESHOLDS, (196, 4096))}

# The types auto chooses among: every attention of the registry; "floor" mixes no tokens.
NOT_CHOSEN = frozenset({"floor"})

# CUDA without a GPU calibration (provisional until measured on a GPU): timm's softmax runs FlashAttention
# (dense tensor-core matmuls), which the other types' kernels are assumed to reach at 1/CUDA_EFFICIENCY_GAP
# of its FLOP rate. A type other than softmax is chosen only where its mixing FLOPs, times that gap, are
# below softmax's, and then the type of fewest mixing FLOPs: with ViT-S (6 heads of 64) softmax up to
# 1,024 patch tokens (512 px) and neighborhood from 1,600 (640 px) on.
CUDA_EFFICIENCY_GAP = 25
CUDA_FALLBACK_HEADS = (6, 64)  # (heads, head width) of a model not in MODEL_SHAPES: ViT-S


def cuda_choice(model_name: str, grid: tuple[int, int], gap: float = CUDA_EFFICIENCY_GAP) -> str:
    """The type :func:`select_attention` picks on CUDA without a GPU calibration, from the layers' cost
    models (``mixing_flops`` with each type's default options at ``grid``, one class token): ``softmax``
    unless another type's mixing FLOPs times ``gap`` are below softmax's, then the cheapest of those.
    Provisional: the gap is an assumption, not a measurement."""
    shape = MODEL_SHAPES.get(model_name)
    heads, head_dim = CUDA_FALLBACK_HEADS if shape is None else (shape["num_heads"], shape["embed_dim"] // shape["num_heads"])
    layout = TokenLayout(tuple(grid), 1)
    flops = {}
    for name in list_attentions():
        if name in NOT_CHOSEN:
            continue
        options = attention_options(name, {}, tuple(grid))
        flops[name] = get_attention(name).mixing_flops(CostCase(layout, heads, head_dim, options))
    cheapest = min((n for n in flops if n != "softmax"), key=flops.get)
    return cheapest if gap * flops[cheapest] < flops["softmax"] else "softmax"


def calibration_path() -> Path:
    """``$XDG_CACHE_HOME/visattn/calibration.json`` (``~/.cache`` when the variable is unset)."""
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "visattn" / "calibration.json"


def patch_size_of(model_name: str) -> tuple[int, int]:
    """The patch size of a registered visattn model, or the ``patch<N>`` in a timm-style name."""
    if model_name in MODEL_SHAPES:
        p = MODEL_SHAPES[model_name]["patch_size"]
        return (p, p)
    match = re.search(r"patch(\d+)", model_name)
    if match is None:
        raise ValueError(
            f"cannot tell the patch size of {model_name!r}: not one of {', '.join(MODEL_SHAPES)} and no "
            "'patch<N>' in the name"
        )
    p = int(match.group(1))
    return (p, p)


def num_patch_tokens(model_name: str, img_size: tuple[int, int], patch_size: tuple[int, int] | None = None) -> int:
    """Patch tokens of ``img_size`` (height, width) with ``patch_size``, by default the model's own."""
    rows, cols = patch_grid(img_size, patch_size or patch_size_of(model_name))
    return rows * cols


def thresholds_from_timings(seconds_per_image: Mapping[int, Mapping[str, float]]) -> list[tuple[int, str]]:
    """Token-count thresholds from measurements: at each measured token count the fastest eligible type
    wins, and a new winner takes over halfway (geometrically) between two measured counts.

    Args:
        seconds_per_image: {patch tokens: {attention name: seconds per image}}.
    Returns:
        [(min_tokens, name), ...] ascending, the first at 0.
    """
    winners: list[tuple[int, str]] = []
    for tokens in sorted(seconds_per_image):
        eligible = {name: s for name, s in seconds_per_image[tokens].items() if name not in NOT_CHOSEN}
        if eligible:
            winners.append((tokens, min(eligible, key=eligible.get)))
    if not winners:
        raise ValueError("no measured attention type to calibrate from (floor is never chosen)")
    thresholds = [(0, winners[0][1])]
    for (prev_tokens, _), (tokens, name) in zip(winners, winners[1:]):
        if name != thresholds[-1][1]:
            thresholds.append((math.ceil(math.sqrt(prev_tokens * tokens)), name))
    return thresholds


def calibration_from_timings(seconds_per_image: Mapping[int, Mapping[str, float]]) -> BatchCalibration:
    """The calibration of one batch size: :func:`thresholds_from_timings` and the token counts measured."""
    measured = [t for t, times in seconds_per_image.items() if any(name not in NOT_CHOSEN for name in times)]
    thresholds = thresholds_from_timings(seconds_per_image)
    return BatchCalibration(tuple(thresholds), (min(measured), max(measured)), seconds_per_image)


def save_calibration(
    model_name: str,
    batches: Mapping[int, BatchCalibration],
    details: Mapping[str, Any],
    path: Path | None = None,
) -> Path:
    """Write the calibration of ``model_name`` at the batch sizes of ``batches``; other models' entries are
    kept, and so are this model's other batch sizes where ``details`` agree on mode, device and dtype
    (else they are dropped: a calibration holds one setting). A file that cannot be read is replaced."""
    path = path or calibration_path()
    data = {"version": CALIBRATION_VERSION, "models": {}}
    if path.exists():
        try:
            data = _read(path)
        except (ValueError, OSError) as err:
            logger.warning("replacing unusable calibration file %s (%s)", path, err)
    entry = data["models"].get(model_name, {})
    same_setting = all(entry.get(key) == details.get(key) for key in SETTING_KEYS)
    kept = entry.get("batches", {}) if same_setting else {}
    created = datetime.now(timezone.utc).isoformat(timespec="seconds")
    data["models"][model_name] = {
        **details,
        "batches": {
            **kept,
            **{str(b): _batch_entry(c, created) for b, c in batches.items()},
        },
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def _batch_entry(calibration: BatchCalibration, created: str) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "thresholds": [[int(t), name] for t, name in calibration.thresholds],
        "tokens": list(calibration.tokens),
        "created": created,
    }
    if calibration.seconds_per_image:
        entry["seconds_per_image"] = {str(t): dict(v) for t, v in sorted(calibration.seconds_per_image.items())}
    return entry


def _read(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or data.get("version") != CALIBRATION_VERSION or not isinstance(data.get("models"), dict):
        raise ValueError(f"{path}: not a visattn calibration file of version {CALIBRATION_VERSION}")
    return data


def _batch_calibration(entry: Mapping[str, Any]) -> BatchCalibration:
    thresholds = tuple(sorted((int(t), str(name)) for t, name in entry["thresholds"]))
    unknown = [name for _, name in thresholds if name not in list_attentions()]
    if unknown:
        raise ValueError(f"unknown attention type(s) {', '.join(unknown)}")
    if not thresholds or thresholds[0][0] != 0:
        raise ValueError("the thresholds must start at 0 tokens")
    low, high = (int(t) for t in entry["tokens"])
    if not 0 < low <= high:
        raise ValueError(f"measured tokens must be 0 < smallest <= largest, got {low}, {high}")
    return BatchCalibration(thresholds, (low, high))


def _calibrated(model_name: str, path: Path, device_type: str = "cpu") -> dict[int, BatchCalibration] | None:
    """The calibration of ``model_name`` by batch size measured on a device of ``device_type`` (``cpu``,
    ``cuda``), or None (with a warning if the file is unusable)."""
    if not path.exists():
        return None
    try:
        entry = _read(path)["models"].get(model_name)
        if entry is None or torch.device(entry.get("device", "cpu")).type != device_type:
            return None
        batches = {int(b): _batch_calibration(c) for b, c in entry["batches"].items()}
        if not batches or min(batches) < 1:
            raise ValueError("no batch size >= 1 calibrated")
    except (ValueError, KeyError, TypeError) as err:
        logger.warning("ignoring calibration %s for %s (%s); using the built-in defaults", path, model_name, err)
        return None
    return batches


def nearest_batch_size(calibrated: Iterable[int], batch_size: int) -> int:
    """The calibrated batch size nearest to ``batch_size`` by ratio (log scale: 16 is nearer 64 than 1);
    of two equally near, the smaller."""
    return min(calibrated, key=lambda b: (abs(math.log(b / batch_size)), b))


def check_auto_batch_size(attn: Any, auto_batch_size: int | None) -> None:
    """ValueError unless ``auto_batch_size`` is None, or a positive int given with ``attn="auto"``."""
    if auto_batch_size is None:
        return
    if not isinstance(attn, str) or attn != "auto":
        raise ValueError(f"auto_batch_size applies to attn='auto' only, got attn={attn!r}")
    if isinstance(auto_batch_size, bool) or not isinstance(auto_batch_size, int) or auto_batch_size < 1:
        raise ValueError(f"auto_batch_size must be an int >= 1, got {auto_batch_size!r}")


def select_attention(
    model_name: str,
    img_size: tuple[int, int],
    patch_size: tuple[int, int] | None = None,
    batch_size: int = 1,
    device: str | torch.device | None = None,
) -> str:
    """The fastest attention type for ``model_name`` on images of ``img_size`` (height, width) pixels, in
    batches of ``batch_size``, on ``device`` (default: torch's default device).

    On CUDA: this machine's GPU calibration of the model if there is one, else :func:`cuda_choice`
    (provisional, see the module docstring). On CPU:
    The choice goes by patch tokens, counted with ``patch_size`` (a model built with another patch size
    than its name's) or else the name's, with the thresholds calibrated at the batch size nearest to
    ``batch_size`` (:func:`nearest_batch_size`). Uses this machine's CPU calibration of the model if
    there is one, else :data:`DEFAULT_CALIBRATION`. The choice is logged at INFO level; a batch size or token
    count outside the range the calibration measured is logged as a WARNING.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    device_type = torch.device(device if device is not None else torch.get_default_device()).type
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu or cuda, got {device!r}")
    grid = patch_grid(img_size, patch_size or patch_size_of(model_name))
    tokens = grid[0] * grid[1]
    path = calibration_path()
    batches = _calibrated(model_name, path, device_type)
    if batches is None and device_type == "cuda":
        choice = cuda_choice(model_name, grid)
        logger.info(
            "attn='auto': %r for %s at %dx%d px (%d patch tokens) on cuda, from the cost models (provisional rule)",
            choice, model_name, img_size[0], img_size[1], tokens,
        )
        return choice
    source = f"calibration {path}" if batches else "built-in defaults"
    batches = batches or DEFAULT_CALIBRATION
    nearest = nearest_batch_size(batches, batch_size)
    calibration = batches[nearest]
    choice = [name for min_tokens, name in calibration.thresholds if tokens >= min_tokens][-1]
    logger.info(
        "attn='auto': %r for %s at %dx%d px (%d patch tokens), from %s at batch %d (asked: batch %d)",
        choice, model_name, img_size[0], img_size[1], tokens, source, nearest, batch_size,
    )
    outside = []
    if not min(batches) <= batch_size <= max(batches):
        outside.append(f"batch {batch_size} (calibrated: batch {', '.join(map(str, sorted(batches)))})")
    low, high = calibration.tokens
    if not low <= tokens <= high:
        outside.append(f"{tokens} patch tokens (measured at batch {nearest}: {low} to {high})")
    if outside:
        logger.warning(
            "attn='auto' for %s extrapolates %r beyond what the %s measured: %s; to measure it on this machine: %s",
            model_name, choice, source, "; ".join(outside),
            calibrate_command(model_name, img_size, patch_size, batch_size, device_type),
        )
    return choice


def calibrate_command(
    model_name: str, img_size: tuple[int, int], patch_size: tuple[int, int] | None, batch_size: int, device_type: str,
) -> str:
    """The ``visattn-bench --calibrate`` command that measures ``model_name`` at this image size, patch size,
    batch size and device, so that :func:`select_attention` chooses there without extrapolating."""
    height, width = img_size
    words = ["visattn-bench --calibrate --model", model_name, "--batch-size", str(batch_size),
             "--sizes", str(height) if height == width else f"{height}x{width}"]
    if patch_size is not None and tuple(patch_size) != patch_size_of(model_name):
        ph, pw = patch_size
        words += ["--model-kwargs", f"patch_size={ph}" if ph == pw else f"'patch_size=[{ph}, {pw}]'"]
    if device_type == "cuda":
        words += ["--device cuda"]
    return " ".join(words)
