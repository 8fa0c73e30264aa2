"""Times the Triton kernels of linear, axial and the local types beside the paths they replace, and writes the
launch configurations their autotuning chose.

    python scripts/time_kernels.py --out kernels_out                                 # a GPU: ViT-S/16, bf16
    TRITON_INTERPRET=1 python scripts/time_kernels.py --device cpu --out /tmp/kernels  # tiny shapes, interpreted
    python scripts/time_kernels.py --literals kernels_out/tuned_configs.json         # the tables to paste

Each op takes the qkv projection's output (B, N, 3 C) as its layer hands it over and returns (B, N, C), the
output projection's input, under autocast in the dtype as in a bf16 run: linear (elu + 1, its 3 x 3 locality
term), axial, neighborhood (7 x 7), sparse (blocks of 8, halo 3) and longformer (7 x 7, the class token global),
each with its layer's default options. On a GPU: ViT-S/16, one class token and 6 heads of 64, at 1024 px (batch
8), 2048 px (batch 4) and 224 px (batch 128). Each op on its ``triton`` path and on the path it took before
(linear: the projection split into heads, linear_attn's plain matmuls, the convolution apart; axial: SDPA; the
local types: FlexAttention), forward (under inference_mode) and forward + backward, timed by
``triton.testing.do_bench`` (the median; on the CPU the median of ``--cpu-reps`` calls by the wall clock). The first
call, which compiles and autotunes, is timed apart.

Accounting per call (B images, N = P + H W tokens, C = heads x d, e bytes per element):

- bytes moved at least: the forward reads q, k, v and writes the output, 4 B N C e; the backward also reads q, k,
  v and the output's gradient and writes the projection's gradient, 11 B N C e in all. What a path keeps beside
  (a state, log-sum-exps) and the locality term's weights are not counted;
- FLOPs: the layer's cost model (``mixing_flops``, the benchmark's count) times B, and three times that for
  forward + backward (each product has two products in its backward; recomputation is not counted).

Once both of an op's paths are timed at a shape and mode, the triton path runs beside the previous one on the
same inputs, and the RMS of their difference, relative to the previous path's, goes into the triton row
(``rel_rms_vs_previous``: of the output, of the projection's gradient): the launch configurations chosen at these
shapes compute the op.

Written into ``--out``, again after every row (a run stopped at a time limit keeps what it measured):
``kernels.csv`` (a row per op, path, shape and mode), ``kernels.md``, ``tuned_configs.json`` (every kernel's launch
configuration in use: its module's TUNED_CONFIGS entries and what this process's autotuning chose),
``tuned_configs.txt`` (the same as the Python dicts to paste into each module's TUNED_CONFIGS) and, where Triton
reports them (3.8 and later), ``autotuning.csv`` (every candidate's time, the chosen one marked).
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import triton
from triton.testing import do_bench

import visattn.ops.axial.triton as axial_triton
import visattn.ops.linear.triton as linear_triton
import visattn.ops.local.triton as local_triton
from visattn.bench.runners import forced_backends
from visattn.bench.sweep import DTYPES
from visattn.layers import attention_options, get_attention
from visattn.layers.cost import CostCase, TokenLayout
from visattn.ops import linear_attn, longformer_attn, neighborhood_attn, packed_axial_attn, sparse_attn
from visattn.ops.layout import merge_heads, split_qkv
from visattn.ops.linear.locality import add_locality
from visattn.ops.triton_support import INTERPRETED

# (HBM bytes/s, dense bf16 tensor-core FLOP/s) by torch.cuda.get_device_name(). NVIDIA's datasheets give bf16
# "with sparsity" (2:4), twice the dense rate: H100 SXM 1,979 TFLOPS and 3.35 TB/s, H100 PCIe 1,513 and 2 TB/s,
# H100 NVL 1,671 and 3.9 TB/s (https://www.nvidia.com/en-us/data-center/h100/); H200 SXM 1,979 and 4.8 TB/s, H200 NVL
# 1,671 and 4.8 TB/s (https://www.nvidia.com/en-us/data-center/h200/). The SXM5 parts' dense rate, 989.4 TFLOP/s, is
# the Hopper architecture whitepaper's (tabulated at https://glennklockwood.com/garden/processors/h100); the
# others are half their sparse figure.
DEVICE_LIMITS = {
    "NVIDIA H200": (4.8e12, 989.4e12),
    "NVIDIA H200 NVL": (4.8e12, 835.5e12),
    "NVIDIA H100 80GB HBM3": (3.35e12, 989.4e12),
    "NVIDIA H100 NVL": (3.9e12, 835.5e12),
    "NVIDIA H100 PCIe": (2.0e12, 756.5e12),
}
MODES = ("forward", "forward+backward")
TABLE_MODULES = {"linear": linear_triton, "axial": axial_triton, "local": local_triton}
CSV_COLUMNS = (
    "op", "path", "shape", "batch", "grid", "prefix", "tokens", "heads", "head_dim", "dtype", "mode", "median_ms",
    "first_call_s", "min_bytes", "flops", "gb_per_s", "tflop_per_s", "hbm_fraction", "tensor_fraction", "error",
    "rel_rms_vs_previous",
)


@dataclasses.dataclass(frozen=True)
class Shape:
    """One input: ``batch`` images of a ``grid`` of patches after ``prefix`` tokens, ``heads`` heads of ``head_dim``."""

    label: str
    batch: int
    grid: tuple[int, int]
    prefix: int = 1
    heads: int = 6
    head_dim: int = 64

    @property
    def tokens(self) -> int:
        return self.prefix + self.grid[0] * self.grid[1]

    @property
    def dim(self) -> int:
        return self.heads * self.head_dim


# ViT-S/16 (16 px patches), the training target first: autotuning keyed without the token count keeps its choice.
CUDA_SHAPES = (Shape("1024 px", 8, (64, 64)), Shape("2048 px", 4, (128, 128)), Shape("224 px", 128, (14, 14)))
# Interpreted: two tiles of the local kernels' 8 x 8 across the rows, a ragged edge on both axes; seconds in all.
CPU_SHAPES = (Shape("9x6 grid", 1, (9, 6), heads=1, head_dim=16),)


@dataclasses.dataclass(frozen=True)
class Inputs:
    """What an op reads besides the projection: its shape, its layer's options, the locality term's weights."""

    shape: Shape
    options: dict[str, Any]
    conv_weight: torch.Tensor | None = None
    conv_bias: torch.Tensor | None = None


OpCall = Callable[[torch.Tensor, Inputs], torch.Tensor]  # (B, N, 3 C) -> (B, N, C)


def linear_triton_call(qkv: torch.Tensor, inputs: Inputs) -> torch.Tensor:
    """What the linear layer's op runs after the projection on its ``triton`` path."""
    shape, options = inputs.shape, inputs.options
    return linear_triton.triton_linear_attn(
        qkv, shape.heads, options["feature_map"], conv_weight=inputs.conv_weight, conv_bias=inputs.conv_bias,
        grid=shape.grid, num_prefix_tokens=shape.prefix,
    )


