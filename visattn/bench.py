"""visattn-bench: speed and peak memory of every attention type on one ViT backbone.

Model sweep (default): for each image size, every selected attention type is built into the same
backbone (``--model``, default ``visattn_vit_small_patch16``) next to two references: ``timm``, timm's
stock ViT of the same shape with its fused softmax attention (``vit_small_patch16_224`` built with the
image size), and ``floor``, the layer that mixes no tokens (the speed limit); ``--references`` can
leave either out, e.g. timm in a run at sizes where one of its steps would take an hour. Each row is timed in
inference (forward under ``inference_mode``) and in training (forward, backward, AdamW step), the
latter optionally with gradient checkpointing (``--grad-checkpointing``).

How it is measured
------------------
* Every configuration (attention type x image size x mode) runs in its own worker process, which
  builds its model once and reports its own peak memory at the end: peak RSS (``ru_maxrss``) on CPU,
  ``torch.cuda.max_memory_allocated`` on CUDA. Peak memory of one configuration is never mixed with
  another's.
* The workers of one image size (every row, in every mode) are started together and ended before the
  next size; the parent drives interleaved rounds (A B C A B C ...): each worker in turn runs one step,
  timed inside the worker, and reports back. Drift of a shared machine thus hits every row alike. Idle
  OpenMP threads sleep rather than spin (``OMP_WAIT_POLICY=PASSIVE`` unless set), so that a waiting
  worker takes no CPU from the one being timed and no type is penalised for its many small ops. Before
  each step the parent rests as long as the previous step took, at most ``--settle`` seconds, so that
  the previous worker's step has faded from the machine (on a 2-core VM, a step of many small ops that
  directly followed a long softmax step of another worker ran up to 15% slower; the rest removes that
  dependence on the row order, and costs little where steps are short). After ``--warmup`` untimed
  rounds, a row is timed until it has ``--min-iters`` steps and ``--min-seconds`` of timed steps, or once its timed
  steps exceed ``--max-seconds``. Rows report the median step.
* Workers whose memory estimates do not fit the machine together (80% of RAM, 90% of the GPU) run in
  consecutive groups; a configuration whose own estimate exceeds ``--max-memory`` (default: the same
  bound) is skipped and shown with the estimate (:func:`visattn.flops.estimate_memory`). An
  out-of-memory error, or a worker killed by the system, is reported in its row.

Per row: images/s and ms per step (timm's ``infer_samples_per_sec``, ``infer_step_time``, ...),
analytic GFLOPs per image (:mod:`visattn.flops`; training = forward + backward), achieved GFLOP/s, % of
floor's images/s, speed-up over timm, peak memory, and the parameter count (millions, ``param_count``).
Outputs: a markdown report on stdout (also ``bench.md``), ``bench.csv``, ``bench.png`` (images/s and
peak memory against tokens, log-log) and ``bench_summary.json`` in ``--out``. The report adds the scaling
exponents of step time and memory against tokens (log-log slope over the largest ``--fit-points``
sizes; memory above the model's own footprint) and, per type, the crossover: the smallest token count
from which it beats timm at every larger measured size.

``--calibrate`` also writes, from this sweep, the calibration that ``attn="auto"`` reads
(:mod:`visattn.auto`).

Ops mode (``--ops``): the token mixing alone (each layer's ``mix`` on random q, k, v; batch 1, 6 heads
of 64, as ViT-S) on grids of 512 to 32,768 tokens, in the same harness, beside ``softmax_explicit``
(softmax with explicit N x N scores) and the seed table's claimed times.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import inspect
import json
import math
import multiprocessing as mp
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from visattn.flops import (
    EXPLICIT_SOFTMAX,
    TokenLayout,
    ViTShape,
    attention_options,
    cost_model,
    estimate_memory,
    mixing_flops,
    train_flops,
    vit_flops,
)
from visattn.layers import get_attention, list_attentions

MODES = ("infer", "train")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TIMM = "timm"
FLOOR = "floor"
DEFAULT_MODEL = "visattn_vit_small_patch16"
DEFAULT_SIZES = ("224", "512", "1024", "2048")
DEFAULT_GRIDS = ("16x32", "32x64", "64x128", "128x256")
# Memory a worker process needs besides its configuration (interpreter, libraries, CUDA context).
RUNTIME_BYTES = 512 * 2**20
MB = 2**20

# The seed's table (ms; None: out of memory) for its "standard", "sparse" (Longformer-style) and "linear"
# attention, keyed by tokens, and the rows of the ops benchmark each claim is compared with.
SEED_CLAIMS_MS: dict[int, dict[str, float | None]] = {
    512: {"standard": 100.0, "sparse": 80.0, "linear": 60.0},
    2048: {"standard": 1600.0, "sparse": 200.0, "linear": 100.0},
    8192: {"standard": None, "sparse": 800.0, "linear": 300.0},
}
SEED_CLAIM_OF_ROW = {
    "softmax": "standard",
    EXPLICIT_SOFTMAX: "standard",
    "sparse": "sparse",
    "longformer": "sparse",
    "linear": "linear",
}


# ---------------------------------------------------------------------------------------------------
# What one worker measures


@dataclass(frozen=True)
class Case:
    """One configuration, measured by one worker process."""

    kind: str  # "model" or "op"
    attn: str  # a registry name, "timm" or "softmax_explicit"
    mode: str  # "infer" or "train"
    size: tuple[int, int]  # image (H, W) pixels for a model, token grid (H, W) for an op
    batch_size: int
    device: str
    dtype: str
    compile: bool
    attn_kwargs: dict[str, Any] = field(default_factory=dict)
    model_name: str = DEFAULT_MODEL
    timm_name: str = ""
    num_classes: int = 1000
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    num_heads: int = 6
    head_dim: int = 64
    grad_checkpointing: bool = False  # train mode: timm's set_grad_checkpointing (recompute each block)

    @property
    def size_label(self) -> str:
        h, w = self.size
        return str(h) if h == w and self.kind == "model" else f"{h}x{w}"


def _autocast(case: Case) -> Any:
    return torch.autocast(device_type=torch.device(case.device).type, dtype=DTYPES[case.dtype], enabled=case.dtype != "fp32")


def build_model(case: Case, device: str | torch.device | None = None) -> torch.nn.Module:
    """The model of a model case: the visattn ViT with ``case.attn``, or timm's stock ViT for ``timm``."""
    import timm

    import visattn  # noqa: F401  (registers the visattn_vit_* models)

    common = dict(img_size=case.size, num_classes=case.num_classes, **case.model_kwargs)
    with torch.device(device or case.device):
        if case.attn == TIMM:
            return timm.create_model(case.timm_name, **common)
        return timm.create_model(case.model_name, attn=case.attn, attn_kwargs=case.attn_kwargs, **common)


