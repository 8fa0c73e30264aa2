"""One max-tokens trial: a case built by its :mod:`runner <visattn.bench.runners>` and stepped in its own
process (forked like the sweep's workers, :func:`visattn.bench.timing.process_context`) under a memory cap,
so that a trial over the limit fails alone and the search goes on.

* CPU (Linux): ``RLIMIT_DATA`` set to the process's data size at the start of the trial plus the limit.
  It counts every private writable mapping (the heap, every tensor), so the kernel refuses the
  allocation that would cross the limit and the trial ends with "can't allocate memory", before the
  machine's memory is touched. ``RLIMIT_AS`` would also count the address space the libraries reserve
  and never use (3.4 GiB mapped by a process that has imported the benchmark, 0.9 GiB of it data);
  measuring the peak RSS afterwards would let a trial take the memory first and could not protect a
  machine shared with others.
* CUDA: ``torch.cuda.set_per_process_memory_fraction`` of the limit; the caching allocator raises
  ``OutOfMemoryError`` beyond it.

On both, the limit is what the trial allocates on top of its runtime (interpreter and libraries on
CPU, the CUDA context on a GPU), as :func:`visattn.bench.flops.estimate_memory` counts.
"""
from __future__ import annotations

import resource
import signal
import time
from dataclasses import dataclass
from typing import Any

import torch

from visattn.bench.memory import proc_status_bytes, start_on_device
from visattn.bench.runners import build_runner
from visattn.bench.sweep import Case
from visattn.bench.timing import handle_failure, process_context


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


def cap_memory(device: torch.device, limit: int) -> None:
    """Let this process allocate ``limit`` more bytes and no more (see the module docstring)."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()  # refuses a bare cuda
        total = torch.cuda.get_device_properties(index).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, limit / total), index)
        return
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    soft = proc_status_bytes("VmData") + limit
    resource.setrlimit(resource.RLIMIT_DATA, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))


def _memory_now(device: torch.device, peak: bool) -> int:
    """CUDA: allocated now or at the peak. CPU: resident now (VmRSS) or at the peak (VmHWM)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) if peak else torch.cuda.memory_allocated(device)
    return proc_status_bytes("VmHWM" if peak else "VmRSS")


def _steps_of(case: Case) -> int:
    """A model's training step runs twice: the second one's peak holds AdamW's state as well."""
    return 2 if case.kind == "model" and case.mode == "train" else 1


def _trial_main(conn: Any, case: Case, limit: int) -> None:
    device = torch.device(case.device)
    try:
        start_on_device(device)
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
        conn.send(handle_failure(err, device))


def run_trial(case: Case, grid: tuple[int, int], limit: int, timeout: float) -> Trial:
    """Run ``case`` (on token grid ``grid``) in a new process allowed ``limit`` bytes and ``timeout`` seconds."""
    ctx = process_context()
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
