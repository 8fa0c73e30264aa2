"""``visattn-bench max-tokens``: the largest token count each attention type runs forward and trains
(batch 1) within a memory limit.

For each row and mode the token count doubles from ``--min-tokens`` until a trial fails, then the
interval between the last count that fitted and the first that did not is bisected until it is
narrower than ``--tolerance`` of the count that fitted (:func:`search_largest`). A count of n tokens
runs on the most square grid of at most n tokens (:func:`square_grid`): ``isqrt(n)`` rows of
``n // isqrt(n)`` tokens, e.g. 1,024 -> 32 x 32, 2,048 -> 45 x 45 (2,025 tokens), 8,192 -> 90 x 91
(8,190); every count is reported as the tokens of the grid that ran. Model rows (default) run the model
(``--model``, images of grid x patch pixels, one class token on top) for every type beside ``timm`` and
``floor`` as in the model sweep; ``--ops`` runs one layer's token mixing alone beside
``softmax_explicit``, the seed's "standard" attention with its N x N scores. Forward: one forward
under ``inference_mode``. Training: forward, backward and, for a model, an AdamW step, twice, so that
the peak includes the optimizer's state.

Each trial runs in its own process, forked from a server that has imported the benchmark once, under
a memory cap, so that a trial over the limit fails alone and the search goes on:

* CPU (Linux): ``RLIMIT_DATA`` set to the process's data size at the start of the trial plus
  ``--max-memory``. It counts every private writable mapping (the heap, every tensor), so the kernel
  refuses the allocation that would cross the limit and the trial ends with "can't allocate memory",
  before the machine's memory is touched. ``RLIMIT_AS`` would also count the address space the
  libraries reserve and never use (3.4 GiB mapped by a process that has imported this module, 0.9 GiB
  of it data); measuring the peak RSS afterwards would let a trial take the memory first and could
  not protect a machine shared with others.
* CUDA: ``torch.cuda.set_per_process_memory_fraction`` of ``--max-memory``; the caching allocator
  raises ``OutOfMemoryError`` beyond it.

On both, the limit is what the trial allocates on top of its runtime (interpreter and libraries on
CPU, the CUDA context on a GPU), as :func:`visattn.bench.flops.estimate_memory` counts. A trial that
runs out of memory fails that count; one that passes ``--trial-timeout`` seconds ends the row's search
with the last count that fitted as a lower bound (the memory limit was not reached); an error of any
other kind ends the row with its message.
"""
from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import re
import resource
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import timm
import torch

from visattn.bench.flops import ViTShape
from visattn.bench.report import write_csv
from visattn.bench.runners import build_runner
from visattn.bench.sweep import (
    DEFAULT_MODEL, DTYPES, EXPLICIT_SOFTMAX, FLOOR, MODES, TIMM, Case, build_layer, build_model, timm_reference_name,
)
from visattn.bench.targets import SEED_CLAIM_OF_ROW, SEED_MAX_TOKENS
from visattn.bench.timing import classify_failure
from visattn.layers import list_attentions
from visattn.layers.options import options_per_type, parse_key_values

COMMAND = "max-tokens"
# The reference rows: timm's stock model and the model without token mixing; the fused op and its explicit twin.
MODEL_REFERENCES = (TIMM, FLOOR)
OP_REFERENCES = ("softmax", EXPLICIT_SOFTMAX)
SUMMARY = "the largest token count each type runs forward and trains within a memory limit"
DEFAULT_MAX_MEMORY = "16GiB"
MB = 2**20
_UNITS = {
    "": 2**30, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}


# ---------------------------------------------------------------------------------------------------
# The search


@dataclass(frozen=True)
class Search:
    """What :func:`search_largest` found."""

    largest: int | None  # the largest count that fitted; None if not even the first did
    smallest_failing: int | None  # the smallest count that did not fit; None if none failed
    trials: tuple[tuple[int, bool | None], ...]  # (count, verdict) in the order asked

    @property
    def undecided(self) -> bool:
        """The search stopped at a trial that could not tell (the time limit)."""
        return self.trials[-1][1] is None


