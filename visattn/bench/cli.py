"""The ``visattn-bench`` command line: parse the arguments, plan the sweep, measure it, write the reports;
``visattn-bench max-tokens``: search the largest token count per type within a memory limit.

Memory sizes (``--max-memory`` of both) are read by :func:`parse_memory`: ``8GiB``, ``512MiB``, ``4GB``; a
bare number is GiB in both.

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
import contextlib
import json
import math
import re
import signal
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from visattn.bench.calibrate import calibrate
from visattn.bench.memory import available_bytes, capacity_bytes
from visattn.bench.report import (
    csv_rows, markdown_report, max_tokens_csv_rows, max_tokens_report, max_tokens_trial_rows, plot, summarize, write_csv,
)
from visattn.bench.search import MODEL_REFERENCES, OP_REFERENCES, MaxTokensSweep, Row, square_grid
from visattn.bench.sweep import (
    DEFAULT_MODEL,
    DTYPES,
    FLOOR,
    MODES,
    TILED,
    TIMM,
    Result,
    check_tiled_sizes,
    default_tile,
    plan_model_sweep,
    plan_ops_sweep,
    timm_reference_name,
)
from visattn.bench.targets import Verdict, check_targets
from visattn.bench.timing import Timing, measure, settle_on
from visattn.bench.trial import Trial
from visattn.layers import list_attentions
from visattn.layers.options import options_per_type, parse_key_values

DEFAULT_SIZES = ("224", "512", "1024", "2048")
DEFAULT_GRIDS = ("16x32", "32x64", "64x128", "128x256")
MAX_TOKENS = "max-tokens"
MAX_TOKENS_SUMMARY = "the largest token count each type runs forward and trains within a memory limit"
DEFAULT_MAX_TOKENS_MEMORY = "16GiB"
MB = 2**20
_MEMORY_UNITS = {
    "": 2**30, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
MEMORY_SYNTAX = "16GiB, 512MiB, 4GB (10^9 bytes); a bare number is GiB"


def parse_memory(text: str) -> int:
    """'16GiB' -> 16 * 2**30 bytes; units B, KiB, MiB, GiB, TiB (powers of 1024) or kB, MB, GB, TB (powers
    of 1000), in any case; a bare number is GiB. The one syntax of every ``--max-memory``."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*", text)
    unit = match and _MEMORY_UNITS.get(match[2].lower())
    if not unit or float(match[1]) <= 0:
        raise ValueError(f"expected a positive size such as 16GiB, 512MiB or 4GB (a bare number is GiB), got {text!r}")
    return int(float(match[1]) * unit)


