"""The calibration of ``attn="auto"`` (:mod:`visattn.models.auto`), written from a model sweep."""
from __future__ import annotations

import argparse
from typing import Any

from visattn.bench.sweep import TILED, TIMM, Result
from visattn.models.auto import save_calibration, thresholds_from_timings


def calibrate(results: list[Result], args: argparse.Namespace) -> dict[str, Any]:
    """Write the thresholds of ``attn="auto"`` from this sweep: training step if measured, else inference.
    Returns where, and the thresholds."""
    mode = "train" if "train" in args.modes else "infer"
    timings: dict[int, dict[str, float]] = {}
    for r in results:
        if r.case.mode == mode and r.ok and r.case.attn not in (TIMM, TILED):
            timings.setdefault(r.tokens, {})[r.case.attn] = r.step_time / r.case.batch_size
    thresholds = thresholds_from_timings(timings)
    details = {
        "mode": mode, "device": args.device, "dtype": args.dtype, "batch_size": args.batch_size,
        "seconds_per_image": {str(t): v for t, v in sorted(timings.items())},
    }
    return {"path": str(save_calibration(args.model, thresholds, details)), "thresholds": thresholds}
