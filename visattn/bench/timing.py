"""How a sweep is timed: one worker process per case, driven in interleaved rounds.

* Every configuration (attention type x size x mode) runs in its own worker process, which builds its
  :mod:`runner <visattn.bench.runners>` once and reports its own peak memory at the end
  (:mod:`visattn.bench.memory`).
* The workers of one size (every row, in every mode) are started together and ended before the next
  size; the parent drives interleaved rounds (A B C A B C ...): each worker in turn runs one step,
  timed inside the worker, and reports back. Drift of a shared machine thus hits every row alike. Each
  request times one step with ``time.perf_counter`` (after a CUDA synchronize) rather than with
  ``torch.utils.benchmark.Timer``, whose runs of many steps would undo the interleaving.
* Idle OpenMP threads sleep rather than spin (``OMP_WAIT_POLICY=PASSIVE`` unless set), so that a
  waiting worker takes no CPU from the one being timed and no type is penalised for its many small ops.
* Before each step the parent rests as long as the previous step took, at most ``--settle`` seconds,
  so that the previous worker's step has faded from the machine: a step of many small ops that
  directly follows a long step of another worker runs slower, which would make a row's time depend on
  the row order. The rest costs little where steps are short.
* After ``--warmup`` untimed rounds, a row is timed until it has ``--min-iters`` steps and
  ``--min-seconds`` of timed steps, or once its timed steps exceed ``--max-seconds``; floor steps in
  every round while any row of its group does. Rows report the
  median step; each timed step keeps the serial of its round, from which :mod:`visattn.bench.ratios`
  forms the ratios between rows round by round. An out-of-memory error, or a worker killed by the
  system, is reported in its row.
* Where the workers of one point do not fit the machine together, they run in consecutive groups
  (:func:`~visattn.bench.memory.groups_that_fit`), floor in each of them: its steps gather over the
  groups, and its peak memory is that of its last worker.
"""
from __future__ import annotations

import contextlib
import itertools
import multiprocessing as mp
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from visattn.bench.memory import groups_that_fit, memory_bytes, skip_over_budget
from visattn.bench.runners import build_runner
from visattn.bench.sweep import FLOOR, Case, Result

# Serials of the timed rounds, unique in this process: steps of one round, and only they, share one.
_ROUND_SERIALS = itertools.count()


@dataclass(frozen=True)
class Timing:
    """When a row has been timed enough (see the module docstring)."""

    warmup: int
    min_iters: int
    min_seconds: float
    max_seconds: float
    settle: float = 0.0  # seconds of rest before each step

    def needs_more(self, times: list[float]) -> bool:
        total = sum(times)
        if times and total >= self.max_seconds:
            return False
        return len(times) < self.min_iters or total < self.min_seconds


# ---------------------------------------------------------------------------------------------------
# The worker


def classify_failure(err: BaseException) -> tuple[str, str]:
    """("oom" or "error", the error's first line) for an exception a worker caught."""
    text = f"{type(err).__name__}: {err}".splitlines()[0][:300]
    out_of_memory = isinstance(err, (torch.OutOfMemoryError, MemoryError)) or any(
        s in str(err).lower() for s in ("out of memory", "can't allocate memory", "cannot allocate memory")
    )
    return ("oom" if out_of_memory else "error"), text


def _worker_main(conn: Any, case: Case) -> None:
    """Build the case, then serve "step" (one timed step) and "finish" (peak memory) requests."""
    device = torch.device(case.device)
    try:
        torch.manual_seed(0)
        if device.index is not None:
            torch.cuda.set_device(device)
        runner = build_runner(case)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        conn.send(("ready", runner.param_count, memory_bytes(device, peak=False)))
    except Exception as err:  # reported in the row, never a crash of the sweep
        conn.send(("failed", *classify_failure(err)))
        return
    while True:
        request = conn.recv()
        if request == "finish":
            conn.send(("peak", memory_bytes(device, peak=True)))
            return
        try:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            runner.step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            conn.send(("time", time.perf_counter() - start))
        except Exception as err:
            conn.send(("failed", *classify_failure(err)))
            return


# ---------------------------------------------------------------------------------------------------
# The parent: workers, rounds, results