def linear_split_call(qkv: torch.Tensor, inputs: Inputs) -> torch.Tensor:
    """What it runs on its ``split`` path: linear_attn on the split heads, then the locality term."""
    shape = inputs.shape
    q, k, v = split_qkv(qkv, shape.heads)
    out = merge_heads(linear_attn(q, k, v, inputs.options["feature_map"]))
    return add_locality(out, merge_heads(v), shape.grid, shape.prefix, inputs.conv_weight, inputs.conv_bias)


def axial_call(qkv: torch.Tensor, inputs: Inputs) -> torch.Tensor:
    """The axial layer's op on its projection (without q/k norms and rope)."""
    return packed_axial_attn(qkv, inputs.shape.heads, inputs.shape.grid, inputs.shape.prefix)


def neighborhood_call(qkv: torch.Tensor, inputs: Inputs) -> torch.Tensor:
    shape, options = inputs.shape, inputs.options
    out = neighborhood_attn(
        *split_qkv(qkv, shape.heads), shape.grid, options["kernel_size"], num_prefix_tokens=shape.prefix,
        tile_size=options["tile_size"],
    )
    return merge_heads(out)


def sparse_call(qkv: torch.Tensor, inputs: Inputs) -> torch.Tensor:
    shape, options = inputs.shape, inputs.options
    out = sparse_attn(
        *split_qkv(qkv, shape.heads), shape.grid, options["block_size"], options["halo"], num_prefix_tokens=shape.prefix
    )
    return merge_heads(out)


