"""The calibration of ``attn="auto"`` (:mod:`visattn.models.auto`), written from a model sweep: token
thresholds at each batch size the sweep measured."""
from __future__ import annotations

import argparse
from typing import Any

from visattn.bench.sweep import TILED, TIMM, Result
from visattn.models.auto import calibration_from_timings, save_calibration


def seconds_per_image(results: list[Result], mode: str) -> dict[int, dict[int, dict[str, float]]]:
    """{batch size: {patch tokens: {type: median seconds per image}}} of the rows of ``mode`` that ran
    (timm and tiled aside: auto chooses among visattn's types)."""
    timings: dict[int, dict[int, dict[str, float]]] = {}
    for r in results:
        if r.case.mode == mode and r.ok and r.case.attn not in (TIMM, TILED):
            timings.setdefault(r.case.batch_size, {}).setdefault(r.tokens, {})[r.case.attn] = r.step_time / r.case.batch_size
    return timings


def calibrate(results: list[Result], args: argparse.Namespace) -> dict[str, Any]:
    """Write the thresholds of ``attn="auto"`` from this sweep, per batch size: from the training steps where
    any training row ran, else from inference. Returns where, and per batch size the thresholds and the token
    range measured."""
    timings = {mode: seconds_per_image(results, mode) for mode in ("train", "infer")}
    mode = "train" if timings["train"] else "infer"
    batches = {b: calibration_from_timings(t) for b, t in timings[mode].items()}
    if not batches:
        raise ValueError("no row ran: nothing to calibrate from")
    path = save_calibration(args.model, batches, {"mode": mode, "device": args.device, "dtype": args.dtype})
    return {
        "path": str(path),
        "mode": mode,
        "batches": {
            str(b): {"thresholds": [list(t) for t in c.thresholds], "tokens": list(c.tokens)} for b, c in batches.items()
        },
    }