def _memory(text: str) -> int:
    try:
        return parse_memory(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


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


def _key_values(text: str) -> dict[str, Any]:
    """``depth=6`` (or ``depth=6,mlp_ratio=2``) -> {"depth": 6, ...}, values read as YAML 1.2."""
    try:
        return parse_key_values(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _add_shared_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of both commands: the rows, the model and the op, the device, the output folder."""
    p.add_argument("--model", default=DEFAULT_MODEL, help="visattn model (timm name)")
    p.add_argument("--timm-model", help="timm's stock reference model; default: --model without 'visattn_', with '_224'")
    p.add_argument("--attn", nargs="+", default=list_attentions(), help="attention types (beside the reference rows, see --references)")
    p.add_argument(
        "--attn-kwargs", type=_key_values, nargs="*", default=[], metavar="KEY=VALUE",
        help="type options, as in train.py: k=64 for every type that takes it, linformer={k: 64} for one type",
    )
    p.add_argument("--model-kwargs", type=_key_values, nargs="*", default=[], metavar="KEY=VALUE", help="passed to both models, e.g. depth=6")
    p.add_argument("--num-classes", type=int, default=1000, help="classifier width of both models")
    p.add_argument("--heads", type=int, default=6, help="heads of --ops")
    p.add_argument("--head-dim", type=int, default=64, help="head width of --ops")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu, cuda or cuda:N")
    p.add_argument(
        "--dtype", choices=list(DTYPES), default="fp32",
        help="bf16, fp16: the models under autocast, the op's q, k, v created in the dtype",
    )
    p.add_argument("--grad-checkpointing", action="store_true", help="train mode: recompute each block in the backward (timm's set_grad_checkpointing)")
    p.add_argument("--out", type=Path, default=Path("bench_out"), help="output directory")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="visattn-bench",
        description="Throughput and peak memory of the visattn attention types vs timm's fused softmax attention.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog=f"visattn-bench {MAX_TOKENS} [--help]: {MAX_TOKENS_SUMMARY}.",
    )
    p.add_argument("--ops", action="store_true", help="time the attention ops alone (no model) on --grids")
    p.add_argument("--calibrate", action="store_true", help="also write the calibration of attn='auto' for --model")
    _add_shared_arguments(p)
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
        "--max-memory", type=_memory, metavar="SIZE",
        help=f"what a configuration may use by its estimate (a lower bound), else it is skipped: {MEMORY_SYNTAX}; "
        "default: 80%% of RAM (CPU), 90%% of the GPU",
    )
    p.add_argument("--fit-points", type=int, default=3, help="largest sizes in the scaling-exponent fit")
    return p


def build_max_tokens_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=f"visattn-bench {MAX_TOKENS}",
        description=f"{MAX_TOKENS_SUMMARY[0].upper()}{MAX_TOKENS_SUMMARY[1:]} (batch 1), one process per trial.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--ops", action="store_true", help="the token mixing alone (beside softmax_explicit) instead of the model")
    p.add_argument(
        "--max-memory", type=_memory, default=parse_memory(DEFAULT_MAX_TOKENS_MEMORY), metavar="SIZE",
        help=f"what a trial may allocate on top of its runtime: {MEMORY_SYNTAX} (default {DEFAULT_MAX_TOKENS_MEMORY})",
    )
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="infer: forward; train: forward and backward")
    p.add_argument(
        "--references", nargs="*", choices=[*MODEL_REFERENCES, *OP_REFERENCES],
        help=f"rows before --attn; default: {' and '.join(MODEL_REFERENCES)} (model), {' and '.join(OP_REFERENCES)} (--ops)",
    )
    _add_shared_arguments(p)
    p.add_argument("--min-tokens", type=int, default=256, help="first count of the doubling")
    p.add_argument("--max-tokens", type=int, default=2**20, help="the search's ceiling")
    p.add_argument("--tolerance", type=float, default=1 / 16, help="bisect until the interval is narrower than this fraction of the count that fits")
    p.add_argument("--trial-timeout", type=float, default=300.0, help="seconds a trial may take; past it the row's search ends")
    return p


def _check_shared_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace, sizes_from: str) -> torch.device:
    """Check and resolve the arguments of :func:`_add_shared_arguments`; returns the device. ``sizes_from``
    names what sets the image size, for the error on ``--model-kwargs img_size=...``."""
    unknown = [a for a in args.attn if a not in list_attentions()]
    if unknown:
        parser.error(f"unknown attention(s) {', '.join(unknown)}; valid: {', '.join(list_attentions())}")
    args.attn = list(dict.fromkeys(args.attn))
    given = {key: value for words in args.attn_kwargs for key, value in words.items()}
    try:
        args.attn_kwargs, unused = options_per_type(args.attn, given)
    except ValueError as err:
        parser.error(f"--attn-kwargs: {err}")
    # Unlike a training recipe, the command line holds only what the user typed for this run.
    unused += [name for name in given if name in list_attentions() and name not in args.attn]
    if unused:
        parser.error(f"--attn-kwargs: {', '.join(unused)} applies to none of --attn ({', '.join(args.attn)})")
    args.model_kwargs = {key: value for words in args.model_kwargs for key, value in words.items()}
    taken = {"img_size", "num_classes", "attn", "attn_kwargs"} & set(args.model_kwargs)
    if taken:
        parser.error(f"--model-kwargs cannot set {', '.join(sorted(taken))}; {sizes_from}")
    for name in ("num_classes", "heads", "head_dim"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    device = torch.device(args.device)
    if device.type not in ("cpu", "cuda") or (device.type == "cuda" and not torch.cuda.is_available()):
        parser.error(f"--device must be cpu or an available cuda device, got {args.device!r}")
    if not args.ops:
        try:
            args.timm_model = args.timm_model or timm_reference_name(args.model)
        except ValueError as err:
            parser.error(str(err))
    return device


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    device = _check_shared_arguments(parser, args, "use --sizes, --num-classes, --attn, --attn-kwargs")
    for name in ("min_iters", "fit_points"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if min(args.batch_sizes) < 1:
        parser.error(f"--batch-size must be >= 1, got {' '.join(map(str, args.batch_sizes))}")
    args.batch_sizes = list(dict.fromkeys(args.batch_sizes))
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
    """Plan, measure, write the outputs; returns the results and the summary."""
    plan = plan_ops_sweep(args) if args.ops else plan_model_sweep(args)
    settle = settle_on(torch.device(args.device), args.settle)
    timing = Timing(args.warmup, args.min_iters, args.min_seconds, args.max_seconds, settle)
    results = [r for group in plan for r in group]
    stopped: BaseException | None = None
    try:
        with tqdm(total=len(results), unit="config", file=sys.stderr, dynamic_ncols=True) as progress:
            for group in plan:
                measure(group, timing, args.max_memory_bytes, args.capacity_bytes, progress)
    except (KeyboardInterrupt, SystemExit) as stop:  # the reports keep what was measured before the stop
        stopped = stop
        mark_unfinished(results)
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
        calibration = summary["calibration"]
        print(f"calibration for attn='auto' written to {calibration['path']}:")
        for batch_size, entry in calibration["batches"].items():
            steps = ", ".join(f"{name} from {tokens} tokens" for tokens, name in entry["thresholds"])
            low, high = entry["tokens"]
            print(f"  batch {batch_size}: {steps} (measured from {low} to {high} tokens)")
    print(f"wrote {stem}.csv, {stem}.md, {stem}.png, {stem}_summary.json in {args.out}", file=sys.stderr)
    if stopped is not None:
        raise stopped
    return results, summary


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


def parse_max_tokens_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The arguments of ``visattn-bench max-tokens``, checked, with the run's rows (``args.sweep``)."""
    parser = build_max_tokens_parser()
    args = parser.parse_args(argv)
    allowed = list(OP_REFERENCES if args.ops else MODEL_REFERENCES)
    args.references = allowed if args.references is None else list(dict.fromkeys(args.references))
    if not set(args.references) <= set(allowed):
        parser.error(f"--references: {'--ops' if args.ops else 'the model'} takes {' and '.join(allowed)}, got {' '.join(args.references)}")
    device = _check_shared_arguments(parser, args, "the search sets the image size")
    if args.min_tokens < 1:
        parser.error("--min-tokens must be >= 1")
    if args.max_tokens < args.min_tokens:
        parser.error(f"--max-tokens must be >= --min-tokens ({args.min_tokens}), got {args.max_tokens}")
    if not 0 <= args.tolerance < 1:
        parser.error(f"--tolerance must be in [0, 1), got {args.tolerance}")
    if not args.trial_timeout > 0:
        parser.error(f"--trial-timeout must be > 0, got {args.trial_timeout}")
    if args.grad_checkpointing and (args.ops or "train" not in args.modes):
        parser.error("--grad-checkpointing applies to the model's train mode; add --modes train, without --ops")
    if device.type == "cpu":
        if not sys.platform.startswith("linux"):
            parser.error("on CPU the memory cap needs Linux (RLIMIT_DATA and /proc); use a cuda device")
        available = available_bytes()
        if args.max_memory > available:
            parser.error(
                f"--max-memory {args.max_memory / 2**30:.3g} GiB is more than the {available / 2**30:.3g} GiB this machine "
                "has available: a trial could take memory other processes need; lower it"
            )
    try:
        args.sweep = MaxTokensSweep(args)
        if not args.sweep.rows:
            parser.error("no rows: --attn leaves only floor, which --ops does not run, and --references is empty")
        args.sweep.check(square_grid(args.min_tokens))
    except (ValueError, TypeError, RuntimeError) as err:  # timm: RuntimeError for an unknown model name
        parser.error(f"cannot build the rows at {args.min_tokens} tokens: {err}")
    return args


def _trial_progress(row: Row, trial: Trial) -> None:
    peak = "" if trial.peak_bytes is None else f", peak {trial.peak_bytes / MB:,.0f} MB"
    why = f": {trial.message}" if trial.status != "ok" else ""
    print(f"{row.attn} {row.mode} {trial.tokens:,} tokens ({trial.grid[0]}x{trial.grid[1]}): "
          f"{trial.status} in {trial.seconds:.1f} s{peak}{why}", file=sys.stderr, flush=True)


def run_max_tokens(args: argparse.Namespace) -> list[Row]:
    """Search every row in every mode, writing ``max_tokens.md``, ``max_tokens.csv`` and ``max_tokens_trials.csv`` anew after
    every trial, so that a command stopped at a time limit keeps what it measured and says where it stopped."""
    sweep = args.sweep
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[Row] = []

    def write(row: Row | None = None, trial: Trial | None = None) -> str:
        if trial is not None:
            _trial_progress(row, trial)
        report = max_tokens_report(rows, sweep)
        (args.out / "max_tokens.md").write_text(report)
        write_csv(max_tokens_csv_rows(rows, sweep), args.out / "max_tokens.csv")
        write_csv(max_tokens_trial_rows(rows), args.out / "max_tokens_trials.csv")
        return report

    for attn in sweep.rows:
        for mode in args.modes:
            rows.append(row := Row(attn, mode))
            try:
                sweep.search(row, write)
            except (KeyboardInterrupt, SystemExit):
                row.stopped = True
                write()
                raise
    report = write()
    print(report, end="")
    print(f"wrote max_tokens.md, max_tokens.csv, max_tokens_trials.csv in {args.out}", file=sys.stderr)
    return rows


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    sys.exit(128 + signum)


@contextlib.contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """SIGTERM (what ``timeout`` and job schedulers send) unwinds like Ctrl-C inside the block: workers and
    trials are ended and what was measured is written."""
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == [MAX_TOKENS]:
        args = parse_max_tokens_args(argv[1:])
        with _sigterm_unwinds():
            run_max_tokens(args)
        return 0
    args = _parse(argv)
    with _sigterm_unwinds():
        run(args)
    return 0