class _Worker:
    """Parent-side handle of one worker process."""

    def __init__(self, ctx: Any, result: Result) -> None:
        self.result = result
        self.timed: list[float] = []  # seconds of the steps timed in this group
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker_main, args=(child, result.case), daemon=True)
        self.process.start()
        child.close()  # so that a dead worker reads as EOF here

    def ask(self, request: str | None) -> tuple:
        """Send ``request`` (None: only wait for the next message) and return the reply."""
        try:
            if request is not None:
                self.conn.send(request)
            return self.conn.recv()
        except (EOFError, BrokenPipeError, ConnectionResetError):
            self.process.join()
            code = self.process.exitcode
            if code is not None and code < 0:
                return ("failed", "oom", f"worker killed by signal {-code} (likely out of memory)")
            return ("failed", "error", f"worker exited with code {code}")

    def fail(self, status: str, message: str) -> None:
        self.result.status, self.result.message = status, message

    def close(self) -> None:
        self.conn.close()
        self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


def _process_context() -> Any:
    """Workers fork from a server that has imported the benchmark (and torch, timm) once, where the
    platform has one; a fresh interpreter per worker otherwise. Neither inherits the parent's threads or
    memory."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["visattn.bench.timing"])
    return ctx


@contextlib.contextmanager
def _worker_environment() -> Iterator[None]:
    """Environment of the processes started inside: OpenMP threads sleep when idle (``OMP_WAIT_POLICY``
    PASSIVE, unless set by the user). With the default spin-waiting, a worker's threads spin on a shared
    CPU between parallel regions, which slows an op made of many small regions (blocked linear
    attention) far more than others. OpenMP reads the variable when it loads, i.e. in the fork server,
    which starts with the first worker."""
    previous = os.environ.get("OMP_WAIT_POLICY")
    os.environ["OMP_WAIT_POLICY"] = previous or "PASSIVE"
    try:
        yield
    finally:
        if previous is None:
            del os.environ["OMP_WAIT_POLICY"]


def _measure_group(results: list[Result], timing: Timing, progress: Any) -> None:
    """Run the workers of ``results`` together in interleaved rounds; fill in the results."""
    with _worker_environment():
        workers = [_Worker(_process_context(), r) for r in results]
    live: list[_Worker] = []
    for w in workers:
        reply = w.ask(None)
        if reply[0] == "ready":
            w.result.param_count, w.result.build_bytes = reply[1], reply[2]
            live.append(w)
        else:
            w.fail(*reply[1:])

    rest = 0.0  # before each step, as long as the previous step took, at most timing.settle

    def run_round(rows: list[_Worker], timed: bool) -> None:
        nonlocal rest
        serial = next(_ROUND_SERIALS)
        for w in rows:
            time.sleep(rest)
            reply = w.ask("step")
            if reply[0] == "time":
                rest = min(timing.settle, reply[1])
                if timed:
                    w.timed.append(reply[1])
                    w.result.times.append(reply[1])
                    w.result.rounds.append(serial)
            else:
                w.fail(*reply[1:])
                live.remove(w)

    label = f"{results[0].case.size_label} batch {results[0].case.batch_size}"
    for r in range(timing.warmup):
        progress.set_description(f"{label} warm-up {r + 1}/{timing.warmup}")
        run_round(list(live), timed=False)
    rounds = 0
    while pending := [w for w in live if timing.needs_more(w.timed)]:
        rounds += 1
        progress.set_description(f"{label} round {rounds}")
        # floor steps in every round, so that every row's ratio to it has as many rounds as the row; the
        # rounds go on while any row, floor included, needs more steps
        run_round([w for w in live if w in pending or w.result.case.attn == FLOOR], timed=True)
    for w in live:
        reply = w.ask("finish")
        if reply[0] == "peak":
            w.result.peak_bytes = reply[1]
        else:
            w.fail(*reply[1:])
    for w in workers:
        w.close()


def measure(results: list[Result], timing: Timing, max_memory: int, capacity: int, progress: Any) -> None:
    """Skip the configurations estimated above ``max_memory``, then measure the rest of one point, in
    groups whose workers fit the machine's ``capacity`` together, floor's in every group."""
    runnable = skip_over_budget(results, max_memory)
    progress.update(len(results) - len(runnable))
    shared = [r for r in runnable if r.case.attn == FLOOR]
    for group in groups_that_fit(runnable, capacity, shared):
        # A floor that failed in an earlier group is not started again: its failure stands for the point
        # (the report shows it), and rows of later groups get no ratio to floor.
        _measure_group([r for r in group if r.status == "ok" or r not in shared], timing, progress)
        progress.update(len(group) - len(shared))
    progress.update(len(shared))