def longformer_call(qkv: torch.Tensor, inputs: Inputs) -> torch.Tensor:
    shape, o = inputs.shape, inputs.options
    out = longformer_attn(
        *split_qkv(qkv, shape.heads), shape.grid, shape.prefix, o["local"], o["kernel_size"], o["block_size"],
        o["halo"], o["tile_size"],
    )
    return merge_heads(out)


@dataclasses.dataclass(frozen=True)
class OpPath:
    """A path of an op: its name, the ops' paths forced while it runs (``force_backend``), what it calls."""

    label: str
    forced: tuple[tuple[str, str], ...]
    call: OpCall


def _local_paths(call: OpCall) -> tuple[OpPath, OpPath]:
    return OpPath("triton", (("local", "triton"),), call), OpPath("flex", (("local", "flex"),), call)


# attention type -> its triton path first, then the path it took before
OPS: dict[str, tuple[OpPath, OpPath]] = {
    "linear": (
        OpPath("triton", (("projected_linear", "triton"),), linear_triton_call),
        OpPath("split+plain", (("projected_linear", "split"), ("linear", "plain")), linear_split_call),
    ),
    "axial": (OpPath("triton", (("axial", "triton"),), axial_call), OpPath("sdpa", (("axial", "sdpa"),), axial_call)),
    "neighborhood": _local_paths(neighborhood_call),
    "sparse": _local_paths(sparse_call),
    "longformer": _local_paths(longformer_call),
}


def min_bytes(shape: Shape, mode: str, element_bytes: int) -> int:
    """The bytes a call must move at least (see the module docstring)."""
    passes = 4 if mode == "forward" else 11
    return passes * shape.batch * shape.tokens * shape.dim * element_bytes


def flops(attn: str, shape: Shape, mode: str) -> int:
    """The call's FLOPs by the layer's cost model (see the module docstring)."""
    options = attention_options(attn, {}, shape.grid)
    case = CostCase(TokenLayout(shape.grid, shape.prefix), shape.heads, shape.head_dim, options)
    per_image = get_attention(attn).mixing_flops(case)
    return shape.batch * per_image * (1 if mode == "forward" else 3)


def device_limits(device: torch.device) -> tuple[str, tuple[float, float] | None]:
    """The device's name and its (HBM bytes/s, dense bf16 FLOP/s) if :data:`DEVICE_LIMITS` knows it."""
    if device.type != "cuda":
        return "CPU (Triton interpreter)", None
    name = torch.cuda.get_device_name(device)
    return name, DEVICE_LIMITS.get(name)


def make_inputs(
    attn: str, shape: Shape, device: torch.device, dtype: torch.dtype
) -> tuple[Inputs, torch.Tensor, torch.Tensor]:
    """The op's inputs, a projection (B, N, 3 C) in ``dtype`` and an output gradient (B, N, C)."""
    options = attention_options(attn, {}, shape.grid)
    weight = bias = None
    if options.get("dwconv_kernel"):  # the locality term's parameters, fp32 as a layer's
        kernel = options["dwconv_kernel"]
        weight = torch.randn(shape.dim, 1, kernel, kernel, device=device) / kernel
        bias = torch.randn(shape.dim, device=device)
    qkv = torch.randn(shape.batch, shape.tokens, 3 * shape.dim, device=device, dtype=dtype)
    grad = torch.randn(shape.batch, shape.tokens, shape.dim, device=device, dtype=dtype)
    return Inputs(shape, options, weight, bias), qkv, grad