def search_largest(
    fits: Callable[[int], bool | None], start: int, stop: int, tolerance: float = 0.0
) -> Search:
    """The largest n in [start, stop] with ``fits(n)``, for a ``fits`` that holds up to some n and not beyond.

    Doubles n from ``start`` (the last step capped at ``stop``) until ``fits`` is False, then bisects
    between the last n that fitted and the first that did not until they are at most
    ``max(1, floor(tolerance * last fitting n))`` apart: ``tolerance=0`` finds the exact n in at most
    ``floor(log2(n / start)) + 2`` doubling and ``ceil(log2(n))`` bisecting trials. A verdict of None
    (undecided) ends the search where it is.
    """
    if start < 1 or stop < start:
        raise ValueError(f"need 1 <= start <= stop, got start={start}, stop={stop}")
    if not 0 <= tolerance < 1:
        raise ValueError(f"tolerance must be in [0, 1), got {tolerance}")
    trials: list[tuple[int, bool | None]] = []

    def ask(n: int) -> bool | None:
        verdict = fits(n)
        trials.append((n, verdict))
        return verdict

    largest, failing, n = None, None, start
    while failing is None:
        verdict = ask(n)
        if verdict is None or (verdict and n == stop):
            return Search(n if verdict else largest, None, tuple(trials))
        if verdict:
            largest, n = n, min(2 * n, stop)
        else:
            failing = n
    while largest is not None and failing - largest > max(1, math.floor(tolerance * largest)):
        middle = (largest + failing) // 2
        verdict = ask(middle)
        if verdict is None:
            break
        if verdict:
            largest = middle
        else:
            failing = middle
    return Search(largest, failing, tuple(trials))


def square_grid(tokens: int) -> tuple[int, int]:
    """The most square grid (H, W) of at most ``tokens`` tokens: H = isqrt(tokens), W = tokens // H, so
    H <= W <= H + 2 and H x W > tokens - H."""
    if tokens < 1:
        raise ValueError(f"tokens must be >= 1, got {tokens}")
    h = math.isqrt(tokens)
    return h, tokens // h


def parse_bytes(text: str) -> int:
    """'16GiB' -> 16 * 2**30; units B, KiB, MiB, GiB, TiB (powers of 1024) or kB, MB, GB, TB (powers of
    1000), in any case; a bare number is GiB."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*", text)
    unit = match and _UNITS.get(match[2].lower())
    if not unit or float(match[1]) <= 0:
        raise ValueError(f"expected a positive size such as 16GiB, 512MiB or 4GB, got {text!r}")
    return int(float(match[1]) * unit)


# ---------------------------------------------------------------------------------------------------
# One trial, in its own process


@dataclass
class Trial:
    """One configuration run under the memory cap."""

    case: Case
    grid: tuple[int, int]
    status: str = "ok"  # ok | oom | time | error
    message: str = ""
    seconds: float = 0.0
    peak_bytes: int | None = None  # above the process's footprint when the trial started

    @property
    def tokens(self) -> int:
        return self.grid[0] * self.grid[1]


def _status_value(name: str) -> int:
    """A value in kB of ``/proc/self/status`` (Linux), in bytes."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(f"{name}:"):
                return int(line.split()[1]) * 1024
    raise OSError(f"/proc/self/status has no {name}")


def cap_memory(device: torch.device, limit: int) -> None:
    """Let this process allocate ``limit`` more bytes and no more (see the module docstring)."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, limit / total), device)
        return
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    soft = _status_value("VmData") + limit
    resource.setrlimit(resource.RLIMIT_DATA, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))


def _memory_now(device: torch.device, peak: bool) -> int:
    """CUDA: allocated now or at the peak. CPU: resident now (VmRSS) or at the peak (VmHWM)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) if peak else torch.cuda.memory_allocated(device)
    return _status_value("VmHWM" if peak else "VmRSS")


def _steps_of(case: Case) -> int:
    """A model's training step runs twice: the second one's peak holds AdamW's state as well."""
    return 2 if case.kind == "model" and case.mode == "train" else 1


def _trial_main(conn: Any, case: Case, limit: int) -> None:
    device = torch.device(case.device)
    try:
        if device.index is not None:
            torch.cuda.set_device(device)
        cap_memory(device, limit)
        start = _memory_now(device, peak=False)
        torch.manual_seed(0)
        runner = build_runner(case)
        for _ in range(_steps_of(case)):
            runner.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        conn.send(("ok", max(0, _memory_now(device, peak=True) - start)))
    except Exception as err:  # the trial fails, the search goes on
        conn.send(classify_failure(err))


