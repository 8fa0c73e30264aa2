"""Peak memory of a worker, and which workers the machine holds at once.

* Every configuration runs in its own worker process, which reports its own peak memory at the end:
  peak RSS (``ru_maxrss``) on CPU, ``torch.cuda.max_memory_allocated`` on CUDA. Peak memory of one
  configuration is never mixed with another's.
* Workers whose memory estimates (:func:`visattn.bench.flops.estimate_memory`) do not fit the machine
  together (80% of RAM, 90% of the GPU) run in consecutive groups, floor's workers in every group (so
  that every row has floor in its rounds; see :mod:`visattn.bench.ratios`); a configuration whose own
  estimate exceeds ``--max-memory`` (default: the same bound) is skipped and shown with the estimate.
* The reports print a memory estimate beside the measured peak only where the peaks were measured within a
  stated band of it (:data:`ESTIMATE_BANDS`).
"""
from __future__ import annotations

import os
import resource
import sys
from dataclasses import dataclass

import torch

from visattn.bench.sweep import Result

MB = 2**20  # the reports' unit
# Memory a worker process needs besides its configuration (interpreter, libraries, CUDA context).
RUNTIME_BYTES = 512 * 2**20


@dataclass(frozen=True)
class EstimateBand:
    """Measured peaks were ``low`` to ``high`` times the estimate (:func:`visattn.bench.flops.estimate_memory`)
    on ``measured_on``."""

    low: float
    high: float
    measured_on: str


# Per kind of case and device type, the band of peak over estimate where it was measured. The CUDA peak
# (max_memory_allocated) leaves out the CUDA context, as the estimate does: the 32 rows of the five benchmark
# commands of docs/results/2026-11-27-h200-check.md peaked at 1.02 (linear, training) to 1.46 (linear, inference at
# 224 px) times the estimates that run planned (tests/bench/test_memory_estimate.py keeps them); the Triton paths
# of linear, axial and the local types came after it and have not been measured on a GPU. The CPU peak is the
# worker's resident set, which holds the interpreter and libraries (about 430 MB on the project's 2-core CPU) that
# the estimate leaves out: 94 rows there, every type at 224 to 1024 px, batch 1 and 4, both modes, peaked at 1.06
# to 6.2 times their estimates (docs/benchmark.md), no band worth stating; nor were the ops' own estimates checked
# on any device. Where there is no band, the reports leave the estimate out.
ESTIMATE_BANDS: dict[tuple[str, str], EstimateBand] = {
    ("model", "cuda"): EstimateBand(
        1.02, 1.46, "one NVIDIA H200 at commit 564fa2c (ViT-S/16, bf16, 224 to 2048 px, batch 2 to 128)"
    ),
}


def estimate_band(kind: str, device: str) -> EstimateBand | None:
    """The band of peak over estimate for cases of ``kind`` ("model" or "op") on ``device`` (``cuda:1`` is
    ``cuda``); None where none was measured."""
    return ESTIMATE_BANDS.get((kind, device.split(":")[0]))


def start_on_device(device: torch.device) -> None:
    """Makes ``device`` this process's GPU where it names one (``cuda:N``; a bare ``cuda`` is the current
    device, which ``torch.cuda.set_device`` refuses) and zeroes its peak memory statistics. CPU: nothing."""
    if device.type != "cuda":
        return
    if device.index is not None:
        torch.cuda.set_device(device)
    torch.cuda.reset_peak_memory_stats(device)


def memory_bytes(device: torch.device, peak: bool) -> int:
    """CUDA: allocated now (``peak=False``) or at the peak. CPU: peak RSS of this process so far."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) if peak else torch.cuda.memory_allocated(device)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def proc_status_bytes(name: str) -> int:
    """A value in kB of ``/proc/self/status`` (Linux), in bytes: ``VmRSS``, ``VmHWM``, ``VmData``."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(f"{name}:"):
                return int(line.split()[1]) * 1024
    raise OSError(f"/proc/self/status has no {name}")


def available_bytes() -> int:
    """MemAvailable of ``/proc/meminfo``: what the machine can give without swapping or taking others' memory."""
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError("/proc/meminfo has no MemAvailable")


def capacity_bytes(device: torch.device) -> int:
    """What the workers may use together: 90% of the GPU, or 80% of the machine's RAM."""
    if device.type == "cuda":
        return int(0.9 * torch.cuda.get_device_properties(device).total_memory)
    return int(0.8 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def skip_over_budget(results: list[Result], max_memory: int) -> list[Result]:
    """Marks the results estimated above ``max_memory`` bytes as skipped, with their estimate; returns
    the others."""
    runnable = []
    for r in results:
        if r.estimate_bytes > max_memory:
            r.status = "skipped"
            r.message = f"estimated {r.estimate_bytes / 2**30:.3g} GB > --max-memory {max_memory / 2**30:.3g} GB"
        else:
            runnable.append(r)
    return runnable


def groups_that_fit(results: list[Result], capacity: int, shared: list[Result] | None = None) -> list[list[Result]]:
    """Consecutive groups whose estimates (plus each process's runtime) fit ``capacity`` together.

    The ``shared`` rows (floor) join every group, ahead of the rest in the order of ``results``, so that
    every row is timed in the same rounds as they are; a group holds at least one other row even where
    that exceeds ``capacity``.
    """
    shared = shared or []
    shared_ids = {id(r) for r in shared}
    order = {id(r): i for i, r in enumerate(results)}

    def need(r: Result) -> int:
        return r.estimate_bytes + RUNTIME_BYTES

    base = sum(need(r) for r in shared)
    groups: list[list[Result]] = []
    used = 0
    for r in results:
        if id(r) in shared_ids:
            continue
        if not groups or used + need(r) > capacity:
            groups.append([])
            used = base
        groups[-1].append(r)
        used += need(r)
    if not groups:
        return [list(shared)] if shared else []
    return [sorted(shared + group, key=lambda r: order.get(id(r), -1)) for group in groups]