def time_call(
    call: Callable[[], Any], device: torch.device, grad_to_none: list[torch.Tensor], args: argparse.Namespace
) -> tuple[float, float]:
    """(seconds of the first call, median milliseconds of the later ones): ``do_bench`` on CUDA (its first call
    and the 5 calls it estimates with are not timed), the wall clock on the CPU."""
    start = time.perf_counter()
    call()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    first = time.perf_counter() - start
    if device.type == "cuda":
        median = do_bench(call, warmup=args.warmup_ms, rep=args.rep_ms, grad_to_none=grad_to_none, return_mode="median")
        return first, float(median)
    times = []
    for _ in range(args.cpu_reps):
        for t in grad_to_none:
            t.grad = None
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return first, 1000 * statistics.median(times)


def _autocast(device: torch.device, dtype: torch.dtype) -> torch.autocast:
    """Autocast to ``dtype`` as a run in it would, off for fp32."""
    return torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)


def measure_path(
    attn: str, path: OpPath, shape: Shape, mode: str, device: torch.device, args: argparse.Namespace
) -> tuple[float, float]:
    """(first call s, median ms) of ``attn`` on ``path`` at ``shape`` in ``mode``, under autocast in the dtype."""
    dtype = DTYPES[args.dtype]
    inputs, qkv, grad = make_inputs(attn, shape, device, dtype)
    autocast = _autocast(device, dtype)
    leaves = [t for t in (qkv, inputs.conv_weight, inputs.conv_bias) if t is not None]
    if mode == "forward":

        def call() -> None:
            with torch.inference_mode(), autocast:
                path.call(qkv, inputs)

        leaves = []
    else:
        for t in leaves:
            t.requires_grad_(True)

        def call() -> None:
            with autocast:
                out = path.call(qkv, inputs)
            out.backward(grad)

    with forced_backends(path.forced):
        return time_call(call, device, leaves, args)


def result_row(
    attn: str, path: OpPath, shape: Shape, mode: str, device: torch.device, args: argparse.Namespace
) -> dict[str, Any]:
    """One row of kernels.csv: the timing and its accounting, or the error that ended the call."""
    row: dict[str, Any] = {
        "op": attn, "path": path.label, "shape": shape.label, "batch": shape.batch,
        "grid": "x".join(map(str, shape.grid)), "prefix": shape.prefix, "tokens": shape.tokens, "heads": shape.heads,
        "head_dim": shape.head_dim,
        "dtype": args.dtype, "mode": mode, "min_bytes": min_bytes(shape, mode, DTYPES[args.dtype].itemsize),
        "flops": flops(attn, shape, mode),
    }
    try:
        first, median_ms = measure_path(attn, path, shape, mode, device, args)
    except Exception as err:  # a failed path is a row of the results, never the end of the run
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return row | {"error": f"{type(err).__name__}: {err}".splitlines()[0][:200]}
    bytes_per_s, flop_per_s = row["min_bytes"] / median_ms * 1e3, row["flops"] / median_ms * 1e3
    row |= {
        "median_ms": round(median_ms, 4), "first_call_s": round(first, 2), "gb_per_s": round(bytes_per_s / 1e9, 1),
        "tflop_per_s": round(flop_per_s / 1e12, 3),
    }
    _, limits = device_limits(device)
    if limits is not None:
        row |= {"hbm_fraction": round(bytes_per_s / limits[0], 3), "tensor_fraction": round(flop_per_s / limits[1], 4)}
    return row


