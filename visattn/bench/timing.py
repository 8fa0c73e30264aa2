"""How a sweep is timed: one worker process per case, driven in interleaved rounds.

* Every configuration (attention type x size x mode) runs in its own worker process, which builds its
  :mod:`runner <visattn.bench.runners>` once and reports its own peak memory at the end
  (:mod:`visattn.bench.memory`).
* The workers of one size (every row, in every mode) are started together and ended before the next
  size; the parent drives interleaved rounds (A B C A B C ...): each worker in turn runs one step,
  timed inside the worker, and reports back. Drift of a shared machine thus hits every row alike. Each
  request times one step (:func:`step_timer`): ``time.perf_counter`` on CPU, two CUDA events on a GPU
  (the device synchronised before and after, not inside), rather than with
  ``torch.utils.benchmark.Timer``, whose runs of many steps would undo the interleaving.
* Idle OpenMP threads sleep rather than spin (``OMP_WAIT_POLICY=PASSIVE`` unless set), so that a
  waiting worker takes no CPU from the one being timed and no type is penalised for its many small ops.
* On CUDA every row runs alone, one worker process at a time (:func:`worker_groups`): only one model
  and one caching allocator on the GPU. Its steps are consecutive rounds of its own, without a rest;
  :mod:`visattn.bench.ratios` compares such rows step by step. A GPU held by one process drifts far less
  than a CPU shared with others, which is what the interleaving guards against.
* On CPU, before each step the parent rests as long as the previous step took, at most ``--settle`` seconds,
  so that the previous worker's step has faded from the machine: a step of many small ops that
  directly follows a long step of another worker runs slower, which would make a row's time depend on
  the row order. The rest costs little where steps are short. ``--compile`` compiles in the first
  untimed round (the CLI asks for at least one).
* After ``--warmup`` untimed rounds, a row is timed until it has ``--min-iters`` steps and
  ``--min-seconds`` of timed steps, or once its timed steps exceed ``--max-seconds``; floor steps in
  every round while any row of its group does. Rows report the
  median step; each timed step keeps the serial of its round, from which :mod:`visattn.bench.ratios`
  forms the ratios between rows round by round. An out-of-memory error (``torch.cuda.OutOfMemoryError``
  included, after which the worker empties the CUDA cache), or a worker killed by the system, is
  reported in its row and the sweep goes on.
* On CPU, where the workers of one point do not fit the machine together, they run in consecutive groups
  (:func:`~visattn.bench.memory.groups_that_fit`), floor in each of them: its steps gather over the
  groups, and its peak memory is that of its last worker.
"""
from __future__ import annotations

import contextlib
import itertools
import multiprocessing as mp
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from visattn.bench.memory import groups_that_fit, memory_bytes, skip_over_budget, start_on_device
from visattn.bench.runners import build_runner, forced_backends
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


def handle_failure(err: BaseException, device: torch.device) -> tuple[str, str]:
    """:func:`classify_failure`; after an out-of-memory error on CUDA, the allocator's cache is emptied
    so that the process's memory goes back to the GPU (``torch.cuda.OutOfMemoryError`` is caught like
    any other error: it ends the row, never the sweep)."""
    status, text = classify_failure(err)
    if status == "oom" and device.type == "cuda":
        torch.cuda.empty_cache()
    return status, text


def time_on_cpu(step: Callable[[], None]) -> float:
    """Seconds of one ``step()`` by the wall clock."""
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def time_with_cuda_events(step: Callable[[], None]) -> float:
    """Seconds of one ``step()`` on the GPU, between two CUDA events: the device is synchronised before
    the first and after the second, never inside the timed region."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    step()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000


def step_timer(device: torch.device) -> Callable[[Callable[[], None]], float]:
    """How a worker times a step on ``device``: CUDA events on a GPU, the wall clock on CPU."""
    return time_with_cuda_events if device.type == "cuda" else time_on_cpu


def settle_on(device: torch.device, settle: float) -> float:
    """The rest before each step: ``settle`` on CPU (see the module docstring); none on CUDA, where one
    process holds the GPU at a time and CUDA events time the device alone."""
    return 0.0 if device.type == "cuda" else settle


def _worker_main(conn: Any, case: Case) -> None:
    """Build the case, then serve "step" (one timed step) and "finish" (peak memory) requests, with the case's
    forced backends (``--backend``) for the whole worker."""
    with forced_backends(case.backends):
        _serve(conn, case)


def _serve(conn: Any, case: Case) -> None:
    device = torch.device(case.device)
    timer = step_timer(device)
    try:
        torch.manual_seed(0)
        start_on_device(device)
        runner = build_runner(case)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        conn.send(("ready", runner.param_count, memory_bytes(device, peak=False)))
    except Exception as err:  # reported in the row, never a crash of the sweep
        conn.send(("failed", *handle_failure(err, device)))
        return
    while True:
        request = conn.recv()
        if request == "finish":
            conn.send(("peak", memory_bytes(device, peak=True)))
            return
        try:
            conn.send(("time", timer(runner.step)))
        except Exception as err:
            conn.send(("failed", *handle_failure(err, device)))
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


def process_context() -> Any:
    """Workers fork from a server that has imported the benchmark (and torch, timm) once, where the
    platform has one; a fresh interpreter per worker otherwise. Neither inherits the parent's threads or
    memory."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
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
    workers: list[_Worker] = []
    try:
        with _worker_environment():
            for r in results:  # appended one by one, so that a stop while they start ends those already started
                workers.append(_Worker(process_context(), r))
        _drive(workers, timing, progress)
    except BaseException:  # interrupted (Ctrl-C, a terminating signal): end the workers now, mid-step too
        for w in workers:
            w.process.kill()
        raise
    finally:
        for w in workers:
            w.close()


def _drive(workers: list[_Worker], timing: Timing, progress: Any) -> None:
    """The rounds of :func:`_measure_group` over its started workers."""
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

    case = workers[0].result.case
    label = f"{case.size_label} batch {case.batch_size}"
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


def worker_groups(runnable: list[Result], capacity: int) -> tuple[list[list[Result]], list[Result]]:
    """The groups of workers that live together, and the rows shared by every group (floor).

    CPU: groups whose estimates fit ``capacity`` together, floor in each
    (:func:`~visattn.bench.memory.groups_that_fit`). CUDA: one worker at a time, alone on the GPU, so that
    no other process's model or cached memory sits beside it; no row is shared.
    """
    if any(torch.device(r.case.device).type == "cuda" for r in runnable):
        return [[r] for r in runnable], []
    shared = [r for r in runnable if r.case.attn == FLOOR]
    return groups_that_fit(runnable, capacity, shared), shared


def measure(results: list[Result], timing: Timing, max_memory: int, capacity: int, progress: Any) -> None:
    """Skip the configurations estimated above ``max_memory``, then measure the rest of one point in the
    groups of :func:`worker_groups`."""
    runnable = skip_over_budget(results, max_memory)
    progress.update(len(results) - len(runnable))
    groups, shared = worker_groups(runnable, capacity)
    for group in groups:
        # A floor that failed in an earlier group is not started again: its failure stands for the point
        # (the report shows it), and rows of later groups get no ratio to floor.
        _measure_group([r for r in group if r.status == "ok" or r not in shared], timing, progress)
        progress.update(len(group) - len(shared))
    progress.update(len(shared))