def _process_context() -> Any:
    """Trials fork from a server that has imported this module (torch, timm) once, where the platform has
    one: a fresh process per trial without an interpreter start each."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    return ctx


def run_trial(case: Case, grid: tuple[int, int], limit: int, timeout: float) -> Trial:
    """Run ``case`` (on token grid ``grid``) in a new process allowed ``limit`` bytes and ``timeout`` seconds."""
    ctx = _process_context()
    trial = Trial(case, grid)
    receiver, sender = ctx.Pipe(duplex=False)
    process = ctx.Process(target=_trial_main, args=(sender, case, limit), daemon=True)
    started = time.perf_counter()
    process.start()
    sender.close()  # so that a dead trial reads as EOF here
    try:
        if receiver.poll(timeout):
            reply = receiver.recv()
            trial.status = reply[0]
            if reply[0] == "ok":
                trial.peak_bytes = reply[1]
            else:
                trial.message = reply[1]
        else:
            trial.status, trial.message = "time", f"no result within --trial-timeout {timeout:g} s"
    except EOFError:  # the process died without a word: SIGKILL is the system's out-of-memory killer
        process.join()
        code = process.exitcode
        trial.status = "oom" if code == -signal.SIGKILL else "error"
        trial.message = f"process ended by signal {-code}" if code is not None and code < 0 else f"process exited with code {code}"
    finally:
        trial.seconds = time.perf_counter() - started
        process.kill()
        process.join()
        receiver.close()
    return trial


# ---------------------------------------------------------------------------------------------------
# A row: one type in one mode


class _RowError(Exception):
    """A trial failed for another reason than memory or time: the row's search ends with its message."""


@dataclass
class Row:
    """The search of one attention type in one mode."""

    attn: str
    mode: str
    trials: dict[tuple[int, int], Trial] = field(default_factory=dict)  # by grid, in the order run
    search: Search | None = None
    error: str = ""

    def trial_of(self, tokens: int | None) -> Trial | None:
        return None if tokens is None else self.trials[square_grid(tokens)]

    @property
    def largest(self) -> Trial | None:
        return self.trial_of(self.search.largest) if self.search else None

    @property
    def failing(self) -> Trial | None:
        """The trial that bounds the answer from above: the smallest count that did not fit, else the one
        that ran past the time limit; None where every count fitted."""
        if self.search is None:
            return None
        if self.search.smallest_failing is None and self.search.undecided:
            return self.trial_of(self.search.trials[-1][0])
        return self.trial_of(self.search.smallest_failing)

    @property
    def stopped_by(self) -> str:
        """Why the search ended: oom, time, ceiling (--max-tokens fitted) or error."""
        if self.error:
            return "error"
        failing = self.failing
        return "ceiling" if failing is None else failing.status