def agreement(attn: str, shape: Shape, mode: str, device: torch.device, args: argparse.Namespace) -> str:
    """How far the triton path's result is from the previous path's on the same inputs, under autocast in the
    dtype: the RMS of the difference over the previous path's RMS, of the output (forward) or of the
    projection's gradient (forward + backward), to three significant digits; or the error that ended a call.
    It checks the launch configurations chosen on this device at these shapes, which the tests' small shapes
    need not reach: rounding in bf16 leaves about 2^-8, a wrong result order 1."""
    dtype = DTYPES[args.dtype]
    torch.manual_seed(1)
    inputs, qkv, grad = make_inputs(attn, shape, device, dtype)
    results = []
    try:
        for path in OPS[attn]:
            with forced_backends(path.forced):
                if mode == "forward":
                    with torch.inference_mode(), _autocast(device, dtype):
                        results.append(path.call(qkv, inputs).float())
                    continue
                leaf = qkv.detach().requires_grad_(True)
                with _autocast(device, dtype):
                    out = path.call(leaf, inputs)
                out.backward(grad)
                results.append(leaf.grad.float())
    except Exception as err:  # reported beside the timing, as a failed timing is
        return f"{type(err).__name__}: {err}".splitlines()[0][:80]
    new, old = results
    return f"{((new - old).square().mean().sqrt() / old.square().mean().sqrt()).item():.3g}"


# -- the launch configurations -------------------------------------------------------------------------------------
def _config_json(config: Any) -> tuple[str, Any]:
    """(type name, fields) of a table value: a dataclass or NamedTuple by field, a plain tuple as a list."""
    if dataclasses.is_dataclass(config):
        return type(config).__name__, dataclasses.asdict(config)
    if hasattr(config, "_asdict"):
        return type(config).__name__, dict(config._asdict())
    return "tuple", list(config)


def tuned_configs(device_name: str) -> dict[str, Any]:
    """Every kernel's launch configuration in use, per module: its TUNED_CONFIGS entries and what this process's
    autotuning chose (``autotuned_configs()``), as tuned_configs.json holds them."""
    tables = {}
    for module in TABLE_MODULES.values():
        chosen = {key: ("table", config) for key, config in module.TUNED_CONFIGS.items()}
        chosen |= {key: ("autotuned", config) for key, config in module.autotuned_configs().items()}
        entries = []
        for key, (source, config) in sorted(chosen.items()):
            kind, fields = _config_json(config)
            entries.append({"key": list(key), "type": kind, "config": fields, "source": source})
        tables[module.__name__] = {"annotation": module.__annotations__["TUNED_CONFIGS"], "entries": entries}
    versions = {"torch": torch.__version__, "triton": triton.__version__}
    return {"device": device_name, **versions, "tables": tables}


def _config_literal(entry: dict[str, Any], module: ModuleType) -> str:
    if entry["type"] == "tuple":
        return repr(tuple(entry["config"]))
    getattr(module, entry["type"])(**entry["config"])  # a TypeError here: the module's type has changed since
    return f"{entry['type']}({', '.join(f'{name}={value!r}' for name, value in entry['config'].items())})"


def table_literals(document: dict[str, Any]) -> str:
    """The Python text of each module's TUNED_CONFIGS from a tuned_configs.json document, to paste over the
    module's assignment."""
    blocks = []
    for name, table in document["tables"].items():
        module = sys.modules[name]
        entries = [f"    {tuple(e['key'])!r}: {_config_literal(e, module)}," for e in table["entries"]]
        body = "\n".join(["{", *entries, "}"]) if entries else "{}"
        blocks.append(f"# {name.replace('.', '/')}.py\nTUNED_CONFIGS: {table['annotation']} = {body}")
    return "\n\n".join(blocks) + "\n"