def _layer_kwargs(case: Case) -> dict[str, Any]:
    """Type options of an op case; ``ref_grid`` is the live grid, as in a model built at that size."""
    params = inspect.signature(get_attention(case.attn).__init__).parameters
    return ({"ref_grid": case.size} if "ref_grid" in params else {}) | case.attn_kwargs


def _model_step(case: Case) -> tuple[Callable[[], None], int]:
    device = torch.device(case.device)
    model = build_model(case)
    param_count = sum(p.numel() for p in model.parameters())
    x = torch.randn(case.batch_size, 3, *case.size, device=device)
    forward = torch.compile(model) if case.compile else model
    if case.mode == "infer":
        model.eval()

        def step() -> None:
            with torch.inference_mode(), _autocast(case):
                forward(x)

        return step, param_count
    model.train()
    model.set_grad_checkpointing(case.grad_checkpointing)
    target = torch.randint(0, case.num_classes, (case.batch_size,), device=device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with _autocast(case):
            loss = torch.nn.functional.cross_entropy(forward(x), target)
        loss.backward()
        optimizer.step()

    return step, param_count


def _op_step(case: Case) -> tuple[Callable[[], None], int]:
    from visattn.ops import softmax_reference

    device = torch.device(case.device)
    h, d, grid = case.num_heads, case.head_dim, case.size
    training = case.mode == "train"
    qkv = [
        torch.randn(case.batch_size, h, grid[0] * grid[1], d, device=device, requires_grad=training)
        for _ in range(3)
    ]  # (B, heads, N, d) each
    if case.attn == EXPLICIT_SOFTMAX:
        layer = None
        mix = softmax_reference
    else:
        layer = get_attention(case.attn)(h * d, num_heads=h, device=device, **_layer_kwargs(case))
        layer.set_grid(grid, 0)

        def mix(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return layer.mix(q, k, v, grid=grid, attn_mask=None, is_causal=False)

    param_count = sum(p.numel() for p in layer.parameters()) if layer is not None else 0
    mix = torch.compile(mix) if case.compile else mix
    if not training:

        def step() -> None:
            with torch.inference_mode(), _autocast(case):
                mix(*qkv)

        return step, param_count
    cotangent = torch.randn(case.batch_size, h, grid[0] * grid[1], d, device=device)

    def step() -> None:
        for t in qkv:
            t.grad = None
        if layer is not None:
            layer.zero_grad(set_to_none=True)
        with _autocast(case):
            out = mix(*qkv)
        out.backward(cotangent.to(out.dtype))

    return step, param_count


def _memory_bytes(device: torch.device, peak: bool) -> int:
    """CUDA: allocated now (``peak=False``) or at the peak. CPU: peak RSS of this process so far."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) if peak else torch.cuda.memory_allocated(device)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def _failure(err: BaseException) -> tuple[str, str]:
    text = f"{type(err).__name__}: {err}".splitlines()[0][:300]
    out_of_memory = isinstance(err, torch.OutOfMemoryError) or any(
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
        step, param_count = (_model_step if case.kind == "model" else _op_step)(case)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        conn.send(("ready", param_count, _memory_bytes(device, peak=False)))
    except Exception as err:  # reported in the row, never a crash of the sweep
        conn.send(("failed", *_failure(err)))
        return
    while True:
        request = conn.recv()
        if request == "finish":
            conn.send(("peak", _memory_bytes(device, peak=True)))
            return
        try:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            conn.send(("time", time.perf_counter() - start))
        except Exception as err:
            conn.send(("failed", *_failure(err)))
            return


# ---------------------------------------------------------------------------------------------------
# The parent: workers, rounds, results


@dataclass
class Result:
    """What was measured (or why not) for one case."""

    case: Case
    tokens: int
    grid: tuple[int, int]
    flops: int  # per image (per batch element for an op), this case's mode
    estimate_bytes: int
    param_count: int
    status: str = "ok"  # ok | skipped | oom | error
    message: str = ""
    times: list[float] = field(default_factory=list)
    build_bytes: int | None = None
    peak_bytes: int | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok" and bool(self.times)

    @property
    def step_time(self) -> float | None:
        """Median seconds per step."""
        return statistics.median(self.times) if self.ok else None

    @property
    def samples_per_sec(self) -> float | None:
        return self.case.batch_size / self.step_time if self.ok else None

    @property
    def activation_bytes(self) -> int | None:
        """Peak above the footprint after building: activations, gradients, optimizer state."""
        if self.peak_bytes is None or self.build_bytes is None:
            return None
        return self.peak_bytes - self.build_bytes


@dataclass(frozen=True)
class Timing:
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


class _Worker:
    """Parent-side handle of one worker process."""

    def __init__(self, ctx: Any, result: Result) -> None:
        self.result = result
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
    """Workers fork from a server that has imported visattn (and torch, timm) once, where the platform has
    one; a fresh interpreter per worker otherwise. Neither inherits the parent's threads or memory."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["visattn"])  # not visattn.bench: a worker may run it as its main module
    return ctx


@contextlib.contextmanager
def _worker_environment() -> Iterator[None]:
    """Environment of the processes started inside: OpenMP threads sleep when idle (``OMP_WAIT_POLICY``
    PASSIVE, unless set by the user). With the default spin-waiting, a worker's threads spin on a shared
    CPU between parallel regions, and an op made of many small regions (blocked linear attention) ran up
    to 50x slower, unevenly across types. OpenMP reads the variable when it loads, i.e. in the fork
    server, which starts with the first worker."""
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
        for w in rows:
            time.sleep(rest)
            reply = w.ask("step")
            if reply[0] == "time":
                rest = min(timing.settle, reply[1])
                if timed:
                    w.result.times.append(reply[1])
            else:
                w.fail(*reply[1:])
                live.remove(w)

    label = results[0].case.size_label
    for r in range(timing.warmup):
        progress.set_description(f"{label} warm-up {r + 1}/{timing.warmup}")
        run_round(list(live), timed=False)
    rounds = 0
    while pending := [w for w in live if timing.needs_more(w.result.times)]:
        rounds += 1
        progress.set_description(f"{label} round {rounds}")
        run_round(pending, timed=True)
    for w in live:
        reply = w.ask("finish")
        if reply[0] == "peak":
            w.result.peak_bytes = reply[1]
        else:
            w.fail(*reply[1:])
    for w in workers:
        w.close()
        progress.update(1)


def _groups(results: list[Result], capacity: int) -> list[list[Result]]:
    """Consecutive groups whose estimates (plus each process's runtime) fit ``capacity`` together."""
    groups: list[list[Result]] = []
    used = 0
    for r in results:
        need = r.estimate_bytes + RUNTIME_BYTES
        if not groups or used + need > capacity:
            groups.append([])
            used = 0
        groups[-1].append(r)
        used += need
    return groups


def measure(results: list[Result], timing: Timing, max_memory: int, capacity: int, progress: Any) -> None:
    """Skip the configurations estimated above ``max_memory``, then measure the rest of one size, in
    groups whose workers fit the machine's ``capacity`` together."""
    runnable = []
    for r in results:
        if r.estimate_bytes > max_memory:
            r.status = "skipped"
            r.message = f"estimated {r.estimate_bytes / 2**30:.3g} GB > --max-memory {max_memory / 2**30:.3g} GB"
            progress.update(1)
        else:
            runnable.append(r)
    for group in _groups(runnable, capacity):
        _measure_group(group, timing, progress)


# ---------------------------------------------------------------------------------------------------
# Planning: the cases of a sweep with their FLOPs and memory estimates


def timm_reference_name(model_name: str) -> str:
    """timm's stock model of the same shape: ``visattn_vit_small_patch16`` -> ``vit_small_patch16_224``."""
    import timm

    candidate = model_name.removeprefix("visattn_") + "_224"
    if not model_name.startswith("visattn_") or not timm.is_model(candidate):
        raise ValueError(f"no timm reference model found for {model_name!r}; name one with --timm-model")
    return candidate


def _act_bytes(dtype: str) -> int:
    return DTYPES[dtype].itemsize


def plan_model_sweep(args: argparse.Namespace) -> list[list[Result]]:
    """The results to fill, one list per image size: rows timm, floor, the types; each in every mode."""
    references = [r for r in (TIMM, FLOOR) if r in args.references]
    rows = references + [a for a in args.attn if a not in references]
    plan = []
    for size in args.sizes:
        group = []
        for mode in args.modes:
            if mode == "train" and args.train_sizes is not None and size not in args.train_sizes:
                continue
            for attn in rows:
                case = Case(
                    kind="model", attn=attn, mode=mode, size=size, batch_size=args.batch_size, device=args.device,
                    dtype=args.dtype, compile=args.compile, attn_kwargs=args.attn_kwargs.get(attn, {}),
                    model_name=args.model, timm_name=args.timm_model, num_classes=args.num_classes,
                    model_kwargs=args.model_kwargs, grad_checkpointing=args.grad_checkpointing,
                )
                meta = build_model(case, device="meta")  # also checks the options, before any worker starts
                shape = ViTShape.from_model(meta)
                cost_attn = "softmax" if attn == TIMM else attn
                options = attention_options(cost_attn, case.attn_kwargs, shape.grid(size))
                param_count = sum(p.numel() for p in meta.parameters())
                training = mode == "train"
                flops = (train_flops if training else vit_flops)(shape, size, cost_attn, options)
                estimate = estimate_memory(
                    shape, size, cost_attn, options, args.batch_size, training, _act_bytes(args.dtype), param_count,
                    grad_checkpointing=args.grad_checkpointing,
                )
                grid = shape.grid(size)
                group.append(Result(case, grid[0] * grid[1], grid, flops, estimate, param_count))
        plan.append(group)
    return plan


def estimate_op_memory(case: Case, layout: TokenLayout, options: dict[str, Any]) -> int:
    """q, k, v (and their gradients in training) plus the op's own buffers, for the batch."""
    h, d, act = case.num_heads, case.head_dim, _act_bytes(case.dtype)
    mix = cost_model(case.attn).memory(layout, h, d, options, act)
    qkv = 3 * layout.num_tokens * h * d * act
    if case.mode == "train":
        return mix.shared + case.batch_size * (2 * qkv + mix.train + mix.infer)
    return mix.shared + case.batch_size * (qkv + mix.infer)


def plan_ops_sweep(args: argparse.Namespace) -> list[list[Result]]:
    rows = ["softmax", EXPLICIT_SOFTMAX] + [a for a in args.attn if a not in ("softmax", FLOOR)]
    plan = []
    for grid in args.grids:
        group = []
        for mode in args.modes:
            for attn in rows:
                case = Case(
                    kind="op", attn=attn, mode=mode, size=grid, batch_size=args.batch_size, device=args.device,
                    dtype=args.dtype, compile=args.compile, attn_kwargs=args.attn_kwargs.get(attn, {}),
                    num_heads=args.heads, head_dim=args.head_dim,
                )
                if attn != EXPLICIT_SOFTMAX:
                    get_attention(attn)(args.heads * args.head_dim, num_heads=args.heads, device="meta", **_layer_kwargs(case))
                layout = TokenLayout(grid, 0)
                options = attention_options(attn, case.attn_kwargs, grid)
                flops = mixing_flops(attn, layout, args.heads, args.head_dim, options)
                flops *= 3 if mode == "train" else 1  # each product has two products in its backward
                group.append(Result(case, layout.num_tokens, grid, flops, estimate_op_memory(case, layout, options), 0))
        plan.append(group)
    return plan


# ---------------------------------------------------------------------------------------------------
# Analysis: exponents and crossovers


def fit_exponent(tokens: Sequence[float], values: Sequence[float | None], points: int = 3) -> float | None:
    """Log-log slope of ``values`` against ``tokens`` over the largest ``points`` token counts that have
    a positive value (least squares); None with fewer than two such points."""
    pairs = sorted((t, v) for t, v in zip(tokens, values) if v is not None and v > 0)[-points:]
    if len(pairs) < 2:
        return None
    xs = [math.log(t) for t, _ in pairs]
    ys = [math.log(v) for _, v in pairs]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)


def crossover_tokens(points: Iterable[tuple[int, float | None, float | None]]) -> int | None:
    """The smallest token count from which a type beats the reference at every larger measured count.

    Args:
        points: (tokens, the type's step time, the reference's step time); None where it did not run
            (skipped, out of memory). A type that ran beats a reference that did not; sizes where
            neither ran are ignored.
    Returns:
        the token count, or None if the type does not beat the reference at the largest count.
    """
    crossover = None
    for tokens, own, reference in sorted(points, reverse=True):
        if own is None and reference is None:
            continue
        if own is None or (reference is not None and own >= reference):
            break
        crossover = tokens
    return crossover


# ---------------------------------------------------------------------------------------------------
# Reports


def _by_row(results: Iterable[Result]) -> dict[tuple[str, str], dict[str, Result]]:
    """{(attn, size label): {mode: result}} in sweep order."""
    rows: dict[tuple[str, str], dict[str, Result]] = {}
    for r in results:
        rows.setdefault((r.case.attn, r.case.size_label), {})[r.case.mode] = r
    return rows


def _reference(results: list[Result], attn: str, r: Result) -> Result | None:
    for other in results:
        if other.case.attn == attn and other.case.size == r.case.size and other.case.mode == r.case.mode:
            return other
    return None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _round(x: float | None, digits: int = 3) -> float | None:
    return None if x is None else float(f"{x:.{digits}g}")


def _mb(x: int | None) -> float | None:
    return None if x is None else round(x / MB, 1)


def csv_rows(results: list[Result]) -> list[dict[str, Any]]:
    """One row per attention type x size with timm's column names (``infer_samples_per_sec``, ...)."""
    out = []
    for (attn, _), by_mode in _by_row(results).items():
        first = next(iter(by_mode.values()))
        case = first.case
        row: dict[str, Any] = {"attn": attn}
        if case.kind == "model":
            row |= {"model": case.timm_name if attn == TIMM else case.model_name}
        else:
            row |= {"num_heads": case.num_heads, "head_dim": case.head_dim}
        row |= {"tokens": first.tokens, "grid": f"{first.grid[0]}x{first.grid[1]}", "device": case.device, "dtype": case.dtype}
        if case.kind == "model":
            row["param_count"] = round(first.param_count / 1e6, 3)
        for mode, r in by_mode.items():
            sps = r.samples_per_sec
            gflops = r.flops / 1e9
            row |= {
                f"{mode}_samples_per_sec": _round(sps, 4),
                f"{mode}_step_time": _round(None if r.step_time is None else 1000 * r.step_time, 4),
                f"{mode}_batch_size": case.batch_size,
            }
            if case.kind == "model":
                row[f"{mode}_img_size"] = case.size_label
            row |= {
                f"{mode}_iters": len(r.times),
                f"{mode}_gflops": _round(gflops, 4),
                f"{mode}_gmacs": _round(gflops / 2, 4),
                f"{mode}_gflops_per_sec": _round(None if sps is None else gflops * sps, 4),
            }
            if case.kind == "model":
                floor, timm = _reference(results, FLOOR, r), _reference(results, TIMM, r)
                pct = _ratio(sps, floor.samples_per_sec if floor else None)
                row[f"{mode}_pct_of_floor"] = _round(None if pct is None else 100 * pct, 4)
                row[f"{mode}_speedup_vs_timm"] = _round(_ratio(sps, timm.samples_per_sec if timm else None), 4)
            row |= {
                f"{mode}_peak_mem_mb": _mb(r.peak_bytes),
                f"{mode}_act_mem_mb": _mb(r.activation_bytes),
                f"{mode}_mem_estimate_mb": _mb(r.estimate_bytes),
                f"{mode}_status": _status_cell(r),
            }
        if case.kind == "op":
            row["seed_claimed_ms"] = _seed_claim(attn, first.tokens)
        out.append(row)
    return out


def _seed_claim(attn: str, tokens: int) -> str:
    claim = SEED_CLAIM_OF_ROW.get(attn)
    if claim is None or tokens not in SEED_CLAIMS_MS:
        return ""
    ms = SEED_CLAIMS_MS[tokens][claim]
    return f"{claim}: {'OOM' if ms is None else f'{ms:g}'}"


def summarize(results: list[Result], fit_points: int) -> dict[str, Any]:
    """Scaling exponents (time and memory vs tokens) and crossovers per attention type and mode. The
    crossover reference is timm in the model sweep and the fused softmax op in the ops benchmark."""
    reference = "softmax" if results[0].case.kind == "op" else TIMM
    summary: dict[str, Any] = {"exponents": {}, "crossover_reference": reference, "crossover": {}}
    attns = list(dict.fromkeys(r.case.attn for r in results))
    modes = list(dict.fromkeys(r.case.mode for r in results))
    for attn in attns:
        for mode in modes:
            mine = [r for r in results if r.case.attn == attn and r.case.mode == mode]
            tokens = [r.tokens for r in mine]
            summary["exponents"].setdefault(attn, {})[mode] = {
                "time": _round(fit_exponent(tokens, [r.step_time for r in mine], fit_points)),
                "memory": _round(fit_exponent(tokens, [r.activation_bytes for r in mine], fit_points)),
            }
            if attn != reference and reference in attns:
                points = [(r.tokens, r.step_time, _reference(results, reference, r).step_time) for r in mine]
                summary["crossover"].setdefault(attn, {})[mode] = crossover_tokens(points)
    return summary


def _fmt(x: float | None, digits: int = 3) -> str:
    if x is None:
        return "-"
    return f"{x:.{digits}g}" if abs(x) < 10**digits else f"{x:.0f}"


def _status_cell(r: Result) -> str:
    return f"{r.status}: {r.message}" if r.message else r.status


def _table_cells(r: Result, results: list[Result]) -> dict[str, str]:
    """The markdown cells of one result, keyed by column; a row that did not run shows why instead of a time."""
    ops = r.case.kind == "op"
    speed_column = "ms/step" if ops else "images/s"
    cells = {"attn": r.case.attn, "grid" if ops else "img": r.case.size_label, "tokens": str(r.tokens)}
    if ops and r.case.mode == "infer":
        cells["seed claim (ms)"] = _seed_claim(r.case.attn, r.tokens)
    if r.ok:
        sps = r.samples_per_sec
        cells |= {"images/s": _fmt(sps, 4), "ms/step": _fmt(1000 * r.step_time, 4), "GFLOP/s": _fmt(r.flops / 1e9 * sps, 4)}
        if not ops:
            floor, timm = _reference(results, FLOOR, r), _reference(results, TIMM, r)
            pct = _ratio(sps, floor.samples_per_sec if floor else None)
            cells["% floor"] = _fmt(None if pct is None else 100 * pct)
            cells["x timm"] = _fmt(_ratio(sps, timm.samples_per_sec if timm else None))
    else:
        cells[speed_column] = _status_cell(r)
    cells |= {"GFLOPs" if ops else "GFLOPs/img": _fmt(r.flops / 1e9, 4)}
    cells |= {"peak MB": _fmt(_mb(r.peak_bytes), 6), "est. MB": _fmt(_mb(r.estimate_bytes), 6)}
    if not ops:
        cells["params (M)"] = _fmt(r.param_count / 1e6)
    return cells


def _markdown_table(header: list[str], rows: Iterable[dict[str, str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row.get(column, "") for column in header) + " |" for row in rows]
    return lines + [""]


def markdown_report(results: list[Result], summary: dict[str, Any], fit_points: int) -> str:
    first = results[0].case
    ops = first.kind == "op"
    what = (
        f"attention ops alone, batch {first.batch_size}, {first.num_heads} heads x {first.head_dim}"
        if ops
        else f"{first.model_name} vs timm {first.timm_name}, batch {first.batch_size}"
    )
    flags = (", compiled" if first.compile else "") + (", gradient checkpointing" if first.grad_checkpointing else "")
    lines = [f"# visattn-bench: {what}, {first.device}, {first.dtype}{flags}", ""]
    modes = list(dict.fromkeys(r.case.mode for r in results))
    titles = (
        {"infer": "Forward", "train": "Forward + backward"}
        if ops
        else {"infer": "Inference (forward)", "train": "Training step (forward + backward + AdamW)"}
    )
    for mode in modes:
        if ops:
            header = ["attn", "grid", "tokens", "ms/step"] + (["seed claim (ms)"] if mode == "infer" else [])
            header += ["GFLOPs", "GFLOP/s", "peak MB", "est. MB"]
        else:
            header = ["attn", "img", "tokens", "images/s", "ms/step", "GFLOPs/img", "GFLOP/s", "% floor", "x timm"]
            header += ["peak MB", "est. MB", "params (M)"]
        lines += [f"## {titles[mode]}", ""]
        lines += _markdown_table(header, (_table_cells(r, results) for r in results if r.case.mode == mode))
    lines += [f"## Scaling exponents (log-log slope over the largest {fit_points} sizes)", ""]
    lines += ["Time: median step time; memory: peak above the footprint after building.", ""]
    header = ["attn"] + [f"{mode} {what}" for mode in modes for what in ("time", "memory")]
    lines += _markdown_table(
        header,
        (
            {"attn": attn} | {f"{m} {what}": _fmt(by_mode[m][what]) for m in modes for what in ("time", "memory")}
            for attn, by_mode in summary["exponents"].items()
        ),
    )
    reference = summary["crossover_reference"]
    lines += [f"## Crossover: smallest token count from which the type beats {reference} at every larger size", ""]
    largest = {m: max(r.tokens for r in results if r.case.mode == m) for m in modes}
    lines += _markdown_table(
        ["attn"] + modes,
        (
            {"attn": attn} | {m: str(by_mode[m]) if by_mode[m] is not None else f"not up to {largest[m]}" for m in modes}
            for attn, by_mode in summary["crossover"].items()
        ),
    )
    return "\n".join(lines)


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    columns = list(dict.fromkeys(k for row in rows for k in row))
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


def plot(results: list[Result], path: Path) -> None:
    """Speed and peak memory against tokens, log-log, one line per attention type."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    ops = results[0].case.kind == "op"
    modes = list(dict.fromkeys(r.case.mode for r in results))
    fig, axes = plt.subplots(len(modes), 2, figsize=(12, 4.5 * len(modes)), squeeze=False)
    style = {TIMM: dict(color="black", linewidth=2.5), FLOOR: dict(color="grey", linestyle="--", linewidth=2)}
    for row, mode in enumerate(modes):
        ax_speed, ax_mem = axes[row]
        for attn in dict.fromkeys(r.case.attn for r in results):
            mine = [r for r in results if r.case.attn == attn and r.case.mode == mode and r.ok]
            if not mine:
                continue
            tokens = [r.tokens for r in mine]
            speed = [1000 * r.step_time for r in mine] if ops else [r.samples_per_sec for r in mine]
            kwargs = style.get(attn, {}) | dict(marker="o", label=attn)
            ax_speed.plot(tokens, speed, **kwargs)
            mem = [(t, r.peak_bytes / MB) for t, r in zip(tokens, mine) if r.peak_bytes]
            if mem:
                ax_mem.plot(*zip(*mem), **kwargs)
        ax_speed.set_ylabel("ms per step" if ops else "images / s")
        ax_mem.set_ylabel("peak memory (MB)")
        measured = sorted({r.tokens for r in results if r.case.mode == mode})
        for ax, what in ((ax_speed, "speed"), (ax_mem, "peak memory")):
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xticks(measured, [str(t) for t in measured])  # the measured sizes, not crowded minor ticks
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.set_xlabel("tokens")
            ax.set_title(f"{mode}: {what}")
            ax.grid(True, which="both", alpha=0.3)
        if ax_speed.lines:
            ax_speed.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------------
# Calibration for attn="auto"


def calibrate(results: list[Result], args: argparse.Namespace) -> dict[str, Any]:
    """Write the thresholds of ``attn="auto"`` from this sweep: training step if measured, else inference.
    Returns where, and the thresholds."""
    from visattn.auto import save_calibration, thresholds_from_timings

    mode = "train" if "train" in args.modes else "infer"
    timings: dict[int, dict[str, float]] = {}
    for r in results:
        if r.case.mode == mode and r.ok and r.case.attn != TIMM:
            timings.setdefault(r.tokens, {})[r.case.attn] = r.step_time / r.case.batch_size
    thresholds = thresholds_from_timings(timings)
    details = {
        "mode": mode, "device": args.device, "dtype": args.dtype, "batch_size": args.batch_size,
        "seconds_per_image": {str(t): v for t, v in sorted(timings.items())},
    }
    return {"path": str(save_calibration(args.model, thresholds, details)), "thresholds": thresholds}


# ---------------------------------------------------------------------------------------------------
# Command line


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


def _key_value(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, yaml.safe_load(value)


def _attn_kwargs(text: str) -> dict[str, dict[str, Any]]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"--attn-kwargs must be JSON: {err}") from None
    if not isinstance(value, dict) or not all(isinstance(v, dict) for v in value.values()):
        raise argparse.ArgumentTypeError('--attn-kwargs must map attention names to options, e.g. \'{"linformer": {"k": 64}}\'')
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="visattn-bench",
        description="Throughput and peak memory of the visattn attention types vs timm's fused softmax attention.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--ops", action="store_true", help="time the attention ops alone (no model) on --grids")
    p.add_argument("--calibrate", action="store_true", help="also write the calibration of attn='auto' for --model")
    p.add_argument("--model", default=DEFAULT_MODEL, help="visattn model (timm name)")
    p.add_argument("--timm-model", help="timm's stock reference model; default: --model without 'visattn_', with '_224'")
    p.add_argument("--attn", nargs="+", default=list_attentions(), help="attention types (the references timm and floor are added, see --references)")
    p.add_argument("--attn-kwargs", type=_attn_kwargs, default={}, help='type options as JSON, e.g. \'{"linformer": {"k": 64}}\'')
    p.add_argument("--model-kwargs", type=_key_value, nargs="*", default=[], metavar="KEY=VALUE", help="passed to both models, e.g. depth=6")
    p.add_argument("--sizes", type=_size, nargs="+", default=[_size(s) for s in DEFAULT_SIZES], help="image sizes: N or HxW")
    p.add_argument(
        "--train-sizes", type=_size, nargs="+", default=None,
        help="image sizes of the train mode, if not all of --sizes (a 2048^2 softmax training step takes minutes)",
    )
    p.add_argument("--grids", type=_size, nargs="+", default=[_size(s) for s in DEFAULT_GRIDS], help="token grids of --ops")
    p.add_argument("--heads", type=int, default=6, help="heads of --ops")
    p.add_argument("--head-dim", type=int, default=64, help="head width of --ops")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="infer: forward; train: forward, backward, AdamW")
    p.add_argument("--batch-size", type=int, default=1, help="images (q, k, v batch in --ops) per step")
    p.add_argument("--num-classes", type=int, default=1000, help="classifier width of both models")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", choices=list(DTYPES), default="fp32", help="bf16: autocast mixed precision")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (the op in --ops)")
    p.add_argument(
        "--references", nargs="*", choices=[TIMM, FLOOR], default=[TIMM, FLOOR],
        help="reference rows of the model sweep; leave timm out where its step would take too long",
    )
    p.add_argument(
        "--grad-checkpointing", action="store_true", help="train mode: recompute each block in the backward (timm's set_grad_checkpointing)"
    )
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds")
    p.add_argument("--min-iters", type=int, default=5, help="timed steps per row, at least")
    p.add_argument("--min-seconds", type=float, default=2.0, help="timed seconds per row, at least")
    p.add_argument("--max-seconds", type=float, default=120.0, help="stop timing a row past this many timed seconds")
    p.add_argument("--settle", type=float, default=0.5, help="rest before each step: as long as the previous step took, at most this many seconds")
    p.add_argument(
        "--max-memory", type=float,
        help="GB a configuration may use by estimate, else it is skipped; default: 80%% of RAM (CPU), 90%% of the GPU",
    )
    p.add_argument("--fit-points", type=int, default=3, help="largest sizes in the scaling-exponent fit")
    p.add_argument("--out", type=Path, default=Path("bench_out"), help="output directory")
    return p


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    unknown = [a for a in args.attn if a not in list_attentions()]
    if unknown:
        parser.error(f"unknown attention(s) {', '.join(unknown)}; valid: {', '.join(list_attentions())}")
    args.attn = list(dict.fromkeys(args.attn))
    bad_kwargs = [a for a in args.attn_kwargs if a not in args.attn]
    if bad_kwargs:
        parser.error(f"--attn-kwargs for {', '.join(bad_kwargs)}, which is not among --attn ({', '.join(args.attn)})")
    args.model_kwargs = dict(args.model_kwargs)
    taken = {"img_size", "num_classes", "attn", "attn_kwargs"} & set(args.model_kwargs)
    if taken:
        parser.error(f"--model-kwargs cannot set {', '.join(sorted(taken))}; use --sizes, --num-classes, --attn, --attn-kwargs")
    for name in ("batch_size", "num_classes", "heads", "head_dim", "min_iters", "fit_points"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    finite = all(math.isfinite(s) for s in (args.min_seconds, args.settle, args.max_seconds))
    if not finite or args.warmup < 0 or args.min_seconds < 0 or args.settle < 0 or args.max_seconds <= 0:
        parser.error("--warmup, --min-seconds and --settle must be >= 0 and --max-seconds > 0")
    if args.calibrate and args.ops:
        parser.error("--calibrate measures the model sweep; it cannot be combined with --ops")
    if args.grad_checkpointing and (args.ops or "train" not in args.modes):
        parser.error("--grad-checkpointing applies to the model sweep's train mode; add --modes train, without --ops")
    device = torch.device(args.device)
    if device.type not in ("cpu", "cuda") or (device.type == "cuda" and not torch.cuda.is_available()):
        parser.error(f"--device must be cpu or an available cuda device, got {args.device!r}")
    if device.type == "cuda":
        args.capacity_bytes = int(0.9 * torch.cuda.get_device_properties(device).total_memory)
    else:
        args.capacity_bytes = int(0.8 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    if args.max_memory is not None and args.max_memory <= 0:
        parser.error("--max-memory must be > 0")
    if args.train_sizes is not None and not set(args.train_sizes) <= set(args.sizes):
        parser.error(f"--train-sizes must be among --sizes {args.sizes}, got {args.train_sizes}")
    args.max_memory_bytes = args.capacity_bytes if args.max_memory is None else int(args.max_memory * 2**30)
    if not args.ops:
        try:
            args.timm_model = args.timm_model or timm_reference_name(args.model)
        except ValueError as err:
            parser.error(str(err))
    return args


def run(args: argparse.Namespace) -> tuple[list[Result], dict[str, Any]]:
    """Plan, measure, write the outputs; returns the results and the summary."""
    from tqdm import tqdm

    plan = plan_ops_sweep(args) if args.ops else plan_model_sweep(args)
    timing = Timing(args.warmup, args.min_iters, args.min_seconds, args.max_seconds, args.settle)
    with tqdm(total=sum(len(g) for g in plan), unit="config", file=sys.stderr, dynamic_ncols=True) as progress:
        for group in plan:
            measure(group, timing, args.max_memory_bytes, args.capacity_bytes, progress)
    results = [r for group in plan for r in group]
    summary = summarize(results, args.fit_points)
    report = markdown_report(results, summary, args.fit_points)
    stem = "ops" if args.ops else "bench"
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(csv_rows(results), args.out / f"{stem}.csv")
    (args.out / f"{stem}.md").write_text(report + "\n")
    plot(results, args.out / f"{stem}.png")
    summary["settings"] = json.loads(json.dumps(vars(args), default=str))
    if args.calibrate:
        summary["calibration"] = calibrate(results, args)
    (args.out / f"{stem}_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(report)
    if args.calibrate:
        calibration = summary["calibration"]
        steps = ", ".join(f"{name} from {tokens} tokens" for tokens, name in calibration["thresholds"])
        print(f"calibration for attn='auto' written to {calibration['path']}: {steps}")
    print(f"wrote {stem}.csv, {stem}.md, {stem}.png, {stem}_summary.json in {args.out}", file=sys.stderr)
    return results, summary


def main(argv: Sequence[str] | None = None) -> int:
    run(_parse(argv))
    return 0


if __name__ == "__main__":
    # Run as the imported module, so that what the workers receive refers to visattn.bench, not __main__.
    from visattn.bench import main as _main

    sys.exit(_main())
