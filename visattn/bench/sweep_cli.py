"""``visattn-bench``, the sweep: parse the arguments, plan the sweep, measure it, write the reports.

The GPU table (ViT-S/16, bf16; each command one row setting, five output folders)::

    visattn-bench --device cuda --dtype bf16 --modes infer --sizes 224 --batch-size 128 --out bench_out/gpu_infer_224
    visattn-bench --device cuda --dtype bf16 --modes infer --sizes 1024 --batch-size 16 --out bench_out/gpu_infer_1024
    visattn-bench --device cuda --dtype bf16 --modes infer --sizes 2048 --batch-size 4 --out bench_out/gpu_infer_2048
    visattn-bench --device cuda --dtype bf16 --modes train --sizes 1024 --batch-size 8 --out bench_out/gpu_train_1024
    visattn-bench --device cuda --dtype bf16 --modes train --sizes 2048 --batch-size 2 --out bench_out/gpu_train_2048

``--model`` defaults to ``visattn_vit_small_patch16`` (ViT-S/16), against timm's ``vit_small_patch16_224``
built at each size; add ``--compile`` to time the compiled models (the first warm-up round compiles).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from typing import Any

import torch
from tqdm import tqdm

from visattn.bench.arguments import (
    MAX_TOKENS, MAX_TOKENS_SUMMARY, MEMORY_SYNTAX, add_shared_arguments, backend_argument, check_shared_arguments,
    memory_argument,
)
from visattn.bench.calibrate import calibrate
from visattn.bench.memory import capacity_bytes
from visattn.bench.runners import forced_backends
from visattn.bench.sweep import (
    FLOOR,
    MODES,
    TILED,
    TIMM,
    Result,
    check_tiled_sizes,
    default_tile,
    plan_model_sweep,
    plan_ops_sweep,
)
from visattn.bench.sweep_report import csv_rows, markdown_report, plot, write_csv
from visattn.bench.sweep_summary import summarize
from visattn.bench.targets import Verdict, check_targets
from visattn.bench.timing import Timing, measure, settle_on

DEFAULT_SIZES = ("224", "512", "1024", "2048")
DEFAULT_GRIDS = ("16x32", "32x64", "64x128", "128x256")


def _size(text: str) -> tuple[int, int]:
    """'224' -> (224, 224); '512x1024' -> (512, 1024)."""
    try:
        parts = [int(p) for p in text.lower().split("x")]
    except ValueError:
        parts = []
    if len(parts) == 1:
        parts *= 2
    if len(parts) != 2 or min(parts) < 1:
        raise argparse.ArgumentTypeError(f"size must be N or HxW with positive integers, got {text!r}")
    return parts[0], parts[1]


def build_parser() -> argparse.ArgumentParser:
    """The sweep's parser (``visattn-bench --help``)."""
    p = argparse.ArgumentParser(
        prog="visattn-bench",
        description="Throughput and peak memory of the visattn attention types vs timm's fused softmax attention.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog=f"visattn-bench {MAX_TOKENS} [--help]: {MAX_TOKENS_SUMMARY}.",
    )
    p.add_argument("--ops", action="store_true", help="time the attention ops alone (no model) on --grids")
    p.add_argument("--calibrate", action="store_true", help="also write the calibration of attn='auto' for --model")
    add_shared_arguments(p)
    p.add_argument("--sizes", type=_size, nargs="+", default=[_size(s) for s in DEFAULT_SIZES], help="image sizes: N or HxW")
    p.add_argument(
        "--train-sizes", type=_size, nargs="+", default=None,
        help="image sizes of the train mode, if not all of --sizes (a 2048^2 softmax training step takes minutes)",
    )
    p.add_argument("--grids", type=_size, nargs="+", default=[_size(s) for s in DEFAULT_GRIDS], help="token grids of --ops")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="infer: forward; train: forward, backward, AdamW")
    p.add_argument(
        "--batch-size", dest="batch_sizes", type=int, nargs="+", default=[1], metavar="BATCH_SIZE",
        help="images (q, k, v batch in --ops) per step; several values: each is measured at every size",
    )
    p.add_argument("--compile", action="store_true", help="torch.compile the model (the op in --ops); the first warm-up round compiles")
    p.add_argument(
        "--backend", dest="backends", type=backend_argument, action="append", default=[], metavar="OP=NAME",
        help="run every row with op OP on path NAME (visattn.ops.backends.force_backend), e.g. axial=sdpa; repeat "
        "for several ops",
    )
    p.add_argument(
        "--references", nargs="*", choices=[TIMM, FLOOR, TILED], default=[TIMM, FLOOR],
        help="reference rows of the model sweep; leave timm out where its step would take too long; tiled: timm's "
        "model at --tile px run on tiles of the image (visattn.tiled)",
    )
    p.add_argument("--tile", type=_size, help="tile size of the tiled row, N or HxW px; default: the timm model's input size")
    p.add_argument("--tile-overlap", type=int, default=0, help="least overlap of the tiled row's tiles, px (a multiple of the patch)")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds")
    p.add_argument("--min-iters", type=int, default=5, help="timed steps per row, at least")
    p.add_argument("--min-seconds", type=float, default=2.0, help="timed seconds per row, at least")
    p.add_argument("--max-seconds", type=float, default=120.0, help="stop timing a row past this many timed seconds")
    p.add_argument(
        "--settle", type=float, default=0.5,
        help="CPU: rest before each step, as long as the previous step took, at most this many seconds (none on CUDA)",
    )
    p.add_argument(
        "--max-memory", type=memory_argument, metavar="SIZE",
        help=f"what a configuration may use by its estimate (a lower bound), else it is skipped: {MEMORY_SYNTAX}; "
        "default: 80%% of RAM (CPU), 90%% of the GPU",
    )
    p.add_argument("--fit-points", type=int, default=3, help="largest sizes in the scaling-exponent fit")
    return p


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The arguments of the sweep, checked and resolved (``max_memory_bytes``, ``capacity_bytes``, ``tile``)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    device = check_shared_arguments(parser, args, "use --sizes, --num-classes, --attn, --attn-kwargs")
    for name in ("min_iters", "fit_points"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if min(args.batch_sizes) < 1:
        parser.error(f"--batch-size must be >= 1, got {' '.join(map(str, args.batch_sizes))}")
    args.batch_sizes = list(dict.fromkeys(args.batch_sizes))
    ops = [op for op, _ in args.backends]
    if len(set(ops)) < len(ops):
        parser.error(f"--backend: one path per op, got {' '.join(f'{op}={name}' for op, name in args.backends)}")
    args.backends = tuple(args.backends)
    finite = all(math.isfinite(s) for s in (args.min_seconds, args.settle, args.max_seconds))
    if not finite or args.warmup < 0 or args.min_seconds < 0 or args.settle < 0 or args.max_seconds <= 0:
        parser.error("--warmup, --min-seconds and --settle must be >= 0 and --max-seconds > 0")
    if args.compile and args.warmup < 1:
        parser.error("--compile needs --warmup >= 1: the first step compiles, and it must not be timed")
    if args.calibrate and args.ops:
        parser.error("--calibrate measures the model sweep; it cannot be combined with --ops")
    if args.grad_checkpointing and (args.ops or "train" not in args.modes):
        parser.error("--grad-checkpointing applies to the model sweep's train mode; add --modes train, without --ops")
    args.capacity_bytes = capacity_bytes(device)
    if args.train_sizes is not None and not set(args.train_sizes) <= set(args.sizes):
        parser.error(f"--train-sizes must be among --sizes {args.sizes}, got {args.train_sizes}")
    args.max_memory_bytes = args.capacity_bytes if args.max_memory is None else args.max_memory
    if not args.ops:
        args.tile = args.tile or default_tile(args.timm_model)
        if TILED in args.references:
            try:
                check_tiled_sizes(args.timm_model, args.model_kwargs, args.tile, args.tile_overlap, args.sizes)
            except ValueError as err:
                parser.error(f"--references {TILED}: {err}")
    return args


def mark_unfinished(results: list[Result]) -> None:
    """After a stopped sweep: every row still "ok" without its peak memory (its worker never finished) is
    marked "stopped", its steps timed so far kept in the CSV but not reported as a speed."""
    for r in results:
        if r.status == "ok" and r.peak_bytes is None:
            r.status = "stopped"
            r.message = f"the sweep was stopped after {len(r.times)} timed step(s) of this row"


def run(args: argparse.Namespace) -> tuple[list[Result], dict[str, Any]]:
    """Plan, measure, write the outputs; returns the results and the summary. A sweep stopped part-way
    (Ctrl-C, SIGTERM) writes what it measured, then stops as asked."""
    with forced_backends(args.backends):  # the memory estimates count the forced paths
        plan = plan_ops_sweep(args) if args.ops else plan_model_sweep(args)
    results = [r for group in plan for r in group]
    stopped = _measure(plan, results, args)
    summary = summarize(results, args.fit_points)
    verdicts = None if args.ops else check_targets(results)
    report = markdown_report(results, summary, args.fit_points, verdicts)
    stem = "ops" if args.ops else "bench"
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(csv_rows(results), args.out / f"{stem}.csv")
    (args.out / f"{stem}.md").write_text(report + "\n")
    plot(results, args.out / f"{stem}.png")
    summary["settings"] = json.loads(json.dumps(vars(args), default=str))
    if verdicts is not None:
        summary["targets"] = [_verdict_summary(v) for v in verdicts]
    if args.calibrate:
        summary["calibration"] = calibrate(results, args)
    (args.out / f"{stem}_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(report)
    if args.calibrate:
        _print_calibration(summary["calibration"])
    print(f"wrote {stem}.csv, {stem}.md, {stem}.png, {stem}_summary.json in {args.out}", file=sys.stderr)
    if stopped is not None:
        raise stopped
    return results, summary


def _measure(plan: list[list[Result]], results: list[Result], args: argparse.Namespace) -> BaseException | None:
    """Measure every group of ``plan`` (``results`` are its rows); returns the stop (Ctrl-C, SIGTERM) that
    ended it early, its unfinished rows marked, or None."""
    settle = settle_on(torch.device(args.device), args.settle)
    timing = Timing(args.warmup, args.min_iters, args.min_seconds, args.max_seconds, settle)
    try:
        with tqdm(total=len(results), unit="config", file=sys.stderr, dynamic_ncols=True) as progress:
            for group in plan:
                measure(group, timing, args.max_memory_bytes, args.capacity_bytes, progress)
    except (KeyboardInterrupt, SystemExit) as stop:  # the reports keep what was measured before the stop
        mark_unfinished(results)
        return stop
    return None


def _print_calibration(calibration: dict[str, Any]) -> None:
    print(f"calibration for attn='auto' written to {calibration['path']}:")
    for batch_size, entry in calibration["batches"].items():
        steps = ", ".join(f"{name} from {tokens} tokens" for tokens, name in entry["thresholds"])
        low, high = entry["tokens"]
        print(f"  batch {batch_size}: {steps} (measured from {low} to {high} tokens)")


def _verdict_summary(v: Verdict) -> dict[str, Any]:
    """A verdict as JSON: the target, the row, the median with its quartiles, and the verdict."""
    t = v.target
    entry: dict[str, Any] = {
        "target": v.target.describe(v.attn), "attn": v.attn, "mode": t.mode, "size": t.size,
        "batch_size": t.batch_size, "measure": t.measure, "op": t.op, "threshold": t.threshold, "value": v.value,
    }
    if v.value is None:
        return entry | {"verdict": f"not measured ({v.why})"}
    if v.spread is not None:
        entry |= {"q1": v.spread.q1, "q3": v.spread.q3, "rounds": v.spread.rounds}
    return entry | {"verdict": "met" if v.met else "missed", "decided_by_spread": v.decided_by_spread}