class AutotuneLog:
    """Each autotuning's candidates and their times, from Triton's ``knobs.autotuning.listener`` (Triton 3.8)."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def __call__(self, *, fn, key, best_config, configs_timings, duration, cache_hit) -> None:
        for config, timings in configs_timings.items():
            self.rows.append({
                "kernel": fn.__name__, "key": " ".join(map(str, key)), "config": str(config),
                "median_ms": timings[0], "chosen": config is best_config, "cache_hit": cache_hit,
            })


def listen_to_autotuning() -> AutotuneLog | None:
    """An :class:`AutotuneLog` that Triton reports to, where it can (3.8 and later); else None, said so."""
    knobs = getattr(triton, "knobs", None)
    if knobs is None or not hasattr(knobs.autotuning, "listener"):
        print(f"no autotuning.csv: Triton {triton.__version__} reports no candidates' times (3.8 does)", flush=True)
        return None
    knobs.autotuning.listener = log = AutotuneLog()
    return log


# -- the outputs ---------------------------------------------------------------------------------------------------
def _cell(row: dict[str, Any] | None, limits: tuple[float, float] | None) -> list[str]:
    """ms, GB/s and TFLOP/s of a row (with the fractions of the device's limits), or why it has none."""
    if row is None:
        return ["not run", "", ""]
    if row.get("error"):
        return [f"error: {row['error'][:60]} (kernels.csv)", "", ""]
    gb, tflop = f"{row['gb_per_s']:,.0f}", f"{row['tflop_per_s']:,.2f}"
    if limits is not None:
        gb, tflop = f"{gb} ({row['hbm_fraction']:.0%})", f"{tflop} ({row['tensor_fraction']:.1%})"
    return [f"{row['median_ms']:.3f}", gb, tflop]


def _speedups(rows: dict[tuple, dict[str, Any]], attn: str, shape: Shape) -> str:
    """The triton path's speed-up over the previous path, forward / forward + backward."""
    ratios = []
    for mode in MODES:
        new, old = (rows.get((attn, path.label, shape.label, mode)) for path in OPS[attn])
        ok = new and old and not new.get("error") and not old.get("error")
        ratios.append(f"{old['median_ms'] / new['median_ms']:.2f}x" if ok else "")
    return " / ".join(ratios)


def markdown(
    results: list[dict[str, Any]], shapes: Sequence[Shape], device: torch.device, args: argparse.Namespace
) -> str:
    """kernels.md: a table per shape, every op on both its paths, the triton path's speed-up."""
    name, limits = device_limits(device)
    timer = "`triton.testing.do_bench`" if device.type == "cuda" else "the wall clock"
    limits_text = (
        f"In brackets the fraction of the device's {limits[0] / 1e12:g} TB/s of HBM and {limits[1] / 1e12:g} "
        "TFLOP/s of dense bf16 (NVIDIA's figures, in scripts/time_kernels.py)." if limits
        else "No limits known for this device."
    )
    lines = [
        f"# Triton kernels beside the paths they replace: {name}, {args.dtype}", "",
        f"Median ms per call ({timer}). GB/s: the bytes a call must move at least (forward 4 B N C elements, forward + "
        f"backward 11 B N C); TFLOP/s: the layer's cost model (x 3 with the backward). {limits_text} First calls: "
        "the seconds of the first forward and the first forward + backward (compiling, autotuning). Relative RMS: of "
        "the triton path's output and projection gradient against the previous path's on the same inputs "
        "(bf16 rounding leaves about 0.004; a wrong result, order 1).", "",
    ]
    by_key = {(r["op"], r["path"], r["shape"], r["mode"]): r for r in results}
    for shape in shapes:
        lines += [
            f"## {shape.label}: batch {shape.batch}, {shape.grid[0]}x{shape.grid[1]} grid + {shape.prefix} prefix "
            f"({shape.tokens:,} tokens), {shape.heads} heads x {shape.head_dim}", "",
            "| op | path | fwd ms | fwd GB/s | fwd TFLOP/s | fwd+bwd ms | fwd+bwd GB/s | fwd+bwd TFLOP/s "
            "| first calls s | triton speed-up (fwd / fwd+bwd) | triton against it, relative RMS (out / grad) |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        for attn in args.ops:
            for i, path in enumerate(OPS[attn]):
                rows = [by_key.get((attn, path.label, shape.label, mode)) for mode in MODES]
                first = sum(r["first_call_s"] for r in rows if r and "first_call_s" in r)
                cells = [attn, path.label, *_cell(rows[0], limits), *_cell(rows[1], limits), f"{first:.1f}"]
                values = [r.get("rel_rms_vs_previous") or "" for r in rows if r]
                compared = " / ".join(values) if i == 0 and any(values) else ""
                lines.append("| " + " | ".join(cells + [_speedups(by_key, attn, shape) if i == 0 else "", compared]) + " |")
        lines.append("")
    return "\n".join(lines)


def write_outputs(
    out: Path, results: list[dict[str, Any]], shapes: Sequence[Shape], device: torch.device, args: argparse.Namespace,
    log: AutotuneLog | None,
) -> None:
    """Every file of the module docstring, from the rows so far."""
    with open(out / "kernels.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        writer.writerows(results)
    (out / "kernels.md").write_text(markdown(results, shapes, device, args))
    document = tuned_configs(device_limits(device)[0])
    (out / "tuned_configs.json").write_text(json.dumps(document, indent=1) + "\n")
    (out / "tuned_configs.txt").write_text(table_literals(document))
    if log is not None and log.rows:
        with open(out / "autotuning.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(log.rows[0]))
            writer.writeheader()
            writer.writerows(log.rows)


# -- the command ---------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu",
        help="cuda: the ViT-S/16 shapes compiled; cpu: tiny shapes under the interpreter (TRITON_INTERPRET=1)",
    )
    p.add_argument("--ops", nargs="+", choices=list(OPS), default=list(OPS), help="the ops, in this order")
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16", help="of the projection, and autocast's")
    p.add_argument("--warmup-ms", type=int, default=25, help="do_bench's warm-up (CUDA)")
    p.add_argument("--rep-ms", type=int, default=100, help="do_bench's timed milliseconds per row (CUDA)")
    p.add_argument("--cpu-reps", type=int, default=3, help="timed calls per row after the first (CPU)")
    p.add_argument("--retune", action="store_true", help="empty every TUNED_CONFIGS first: autotuning runs again")
    p.add_argument("--out", type=Path, default=Path("kernels_out"), help="output folder")
    p.add_argument("--literals", type=Path, metavar="JSON",
                   help="print the TUNED_CONFIGS dicts of a tuned_configs.json and exit (measures nothing)")
    return p


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no GPU; --device cpu runs tiny shapes interpreted")
    if args.device == "cpu" and not INTERPRETED:
        parser.error("--device cpu runs the kernels interpreted: set TRITON_INTERPRET=1 before starting the script")
    if min(args.warmup_ms, args.rep_ms, args.cpu_reps) < 1:
        parser.error("--warmup-ms, --rep-ms and --cpu-reps must be >= 1")
    return args


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every op on both its paths, in both modes, at every shape of the device; returns the rows of kernels.csv.
    The triton paths first, at every shape: a run stopped at a time limit has their times and every launch
    configuration their autotuning chose before it spends time on the paths they replace."""
    device = torch.device(args.device)
    shapes = CUDA_SHAPES if device.type == "cuda" else CPU_SHAPES
    if args.retune:
        for module in TABLE_MODULES.values():
            module.TUNED_CONFIGS.clear()
    log = listen_to_autotuning() if device.type == "cuda" else None
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    name, limits = device_limits(device)
    print(f"{name}: limits {limits or 'unknown'}; {len(shapes) * len(args.ops) * 4} rows", flush=True)
    results = []
    triton_rows = {}
    for which in (0, 1):  # the triton path, then the previous one
        for shape in shapes:
            for attn in args.ops:
                path = OPS[attn][which]
                for mode in MODES:
                    row = result_row(attn, path, shape, mode, device, args)
                    results.append(row)
                    status = row.get("error") or f"{row['median_ms']:.3f} ms, first call {row['first_call_s']} s"
                    print(f"{shape.label} {attn} {path.label} {mode}: {status}", flush=True)
                    if which == 0:
                        triton_rows[(shape.label, attn, mode)] = row
                    else:  # both paths have run here: compare them, on inputs of their own
                        compared = agreement(attn, shape, mode, device, args)
                        triton_rows[(shape.label, attn, mode)]["rel_rms_vs_previous"] = compared
                        print(f"{shape.label} {attn} {mode}: triton against {path.label}, relative RMS {compared}",
                              flush=True)
                    write_outputs(args.out, results, shapes, device, args, log)
    return results


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.literals is not None:
        print(table_literals(json.loads(args.literals.read_text())), end="")
        return
    run(args)
    print(f"wrote kernels.csv, kernels.md, tuned_configs.json, tuned_configs.txt in {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
