"""``attn="auto"``: the fastest attention type for a model and an image size.

The choice depends on the number of patch tokens. It comes from a calibration measured on this machine
(``visattn-bench --calibrate`` writes ``calibration.json`` under ``$XDG_CACHE_HOME/visattn``, by default
``~/.cache/visattn``) or, for a model without calibration, from :data:`DEFAULT_THRESHOLDS`. Only speed
is considered; the types differ in what they can learn, which the caller may weigh differently.

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
from collections.abc import Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from visattn.layers import list_attentions
from visattn.models.shapes import MODEL_SHAPES, patch_grid

logger = logging.getLogger(__name__)

CALIBRATION_VERSION = 1

# (from this many patch tokens on, use this type), ascending: the calibration of ViT-S/16 that
# `visattn-bench --sizes 224 384 512 1024 2048 --train-sizes 224 384 512 1024 --calibrate` writes on a
# 2-core CPU (fp32, batch 1, training steps), the README's benchmark run; each switch sits at the geometric
# midpoint of the two measured sizes around it.
DEFAULT_THRESHOLDS: tuple[tuple[int, str], ...] = ((0, "softmax"), (336, "linear"), (2048, "linformer"))

# The types auto chooses among: every attention of the registry; "floor" mixes no tokens.
NOT_CHOSEN = frozenset({"floor"})


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


def save_calibration(
    model_name: str,
    thresholds: list[tuple[int, str]],
    details: Mapping[str, Any],
    path: Path | None = None,
) -> Path:
    """Write (or replace) the calibration of ``model_name``; other models' entries are kept."""
    path = path or calibration_path()
    data = _read(path) if path.exists() else {"version": CALIBRATION_VERSION, "models": {}}
    data["models"][model_name] = {
        "thresholds": [[int(t), name] for t, name in thresholds],
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        **details,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def _read(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or data.get("version") != CALIBRATION_VERSION or not isinstance(data.get("models"), dict):
        raise ValueError(f"{path}: not a visattn calibration file of version {CALIBRATION_VERSION}")
    return data


def _calibrated_thresholds(model_name: str, path: Path) -> list[tuple[int, str]] | None:
    """The calibrated thresholds of ``model_name``, or None (with a warning if the file is unusable)."""
    if not path.exists():
        return None
    try:
        entry = _read(path)["models"].get(model_name)
        if entry is None:
            return None
        thresholds = [(int(t), str(name)) for t, name in entry["thresholds"]]
        unknown = [name for _, name in thresholds if name not in list_attentions()]
        if unknown:
            raise ValueError(f"unknown attention type(s) {', '.join(unknown)}")
        if min(thresholds, default=(1, ""))[0] != 0:
            raise ValueError("the thresholds must start at 0 tokens")
    except (ValueError, KeyError, TypeError) as err:
        logger.warning("ignoring calibration %s for %s (%s); using the built-in defaults", path, model_name, err)
        return None
    return sorted(thresholds)


def select_attention(
    model_name: str, img_size: tuple[int, int], patch_size: tuple[int, int] | None = None
) -> str:
    """The fastest attention type for ``model_name`` on images of ``img_size`` (height, width) pixels.

    The choice goes by patch tokens, counted with ``patch_size`` (a model built with another patch size
    than its name's) or else the name's. Uses this machine's calibration of the model if there is one,
    else :data:`DEFAULT_THRESHOLDS`; the choice is logged at INFO level.
    """
    tokens = num_patch_tokens(model_name, img_size, patch_size)
    path = calibration_path()
    thresholds = _calibrated_thresholds(model_name, path)
    source = f"calibration {path}" if thresholds else "built-in defaults"
    choice = [name for min_tokens, name in (thresholds or DEFAULT_THRESHOLDS) if tokens >= min_tokens][-1]
    logger.info(
        "attn='auto': %r for %s at %dx%d px (%d patch tokens), from %s",
        choice, model_name, img_size[0], img_size[1], tokens, source,
    )
    return choice
