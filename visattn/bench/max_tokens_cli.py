"""``visattn-bench max-tokens``: parse the arguments, search the largest token count of every row within the
memory limit (:mod:`visattn.bench.max_tokens`), one capped process per trial, and write the reports anew
after every trial (:mod:`visattn.bench.max_tokens_report`)."""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from visattn.bench.arguments import (
    MAX_TOKENS, MAX_TOKENS_SUMMARY, MEMORY_SYNTAX, add_shared_arguments, check_shared_arguments, memory_argument,
    parse_memory,
)
from visattn.bench.max_tokens import MODEL_REFERENCES, OP_REFERENCES, MaxTokensPlan, Row, square_grid
from visattn.bench.max_tokens_report import write_max_tokens_files
from visattn.bench.memory import MB, available_bytes
from visattn.bench.sweep import MODES
from visattn.bench.trial import Trial

DEFAULT_MAX_TOKENS_MEMORY = "16GiB"


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``visattn-bench max-tokens``."""
    p = argparse.ArgumentParser(
        prog=f"visattn-bench {MAX_TOKENS}",
        description=f"{MAX_TOKENS_SUMMARY[0].upper()}{MAX_TOKENS_SUMMARY[1:]} (batch 1), one process per trial.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--ops", action="store_true", help="the token mixing alone (beside softmax_explicit) instead of the model")
    p.add_argument(
        "--max-memory", type=memory_argument, default=parse_memory(DEFAULT_MAX_TOKENS_MEMORY), metavar="SIZE",
        help=f"what a trial may allocate on top of its runtime: {MEMORY_SYNTAX} (default {DEFAULT_MAX_TOKENS_MEMORY})",
    )
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="infer: forward; train: forward and backward")
    p.add_argument(
        "--references", nargs="*", choices=[*MODEL_REFERENCES, *OP_REFERENCES],
        help=f"rows before --attn; default: {' and '.join(MODEL_REFERENCES)} (model), {' and '.join(OP_REFERENCES)} (--ops)",
    )
    add_shared_arguments(p)
    p.add_argument("--min-tokens", type=int, default=256, help="first count of the doubling")
    p.add_argument("--max-tokens", type=int, default=2**20, help="the search's ceiling")
    p.add_argument("--tolerance", type=float, default=1 / 16, help="bisect until the interval is narrower than this fraction of the count that fits")
    p.add_argument("--trial-timeout", type=float, default=300.0, help="seconds a trial may take; past it the row's search ends")
    return p


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The arguments of ``visattn-bench max-tokens``, checked, with the run's rows (``args.plan``)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    allowed = list(OP_REFERENCES if args.ops else MODEL_REFERENCES)
    args.references = allowed if args.references is None else list(dict.fromkeys(args.references))
    if not set(args.references) <= set(allowed):
        parser.error(f"--references: {'--ops' if args.ops else 'the model'} takes {' and '.join(allowed)}, got {' '.join(args.references)}")
    device = check_shared_arguments(parser, args, "the search sets the image size")
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
        _check_cpu_memory(parser, args.max_memory)
    try:
        args.plan = MaxTokensPlan(args)
        if not args.plan.rows:
            parser.error("no rows: --attn leaves only floor, which --ops does not run, and --references is empty")
        args.plan.check(square_grid(args.min_tokens))
    except (ValueError, TypeError, RuntimeError) as err:  # timm: RuntimeError for an unknown model name
        parser.error(f"cannot build the rows at {args.min_tokens} tokens: {err}")
    return args


def _check_cpu_memory(parser: argparse.ArgumentParser, max_memory: int) -> None:
    """On CPU the cap is Linux's, and a trial may not take more than the machine has available."""
    if not sys.platform.startswith("linux"):
        parser.error("on CPU the memory cap needs Linux (RLIMIT_DATA and /proc); use a cuda device")
    available = available_bytes()
    if max_memory > available:
        parser.error(
            f"--max-memory {max_memory / 2**30:.3g} GiB is more than the {available / 2**30:.3g} GiB this machine "
            "has available: a trial could take memory other processes need; lower it"
        )


def _trial_progress(row: Row, trial: Trial) -> None:
    peak = "" if trial.peak_bytes is None else f", peak {trial.peak_bytes / MB:,.0f} MB"
    why = f": {trial.message}" if trial.status != "ok" else ""
    print(f"{row.attn} {row.mode} {trial.tokens:,} tokens ({trial.grid[0]}x{trial.grid[1]}): "
          f"{trial.status} in {trial.seconds:.1f} s{peak}{why}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> list[Row]:
    """Search every row in every mode, writing ``max_tokens.md``, ``max_tokens.csv`` and ``max_tokens_trials.csv`` anew after
    every trial, so that a command stopped at a time limit keeps what it measured and says where it stopped."""
    plan = args.plan
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[Row] = []

    def write(row: Row | None = None, trial: Trial | None = None) -> str:
        if trial is not None:
            _trial_progress(row, trial)
        return write_max_tokens_files(rows, plan, args.out)

    for attn in plan.rows:
        for mode in args.modes:
            rows.append(row := Row(attn, mode))
            try:
                plan.search(row, write)
            except (KeyboardInterrupt, SystemExit):
                row.stopped = True
                write()
                raise
    report = write()
    print(report, end="")
    print(f"wrote max_tokens.md, max_tokens.csv, max_tokens_trials.csv in {args.out}", file=sys.stderr)
    return rows