class Sweep:
    """The cases of a ``max-tokens`` run, from its parsed arguments."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        references = args.references
        if args.ops:
            self.rows = references + [a for a in args.attn if a not in references and a != FLOOR]
            self.patch = (1, 1)
        else:
            self.rows = references + [a for a in args.attn if a not in references]
            with torch.device("meta"):
                model = timm.create_model(args.model, attn=FLOOR, num_classes=args.num_classes, **args.model_kwargs)
            self.patch = ViTShape.from_model(model).patch_size

    def case(self, attn: str, mode: str, grid: tuple[int, int]) -> Case:
        a = self.args
        common = dict(
            attn=attn, mode=mode, batch_size=1, device=a.device, dtype=a.dtype, compile=False,
            attn_kwargs=a.attn_kwargs.get(attn, {}),
        )
        if a.ops:
            return Case(kind="op", size=grid, num_heads=a.heads, head_dim=a.head_dim, **common)
        return Case(
            kind="model", size=(grid[0] * self.patch[0], grid[1] * self.patch[1]), model_name=a.model,
            timm_name=a.timm_model, num_classes=a.num_classes, model_kwargs=a.model_kwargs,
            grad_checkpointing=a.grad_checkpointing, **common,
        )

    def check(self, grid: tuple[int, int]) -> None:
        """Build every row on the meta device: a bad option fails here, before any trial."""
        for attn in self.rows:
            case = self.case(attn, "infer", grid)
            if case.kind == "model":
                build_model(case, device="meta")
            elif attn != EXPLICIT_SOFTMAX:
                build_layer(case, device="meta")

    def search(self, attn: str, mode: str, report: Callable[[Row, Trial], None]) -> Row:
        a = self.args
        row = Row(attn, mode)

        def fits(tokens: int) -> bool | None:
            grid = square_grid(tokens)
            if grid not in row.trials:
                row.trials[grid] = trial = run_trial(self.case(attn, mode, grid), grid, a.max_memory, a.trial_timeout)
                report(row, trial)
                if trial.status == "error":
                    raise _RowError(trial.message)
            return {"ok": True, "oom": False}.get(row.trials[grid].status)

        try:
            row.search = search_largest(fits, a.min_tokens, a.max_tokens, a.tolerance)
        except _RowError as err:
            row.error = str(err)
        return row


# ---------------------------------------------------------------------------------------------------
# Reports


def _grid_label(grid: tuple[int, int], patch: tuple[int, int], ops: bool) -> str:
    label = f"{grid[0]}×{grid[1]}"
    return label if ops else f"{label} ({grid[0] * patch[0]}×{grid[1] * patch[1]} px)"


def _seed_claim(attn: str) -> str:
    kind = SEED_CLAIM_OF_ROW.get("softmax" if attn == TIMM else attn)
    return "" if kind is None else f"{kind}: ~{SEED_MAX_TOKENS[kind]:,}"


def _stop_text(row: Row, patch: tuple[int, int], ops: bool) -> str:
    failing = row.failing
    if row.error:
        return f"error: {row.error}"
    if failing is None:
        return "fits at --max-tokens"
    where = f"{failing.tokens:,} tokens, {_grid_label(failing.grid, patch, ops)}"
    return {"oom": f"out of memory at {where}", "time": f"time limit at {where}"}.get(failing.status, where)


def _largest_text(row: Row) -> str:
    """The largest count that fitted; "≥" where no limit was reached above it (time, --max-tokens)."""
    largest = row.largest
    if row.search is None or (largest is None and row.stopped_by == "time"):
        return "?"
    if largest is None:
        return f"< {row.search.trials[0][0]:,}"
    bound = "≥ " if row.stopped_by in ("time", "ceiling") else ""
    return f"{bound}{largest.tokens:,}"


def csv_rows(rows: list[Row], sweep: Sweep) -> list[dict[str, Any]]:
    """One row per type and mode: the largest fitting grid, the first failing one and why."""
    out = []
    for row in rows:
        largest, failing = row.largest, row.failing
        record: dict[str, Any] = {"attn": row.attn, "mode": row.mode, "max_tokens": largest.tokens if largest else None}
        record["grid"] = f"{largest.grid[0]}x{largest.grid[1]}" if largest else None
        if not sweep.args.ops:
            record["img_size"] = f"{largest.case.size[0]}x{largest.case.size[1]}" if largest else None
        record |= {
            "peak_mem_mb": round(largest.peak_bytes / MB, 1) if largest and largest.peak_bytes is not None else None,
            "failed_tokens": failing.tokens if failing else None,
            "stopped_by": row.stopped_by,
            "message": row.error or (failing.message if failing else ""),
            "trials": len(row.trials),
            "seconds": round(sum(t.seconds for t in row.trials.values()), 1),
            "seed_claim": _seed_claim(row.attn),
        }
        out.append(record)
    return out


def trial_rows(rows: list[Row]) -> list[dict[str, Any]]:
    """Every trial, in the order run."""
    return [
        {
            "attn": row.attn, "mode": row.mode, "tokens": t.tokens, "grid": f"{t.grid[0]}x{t.grid[1]}", "status": t.status,
            "seconds": round(t.seconds, 2), "peak_mem_mb": None if t.peak_bytes is None else round(t.peak_bytes / MB, 1),
            "message": t.message,
        }
        for row in rows
        for t in row.trials.values()
    ]


def markdown_report(rows: list[Row], sweep: Sweep) -> str:
    a = sweep.args
    options = ", ".join(f"{key}={value}" for key, value in a.model_kwargs.items())
    what = f"token mixing alone, {a.heads} heads x {a.head_dim}" if a.ops else f"{a.model}" + (f" ({options})" if options else "")
    lines = [
        f"# max tokens within {a.max_memory / 2**30:.4g} GiB: {what}, batch 1, {a.device} {a.dtype}"
        + (", gradient checkpointing" if a.grad_checkpointing else ""),
        "",
        f"Doubling from {a.min_tokens:,} tokens up to {a.max_tokens:,}, then bisecting to within {100 * a.tolerance:.3g}%; "
        f"a trial may take {a.trial_timeout:g} s; ≥: the memory limit was not reached.",
        "",
    ]
    by_key = {(r.attn, r.mode): r for r in rows}
    header = ["attn"]
    for mode in a.modes:
        name = "forward" if mode == "infer" else "training"
        header += [f"{name}: max tokens", f"{name}: grid", f"{name}: peak MB", f"{name}: stopped by"]
    header.append("seed claim")
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for attn in sweep.rows:
        cells = [f"`{attn}`"]
        for mode in a.modes:
            row = by_key[attn, mode]
            largest = row.largest
            peak = "" if largest is None or largest.peak_bytes is None else f"{largest.peak_bytes / MB:,.0f}"
            grid = "" if largest is None else _grid_label(largest.grid, sweep.patch, a.ops)
            cells += [_largest_text(row), grid, peak, _stop_text(row, sweep.patch, a.ops)]
        cells.append(_seed_claim(attn))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------
# Command line


def _key_values(text: str) -> dict[str, Any]:
    try:
        return parse_key_values(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _bytes(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=f"visattn-bench {COMMAND}",
        description=f"{SUMMARY[0].upper()}{SUMMARY[1:]} (batch 1), one process per trial.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--ops", action="store_true", help="the token mixing alone (beside softmax_explicit) instead of the model")
    p.add_argument("--max-memory", type=_bytes, default=DEFAULT_MAX_MEMORY, metavar="SIZE",
                   help="what a trial may allocate on top of its runtime: 16GiB, 512MiB, 4GB (a bare number is GiB)")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="infer: forward; train: forward and backward")
    p.add_argument("--attn", nargs="+", default=list_attentions(), help="attention types (and the --references rows)")
    p.add_argument(
        "--references", nargs="*", choices=[*MODEL_REFERENCES, *OP_REFERENCES],
        help=f"rows before --attn; default: {' and '.join(MODEL_REFERENCES)} (model), {' and '.join(OP_REFERENCES)} (--ops)",
    )
    p.add_argument("--attn-kwargs", type=_key_values, nargs="*", default=[], metavar="KEY=VALUE", help="type options, as in visattn-bench")
    p.add_argument("--model", default=DEFAULT_MODEL, help="visattn model (timm name)")
    p.add_argument("--timm-model", help="timm's stock reference model; default: --model without 'visattn_', with '_224'")
    p.add_argument("--model-kwargs", type=_key_values, nargs="*", default=[], metavar="KEY=VALUE", help="passed to both models, e.g. depth=4")
    p.add_argument("--num-classes", type=int, default=1000, help="classifier width of both models")
    p.add_argument("--grad-checkpointing", action="store_true", help="train mode: recompute each block in the backward")
    p.add_argument("--heads", type=int, default=6, help="heads of --ops")
    p.add_argument("--head-dim", type=int, default=64, help="head width of --ops")
    p.add_argument("--min-tokens", type=int, default=256, help="first count of the doubling")
    p.add_argument("--max-tokens", type=int, default=2**20, help="the search's ceiling")
    p.add_argument("--tolerance", type=float, default=1 / 16, help="bisect until the interval is narrower than this fraction of the count that fits")
    p.add_argument("--trial-timeout", type=float, default=300.0, help="seconds a trial may take; past it the row's search ends")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", choices=list(DTYPES), default="fp32", help="bf16: autocast mixed precision")
    p.add_argument("--out", type=Path, default=Path("bench_out"), help="output directory")
    return p


def _available_memory() -> int:
    """MemAvailable of ``/proc/meminfo``: what the machine can give without swapping or taking others' memory."""
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError("/proc/meminfo has no MemAvailable")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    unknown = [a for a in args.attn if a not in list_attentions()]
    if unknown:
        parser.error(f"unknown attention(s) {', '.join(unknown)}; valid: {', '.join(list_attentions())}")
    args.attn = list(dict.fromkeys(args.attn))
    allowed = list(OP_REFERENCES if args.ops else MODEL_REFERENCES)
    args.references = allowed if args.references is None else list(dict.fromkeys(args.references))
    if not set(args.references) <= set(allowed):
        parser.error(f"--references: {'--ops' if args.ops else 'the model'} takes {' and '.join(allowed)}, got {' '.join(args.references)}")
    given = {key: value for words in args.attn_kwargs for key, value in words.items()}
    try:
        args.attn_kwargs, unused = options_per_type(args.attn, given)
    except ValueError as err:
        parser.error(f"--attn-kwargs: {err}")
    if unused:
        parser.error(f"--attn-kwargs: {', '.join(unused)} applies to none of --attn ({', '.join(args.attn)})")
    args.model_kwargs = {key: value for words in args.model_kwargs for key, value in words.items()}
    taken = {"img_size", "num_classes", "attn", "attn_kwargs"} & set(args.model_kwargs)
    if taken:
        parser.error(f"--model-kwargs cannot set {', '.join(sorted(taken))}; the search sets the image size")
    for name in ("num_classes", "heads", "head_dim", "min_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.max_tokens < args.min_tokens:
        parser.error(f"--max-tokens must be >= --min-tokens ({args.min_tokens}), got {args.max_tokens}")
    if not 0 <= args.tolerance < 1:
        parser.error(f"--tolerance must be in [0, 1), got {args.tolerance}")
    if not args.trial_timeout > 0:
        parser.error(f"--trial-timeout must be > 0, got {args.trial_timeout}")
    if args.grad_checkpointing and (args.ops or "train" not in args.modes):
        parser.error("--grad-checkpointing applies to the model's train mode; add --modes train, without --ops")
    device = torch.device(args.device)
    if device.type not in ("cpu", "cuda") or (device.type == "cuda" and not torch.cuda.is_available()):
        parser.error(f"--device must be cpu or an available cuda device, got {args.device!r}")
    if device.type == "cpu":
        if not sys.platform.startswith("linux"):
            parser.error("on CPU the memory cap needs Linux (RLIMIT_DATA and /proc); use a cuda device")
        available = _available_memory()
        if args.max_memory > available:
            parser.error(
                f"--max-memory {args.max_memory / 2**30:.3g} GiB is more than the {available / 2**30:.3g} GiB this machine "
                "has available: a trial could take memory other processes need; lower it"
            )
    if not args.ops:
        try:
            args.timm_model = args.timm_model or timm_reference_name(args.model)
        except ValueError as err:
            parser.error(str(err))
    try:
        args.sweep = Sweep(args)
        if not args.sweep.rows:
            parser.error("no rows: --attn leaves only floor, which --ops does not run, and --references is empty")
        args.sweep.check(square_grid(args.min_tokens))
    except (ValueError, TypeError, RuntimeError) as err:  # timm: RuntimeError for an unknown model name
        parser.error(f"cannot build the rows at {args.min_tokens} tokens: {err}")
    return args


def _progress(row: Row, trial: Trial) -> None:
    peak = "" if trial.peak_bytes is None else f", peak {trial.peak_bytes / MB:,.0f} MB"
    why = f": {trial.message}" if trial.status != "ok" else ""
    print(f"{row.attn} {row.mode} {trial.tokens:,} tokens ({trial.grid[0]}x{trial.grid[1]}): "
          f"{trial.status} in {trial.seconds:.1f} s{peak}{why}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> list[Row]:
    """Search every row in every mode, write ``maxlen.md``, ``maxlen.csv`` and ``maxlen_trials.csv``."""
    sweep = args.sweep
    rows = [sweep.search(attn, mode, _progress) for attn in sweep.rows for mode in args.modes]
    report = markdown_report(rows, sweep)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "maxlen.md").write_text(report)
    write_csv(csv_rows(rows, sweep), args.out / "maxlen.csv")
    write_csv(trial_rows(rows), args.out / "maxlen_trials.csv")
    print(report, end="")
    print(f"wrote maxlen.md, maxlen.csv, maxlen_trials.csv in {args.out}", file=sys.stderr)
    return rows


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    sys.exit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # A terminated run unwinds like an interrupted one, so that run_trial ends the trial it waits for.
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        run(args)
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0
