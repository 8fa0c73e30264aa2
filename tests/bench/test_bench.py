"""visattn-bench end to end at tiny sizes, the FLOP formulas, the exponent fit, crossovers and attn='auto'."""
from __future__ import annotations


import contextlib
import csv
import dataclasses
import io
import json
import logging
import math
import os
import re
import signal
from unittest import mock

import pytest
import timm
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import visattn
from visattn.bench import cli, memory, ratios, runners, sweep_cli, sweep_report, sweep_summary, timing
from visattn.bench.flops import ViTShape, estimate_memory, mixing_flops, train_flops, vit_flops
from visattn.bench.sweep import Case, Result, plan_model_sweep, plan_ops_sweep
from visattn.layers import ATTENTION_LAYERS, GridAttention, attention_options
from visattn.layers.cost import MixingMemory, TokenLayout
from visattn.layers.local import LocalWindowAttention
from visattn.models import auto
from visattn.ops.axial.naive import axial_masks
from visattn.ops.backends import force_backend
from visattn.ops.longformer import longformer_mask
from visattn.ops.neighborhood import neighborhood_mask
from visattn.ops.sparse import sparse_mask

from tests.helpers import load_script

TINY_MODEL = ["--model-kwargs", "embed_dim=32", "depth=1", "num_heads=2", "--num-classes", "10"]
FAST = ["--min-iters", "1", "--min-seconds", "0", "--warmup", "0", "--settle", "0"]
# Estimates at 32 and 64 px are well below 5 MB; at 1024 px the input image alone is 12 MB.
MAX_MEMORY_GB = "0.005"
LOCAL_WINDOW_TYPES = [name for name, cls in ATTENTION_LAYERS.items() if issubclass(cls, LocalWindowAttention)]
LOCAL_ENGINE_TYPES = LOCAL_WINDOW_TYPES + ["longformer"]  # the types run by visattn.ops.local.tiled_local_attn


def _run(argv: list[str]) -> str:
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert cli.main(argv) == 0
    return stdout.getvalue()


def _read_csv(path) -> list[dict[str, str]]:
    with path.open() as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """One tiny model sweep: timm, floor, linear at 32, 64 and 1024 px (1024 over --max-memory), both modes."""
    out = tmp_path_factory.mktemp("bench")
    cache = tmp_path_factory.mktemp("cache")
    argv = TINY_MODEL + FAST + ["--attn", "linear", "--sizes", "32", "64", "1024", "--max-memory", MAX_MEMORY_GB]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(cache))
        stdout = _run(argv + ["--device", "cpu", "--calibrate", "--out", str(out)])
    return out, cache, stdout


def test_sweep_csv_has_timm_columns_and_every_row(sweep):
    out, _, _ = sweep
    rows = _read_csv(out / "bench.csv")
    for mode in ("infer", "train"):
        for column in ("samples_per_sec", "step_time", "batch_size", "img_size", "gmacs", "gflops", "gflops_per_sec",
                       "pct_of_floor", "speedup_vs_timm", "peak_mem_mb", "mem_estimate_mb", "status"):
            assert f"{mode}_{column}" in rows[0], f"{mode}_{column} missing"
    assert {"attn", "model", "tokens", "grid", "param_count"} <= set(rows[0])
    assert [(r["attn"], r["infer_img_size"]) for r in rows] == [
        (attn, size) for size in ("32", "64", "1024") for attn in ("timm", "floor", "linear")
    ]
    assert [r["model"] for r in rows[:3]] == ["vit_small_patch16_224", "visattn_vit_small_patch16", "visattn_vit_small_patch16"]
    measured = [r for r in rows if r["infer_img_size"] != "1024"]
    for r in measured:
        for mode in ("infer", "train"):
            assert r[f"{mode}_status"] == "ok"
            assert float(r[f"{mode}_samples_per_sec"]) > 0
            assert math.isclose(float(r[f"{mode}_step_time"]) * float(r[f"{mode}_samples_per_sec"]), 1000, rel_tol=1e-2)
            assert float(r[f"{mode}_peak_mem_mb"]) > 0
    floor_rows = [r for r in measured if r["attn"] == "floor"]
    timm_rows = [r for r in measured if r["attn"] == "timm"]
    assert all(float(r["infer_pct_of_floor"]) == 100 for r in floor_rows)
    assert all(float(r["train_speedup_vs_timm"]) == 1 for r in timm_rows)
    # The stock timm model and the visattn model share the backbone: same parameter count.
    assert {r["param_count"] for r in rows[:3]} == {rows[0]["param_count"]}
    assert [r["tokens"] for r in rows[::3]] == ["4", "16", "4096"]


def test_sweep_skips_over_max_memory_with_its_estimate(sweep):
    out, _, stdout = sweep
    rows = [r for r in _read_csv(out / "bench.csv") if r["infer_img_size"] == "1024"]
    assert len(rows) == 3
    for r in rows:
        for mode in ("infer", "train"):
            status = re.fullmatch(r"skipped: estimated (\S+) GB > --max-memory (\S+) GB", r[f"{mode}_status"])
            assert status, r[f"{mode}_status"]
            estimate_gb = float(r[f"{mode}_mem_estimate_mb"]) / 1024
            assert float(status[1]) == pytest.approx(estimate_gb, rel=1e-2) and float(status[2]) == float(MAX_MEMORY_GB)
            assert estimate_gb > float(MAX_MEMORY_GB)
            assert r[f"{mode}_samples_per_sec"] == "" and r[f"{mode}_peak_mem_mb"] == ""
    assert "| linear | 1024 | 4096 | skipped: estimated" in stdout


def test_a_cpu_report_prints_no_memory_estimate_beside_the_peak(sweep):
    """On a CPU the peak resident set holds the runtime the estimate leaves out: no band, no est. MB column;
    the CSV keeps the estimate, which the skips are decided by."""
    out, _, stdout = sweep
    assert "| peak MB | params (M) |" in stdout and "est. MB" not in stdout
    assert all(r["infer_mem_estimate_mb"] for r in _read_csv(out / "bench.csv"))


def _cuda_point(tokens: int = 64) -> list[Result]:
    """timm, floor and linear at one CUDA point, each with three timed rounds and a peak."""
    results = []
    for attn, seconds in (("timm", 2.0), ("floor", 1.0), ("linear", 1.5)):
        case = Case(kind="model", attn=attn, mode="infer", size=(tokens, tokens), batch_size=1, device="cuda:1",
                    dtype="bf16", compile=False)
        r = Result(case, tokens, (8, 8), flops=10**9, estimate_bytes=100 * 2**20, param_count=10**6)
        r.times, r.rounds, r.build_bytes, r.peak_bytes = [seconds] * 3, [0, 1, 2], 50 * 2**20, 120 * 2**20
        results.append(r)
    return results


def test_a_cuda_report_prints_the_estimate_with_its_band():
    results = _cuda_point()
    text = sweep_report.markdown_report(results, sweep_summary.summarize(results, 3), 3)
    band = memory.estimate_band("model", "cuda")
    assert (band.low, band.high) == (1.02, 1.46)
    assert "the measured peaks were 1.02 to 1.46 times it." in text
    assert "| % floor (IQR) | x timm (IQR) | peak MB | est. MB | params (M) |" in text
    assert "| linear | 64 | 64 |" in text and "| 120 | 100 | 1 |" in text


def test_sweep_markdown_plot_and_summary(sweep):
    out, _, stdout = sweep
    assert stdout.startswith("# visattn-bench: visattn_vit_small_patch16 vs timm vit_small_patch16_224")
    for heading in ("## Inference (forward)", "## Training step", "## Scaling exponents", "## Crossover"):
        assert heading in stdout
    assert "| attn | img | tokens | images/s | tokens/s | ms/step | GFLOPs/img |" in stdout
    assert (out / "bench.md").read_text().strip() == stdout.split("calibration for")[0].strip()
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((out / "bench_summary.json").read_text())
    assert set(summary["exponents"]) == {"timm", "floor", "linear"}
    assert set(summary["crossover"]) == {"floor", "linear"}


def test_calibrate_writes_what_auto_reads(sweep, monkeypatch):
    _, cache, _ = sweep
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    entry = json.loads(auto.calibration_path().read_text())["models"]["visattn_vit_small_patch16"]
    assert entry["mode"] == "train" and list(entry["batches"]) == ["1"]
    # floor is never chosen and timm is not a visattn type; 1024 px was skipped, so 4 to 16 tokens were measured
    assert entry["batches"]["1"]["thresholds"][0] == [0, "linear"] and entry["batches"]["1"]["tokens"] == [4, 16]
    assert auto.select_attention("visattn_vit_small_patch16", (64, 64)) == "linear"


def test_ops_mode_reports_each_op_beside_the_fused_softmax(tmp_path):
    argv = ["--ops", "--grids", "16x32", "--heads", "2", "--head-dim", "8", "--attn", "linear", "sparse"]
    stdout = _run(argv + FAST + ["--modes", "infer", "--device", "cpu", "--out", str(tmp_path)])
    rows = _read_csv(tmp_path / "ops.csv")
    assert [r["attn"] for r in rows] == ["softmax", "softmax_explicit", "linear", "sparse"]
    assert all(r["tokens"] == "512" and r["infer_status"] == "ok" for r in rows)
    assert float(rows[0]["infer_gflops"]) == pytest.approx(4 * 512**2 * 16 / 1e9, rel=1e-3)
    assert "infer_speedup_vs_timm" not in rows[0] and "infer_pct_of_floor" not in rows[0]
    assert "| attn | grid | tokens | ms/step | GFLOPs | GFLOP/s | peak MB |" in stdout
    assert "| softmax | 16x32 | 512 |" in stdout
    assert not any("seed" in column for column in rows[0]) and "seed" not in stdout
    assert (tmp_path / "ops.png").exists()


class _Progress:
    def set_description(self, text: str) -> None:
        pass

    def update(self, n: int) -> None:
        pass


def test_worker_failures_are_reported_in_their_rows():
    """An out-of-memory error (a 4 TB score matrix) and an error while building end their rows only."""

    def result(attn: str, grid: tuple[int, int], attn_kwargs: dict) -> Result:
        case = Case(kind="op", attn=attn, mode="infer", size=grid, batch_size=1, device="cpu", dtype="fp32",
                          compile=False, attn_kwargs=attn_kwargs, num_heads=1, head_dim=1)
        return Result(case, grid[0] * grid[1], grid, flops=0, estimate_bytes=0, param_count=0)

    huge = result("softmax_explicit", (1000, 1000), {})
    broken = result("linformer", (2, 4), {"k": 0})
    fine = result("linear", (2, 4), {})
    timing.measure([huge, broken, fine], timing.Timing(0, 2, 0.0, 60.0), 2**40, 2**40, _Progress())
    assert huge.status == "oom" and "allocate" in huge.message
    assert broken.status == "error" and "ValueError" in broken.message and "k must be" in broken.message
    assert fine.status == "ok" and len(fine.times) == 2 and fine.peak_bytes > 0
    assert huge.step_time is None and broken.samples_per_sec is None


def test_a_terminated_sweep_writes_what_it_measured(tmp_path, monkeypatch):
    """SIGTERM (what ``timeout`` sends) during the second size: the first size's rows keep their
    measurements, the rest read "stopped", the reports are written and the exit status is 128 + 15."""
    measure = sweep_cli.measure
    calls = []

    def measure_then_terminate(group, *args):
        calls.append(group)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        measure(group, *args)

    def not_unwound(signum, frame):  # stands in for the default action, which would end pytest itself
        raise AssertionError("SIGTERM reached the handler the sweep found: it installed none of its own")

    monkeypatch.setattr(sweep_cli, "measure", measure_then_terminate)
    before = signal.signal(signal.SIGTERM, not_unwound)
    try:
        with pytest.raises(SystemExit) as stopped, contextlib.redirect_stdout(io.StringIO()):
            cli.main(TINY_MODEL + FAST + ["--attn", "linear", "--sizes", "32", "64", "--modes", "infer", "--out", str(tmp_path)])
        assert signal.getsignal(signal.SIGTERM) is not_unwound  # the sweep's handler lasted the sweep only
    finally:
        signal.signal(signal.SIGTERM, before)
    assert stopped.value.code == 128 + signal.SIGTERM
    rows = {(r["attn"], r["infer_img_size"]): r for r in _read_csv(tmp_path / "bench.csv")}
    assert len(rows) == 6
    for attn in ("timm", "floor", "linear"):
        assert rows[attn, "32"]["infer_status"] == "ok" and float(rows[attn, "32"]["infer_samples_per_sec"]) > 0
        assert rows[attn, "64"]["infer_status"].startswith("stopped: the sweep was stopped after 0 timed step(s)")
    assert "stopped" in (tmp_path / "bench.md").read_text()


def test_an_interrupted_group_kills_its_workers_mid_step(monkeypatch):
    """Ctrl-C while a worker steps: every worker of the group is ended at once, not after its step."""
    ask = timing._Worker.ask
    workers = []

    def ask_then_interrupt(self, request):
        workers.append(self)
        if request == "step":
            self.conn.send("step")  # the worker is now mid-step
            raise KeyboardInterrupt
        return ask(self, request)

    monkeypatch.setattr(timing._Worker, "ask", ask_then_interrupt)
    results = plan_model_sweep(sweep_cli.parse_args(TINY_MODEL + FAST + ["--attn", "linear", "--sizes", "32", "--modes", "infer"]))[0]
    with pytest.raises(KeyboardInterrupt):
        timing.measure(results, timing.Timing(0, 1, 0.0, 1.0, 0.0), 10**12, 10**12, mock.MagicMock())
    assert workers and all(w.process.exitcode == -signal.SIGKILL for w in workers)


def test_bad_arguments_exit_with_a_message(capsys):
    for argv in (["--attn", "nope"], ["--sizes", "0"], ["--model-kwargs", "img_size=3"], ["--attn-kwargs", "[1]"],
                 ["--sizes", "32", "--train-sizes", "64"], ["--grad-checkpointing", "--modes", "infer"], ["--settle", "-1"], ["--settle", "nan"]):
        with pytest.raises(SystemExit):
            cli.main(argv + ["--device", "cpu"])
    err = capsys.readouterr().err
    assert "unknown attention(s) nope" in err
    assert "--train-sizes must be among --sizes" in err
    assert "--grad-checkpointing applies to the model sweep's train mode" in err
    assert "--warmup, --min-seconds and --settle must be >= 0" in err


def test_grad_checkpointing_training_row(tmp_path):
    """Gradient checkpointing reaches the worker's model: its training step still runs and is labelled."""
    out = _run(["--attn", "linear", "--sizes", "32", "--modes", "train", "--grad-checkpointing", "--out", str(tmp_path)]
               + TINY_MODEL + FAST)
    assert "gradient checkpointing" in out.splitlines()[0]
    with open(tmp_path / "bench.csv") as f:
        rows = list(csv.DictReader(f))
    assert {r["attn"] for r in rows} == {"timm", "floor", "linear"}
    assert all(float(r["train_samples_per_sec"]) > 0 for r in rows)


@pytest.mark.parametrize("settle", [0.0, 1e-6, 10.0])
def test_every_step_rests_as_long_as_the_previous_one_at_most_settle(tmp_path, monkeypatch, settle):
    pauses = []
    monkeypatch.setattr(timing.time, "sleep", pauses.append)
    _run(["--attn", "linear", "--sizes", "32", "--modes", "infer", "--out", str(tmp_path)] + TINY_MODEL + FAST[:-1] + [str(settle)])
    with open(tmp_path / "bench.csv") as f:
        step_seconds = [float(r["infer_step_time"]) / 1000 for r in csv.DictReader(f)]  # timm, floor, linear
    assert pauses[0] == 0.0 and len(pauses) == 3
    for pause, previous in zip(pauses[1:], step_seconds):
        assert pause == pytest.approx(min(settle, previous), rel=1e-3, abs=1e-9)


def test_references_can_leave_timm_out(tmp_path):
    """Without the timm row there is no speed-up over timm and no crossover, but % of floor stays."""
    _run(["--attn", "linear", "--sizes", "32", "48", "--modes", "infer", "--references", "floor", "--out", str(tmp_path)]
         + TINY_MODEL + FAST)
    with open(tmp_path / "bench.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["attn"] for r in rows] == ["floor", "linear", "floor", "linear"]
    assert all(r["infer_speedup_vs_timm"] == "" and float(r["infer_pct_of_floor"]) > 0 for r in rows)
    with open(tmp_path / "bench_summary.json") as f:
        assert json.load(f)["crossover"] == {}
    report = (tmp_path / "bench.md").read_text()
    assert "## Crossover" not in report and "## Scaling exponents" in report
    assert "% floor and x timm: the median over interleaved rounds" in report


def test_rows_without_references_state_no_ratio(tmp_path):
    _run(["--attn", "linear", "--sizes", "32", "--modes", "infer", "--references", "--out", str(tmp_path)]
         + TINY_MODEL + FAST)
    with open(tmp_path / "bench.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["attn"] for r in rows] == ["linear"] and rows[0]["infer_pct_of_floor"] == ""
    assert "% floor and x timm" not in (tmp_path / "bench.md").read_text()


def test_tiled_reference_row_runs_timm_on_tiles(tmp_path):
    """The tiled row: timm's model built at the tile size, with timm's parameters, once per tile: 9 tiles of 2x2
    patches overlapping by one patch on a 4x4 grid, the head once per image."""
    stdout = _run(["--attn", "linear", "--sizes", "64", "--modes", "infer", "--references", "timm", "tiled",
                   "--tile", "32", "--tile-overlap", "16", "--out", str(tmp_path)] + TINY_MODEL + FAST)
    assert "tiled: timm vit_small_patch16_224 at 32x32 px on tiles of the image overlapping by at least 16 px" in stdout
    timm_row, tiled, _ = rows = _read_csv(tmp_path / "bench.csv")
    assert [(r["attn"], r["tokens"], r["infer_status"]) for r in rows] == [
        ("timm", "16", "ok"), ("tiled", "16", "ok"), ("linear", "16", "ok")
    ]
    assert tiled["model"] == "vit_small_patch16_224" and tiled["param_count"] == timm_row["param_count"]
    tile_model = timm.create_model("vit_small_patch16_224", img_size=32, embed_dim=32, depth=1, num_heads=2, num_classes=10)
    per_tile = vit_flops(ViTShape.from_model(tile_model), (32, 32), "softmax", {})
    head = 2 * 32 * 10  # embed_dim x num_classes
    assert float(tiled["infer_gflops"]) * 1e9 == pytest.approx(9 * (per_tile - head) + head, rel=1e-3)


def test_tiled_reference_refuses_sizes_it_cannot_cut(capsys):
    for argv in (["--sizes", "32", "--tile", "64"], ["--sizes", "64", "--tile", "32", "--tile-overlap", "8"]):
        with pytest.raises(SystemExit):
            cli.main(argv + ["--references", "tiled", "--device", "cpu"] + TINY_MODEL)
    err = capsys.readouterr().err
    assert "--references tiled: image size 32x32: image height 32 px is smaller than the tile height 64 px" in err
    assert "--references tiled: image size 64x64: overlap height must be a multiple of the patch size 16 px" in err


# ---------------------------------------------------------------------------------------------------
# FLOP formulas


def test_softmax_mixing_is_4_n2_c():
    layout = TokenLayout((7, 5), num_prefix_tokens=1)
    assert mixing_flops("softmax", layout, 3, 16, {}) == 4 * 36**2 * 48


def _tiny_model(attn: str, img: tuple[int, int], **attn_kwargs) -> torch.nn.Module:
    kwargs = dict(img_size=img, embed_dim=32, depth=2, num_heads=2, num_classes=10, reg_tokens=2)
    if attn == "timm":
        return timm.create_model("vit_small_patch16_224", **kwargs)
    return timm.create_model("visattn_vit_small_patch16", attn=attn, attn_kwargs=attn_kwargs, **kwargs)


def _counted_flops(model: torch.nn.Module, img: tuple[int, int], backward: bool) -> int:
    """FlopCounterMode on the math path of SDPA, which shows it every product (the fused CPU kernel
    hides its products from the counter)."""
    x = torch.randn(1, 3, *img)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        out = model(x)
        if backward:
            out.sum().backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("attn", visattn.list_attentions() + ["timm"])
def test_model_flops_match_flop_counter(attn):
    """The whole forward, per type; non-square grid, class token plus two register tokens."""
    img = (64, 96)
    model = _tiny_model(attn, img)
    shape = ViTShape.from_model(model)
    cost_attn = "softmax" if attn == "timm" else attn
    assert shape.num_prefix_tokens == 3 and shape.grid(img) == (4, 6)
    options = attention_options(cost_attn, {}, shape.grid(img))
    expected = vit_flops(shape, img, cost_attn, options)
    if attn in LOCAL_ENGINE_TYPES:  # the tiled path, whose masked products the formulas do not credit
        with force_backend("local", "gathered"):
            assert expected == _counted_flops(model, img, backward=False)
    else:
        assert expected == _counted_flops(model, img, backward=False)


@pytest.mark.parametrize("attn", LOCAL_WINDOW_TYPES)
def test_dense_local_path_counts_the_masked_pairs_beside_the_credited_ones(attn):
    """On a 4 x 6 grid a 7 x 7 window covers the grid, so the local ops run dense attention over all N
    tokens; the pairs its mask removes are computed but, by the counting rule, not credited: the count
    is the formula's plus 4 C per masked pair, per block."""
    img = (64, 96)
    model = _tiny_model(attn, img)
    shape = ViTShape.from_model(model)
    options = attention_options(attn, {}, shape.grid(img))
    layout = TokenLayout(shape.grid(img), shape.num_prefix_tokens)
    head_dim = shape.embed_dim // shape.num_heads
    credited = mixing_flops(attn, layout, shape.num_heads, head_dim, options)
    all_pairs = 4 * shape.embed_dim * layout.num_tokens**2
    assert credited < all_pairs
    with force_backend("local", "dense"):
        counted = _counted_flops(model, img, backward=False)
    assert counted == vit_flops(shape, img, attn, options) + shape.depth * (all_pairs - credited)


def test_linear_flops_with_rope_match_flop_counter():
    """With rope the layer splits its projection and the op turns the numerator's features: the rotated
    numerator and the unrotated normalizer are separate products (blocked on the CPU, as plain elsewhere)."""
    img = (64, 96)
    model = _tiny_model("linear", img, rope="axial")
    shape = ViTShape.from_model(model)
    options = attention_options("linear", {"rope": "axial"}, shape.grid(img))
    assert vit_flops(shape, img, "linear", options) == _counted_flops(model, img, backward=False)


def test_linformer_flops_match_flop_counter_when_projecting_the_input_first():
    """k < H W: the layer projects the tokens before the key and value projections, which then run on
    P + k tokens; the count follows."""
    img, k = (64, 96), 5
    model = _tiny_model("linformer", img, k=k)
    shape = ViTShape.from_model(model)
    options = attention_options("linformer", {"k": k}, shape.grid(img))
    with torch.no_grad():
        counted = _counted_flops(model, img, backward=False)
    assert vit_flops(shape, img, "linformer", options) == counted


@pytest.mark.parametrize("attn", ["timm", "floor"])
def test_training_flops_match_flop_counter(attn):
    """Forward + backward of models whose backward is plain autograd (no recomputation)."""
    img = (64, 96)
    model = _tiny_model(attn, img)
    shape = ViTShape.from_model(model)
    cost_attn = "softmax" if attn == "timm" else attn
    assert train_flops(shape, img, cost_attn, {}) == _counted_flops(model, img, backward=True)


@pytest.mark.parametrize("patch_size", [16, 8])
def test_conv_stem_flops_match_flop_counter_forward_and_training(patch_size):
    """Each convolution of the stem counted; the first one's input takes no gradient in training."""
    img = (64, 96)
    model = timm.create_model("visattn_vit_small_patch16", attn="floor", stem="conv", img_size=img,
                              patch_size=patch_size, embed_dim=32, depth=2, num_heads=2, num_classes=10, reg_tokens=2)
    shape = ViTShape.from_model(model)
    assert len(shape.stem) == {16: 5, 8: 4}[patch_size]
    assert vit_flops(shape, img, "floor", {}) == _counted_flops(model, img, backward=False)
    assert train_flops(shape, img, "floor", {}) == _counted_flops(model, img, backward=True)


LOCAL_CASES = [
    ("neighborhood", {"kernel_size": 3, "tile_size": 2}, (5, 7), 1),
    ("neighborhood", {"kernel_size": 9, "tile_size": 4}, (6, 4), 0),
    ("sparse", {"block_size": 2, "halo": 1}, (5, 7), 1),
    ("sparse", {"block_size": 3, "halo": 0}, (7, 4), 2),
    ("longformer", {"local": "neighborhood", "kernel_size": 3, "num_extra_global_tokens": 0}, (5, 6), 1),
    ("longformer", {"local": "sparse", "block_size": 2, "halo": 1, "num_extra_global_tokens": 0}, (5, 7), 2),
]


@pytest.mark.parametrize(
    "attn, opts, grid, p", LOCAL_CASES, ids=[f"{a}-{'-'.join(f'{k}{v}' for k, v in o.items())}-grid{g[0]}x{g[1]}-p{p}" for a, o, g, p in LOCAL_CASES]
)
def test_local_flops_count_the_pairs_of_the_op_mask(attn, opts, grid, p):
    """4 C per allowed (query, key) pair of the op's own mask definition: the keys each query may see."""
    h, d = 2, 8
    options = attention_options(attn, opts, grid)
    layout = TokenLayout(grid, p)
    if attn == "longformer":
        pairs = int(longformer_mask(grid, p, options["local"], options["kernel_size"], options["block_size"], options["halo"]).sum())
    else:
        mask = neighborhood_mask(grid, opts["kernel_size"]) if attn == "neighborhood" else sparse_mask(grid, opts["block_size"], opts["halo"])
        pairs = int(mask.sum()) + p * layout.num_tokens  # prefix rows attend to all tokens
    assert mixing_flops(attn, layout, h, d, options) == 4 * h * d * pairs


def test_axial_flops_count_the_pairs_of_both_hops():
    grid, p, h, d = (5, 7), 2, 2, 8
    same_row, same_col = axial_masks(grid, p)
    n = p + grid[0] * grid[1]
    pairs = int(same_row.sum() + same_col.sum()) - p * n  # the prefix rows attend once, not per hop
    assert mixing_flops("axial", TokenLayout(grid, p), h, d, {}) == 4 * h * d * pairs


def test_linformer_and_linear_flops_by_hand():
    layout, h, d = TokenLayout((4, 6), 1), 2, 8
    n, m, c = 25, 24, 16
    assert mixing_flops("linformer", layout, h, d, {"k": 5}) == 2 * c * (1 + 5) * n * 2 + 4 * c * n * (1 + 5)
    # the state phi(K)^T [V | 1] and phi(Q) [S | z]: (d, d + 1) products per token and head, each
    assert mixing_flops("linear", layout, h, d, {"dwconv_kernel": None}) == 2 * n * c * (d + 1) * 2
    assert mixing_flops("linear", layout, h, d, {"dwconv_kernel": 3}) == 4 * c * n * (d + 1) + 2 * m * c * 9
    assert mixing_flops("floor", layout, h, d, {}) == 0


class _UnnormalizedLinear(GridAttention):
    """A type only this file registers: out = Q (K^T V). Its cost is stated on the class, as for every type."""

    name = "unnormalized_linear_probe"
    needs_grid = False

    def mix(self, q, k, v, grid, attn_mask, is_causal):
        return q @ (k.transpose(-2, -1) @ v)  # (B, heads, N, d)

    @classmethod
    def mixing_flops(cls, case):
        # K^T V and Q (K^T V): 2 N d^2 each, per head
        return 4 * case.layout.num_tokens * case.num_heads * case.head_dim**2

    @classmethod
    def mixing_memory(cls, case):
        n, c = case.layout.num_tokens, case.num_heads * case.head_dim
        return MixingMemory(infer=n * c * case.act_bytes, train=3 * n * c * case.act_bytes)


class _Costless(GridAttention):
    name = "costless_probe"
    needs_grid = False

    def mix(self, q, k, v, grid, attn_mask, is_causal):
        return v


def test_a_new_type_needs_only_its_layer_and_a_registry_line(monkeypatch, tmp_path):
    """Registered under its name, a type is counted, planned and stepped by the benchmark from its layer class."""
    name = _UnnormalizedLinear.name
    monkeypatch.setitem(ATTENTION_LAYERS, name, _UnnormalizedLinear)
    img = (64, 96)
    model = _tiny_model(name, img)
    shape = ViTShape.from_model(model)
    options = attention_options(name, {}, shape.grid(img))
    assert vit_flops(shape, img, name, options) == _counted_flops(model, img, backward=False)

    args = sweep_cli.parse_args(["--attn", name, "--sizes", "32x48", "--device", "cpu", "--out", str(tmp_path)] + TINY_MODEL)
    (group,) = plan_model_sweep(args)
    rows = {(r.case.attn, r.case.mode): r for r in group}
    n, c, d = 1 + 2 * 3, 32, 16  # class token + 2 x 3 patches; embed_dim 32, 2 heads of 16
    for mode, backward in (("infer", 1), ("train", 3)):
        assert rows[name, mode].flops - rows["floor", mode].flops == backward * 4 * n * c * d
    assert rows[name, "train"].estimate_bytes > rows["floor", "train"].estimate_bytes

    args = sweep_cli.parse_args(["--ops", "--attn", name, "--grids", "4x6", "--heads", "2", "--head-dim", "8", "--device", "cpu"])
    (group,) = plan_ops_sweep(args)
    probe = [r for r in group if r.case.attn == name]
    assert [(r.case.mode, r.flops) for r in probe] == [("infer", 4 * 24 * 16 * 8), ("train", 3 * 4 * 24 * 16 * 8)]
    for r in probe:
        runner = runners.build_runner(r.case)
        runner.step()
        assert all(t.grad is not None for t in runner.qkv) == (r.case.mode == "train")

    monkeypatch.setitem(ATTENTION_LAYERS, _Costless.name, _Costless)
    with pytest.raises(NotImplementedError, match="_Costless states no mixing_flops"):
        vit_flops(shape, img, _Costless.name, {})


@pytest.mark.parametrize("attn", visattn.list_attentions())
def test_memory_estimate_orders(attn):
    shape = ViTShape(384, 12, 6, 1536, (16, 16), 3, 1, 1000)
    options = attention_options(attn, {}, shape.grid((512, 512)))
    params = 22_000_000

    def estimate(img, batch, training):
        return estimate_memory(shape, (img, img), attn, options, batch, training, 4, params, device="cpu")

    assert 4 * params < estimate(512, 1, False) < estimate(512, 1, True)
    assert estimate(512, 1, True) < estimate(1024, 1, True) < estimate(1024, 2, True)
    checkpointed = estimate_memory(
        shape, (1024, 1024), attn, options, 1, True, 4, params, grad_checkpointing=True, device="cpu"
    )
    assert estimate(1024, 1, False) < checkpointed < estimate(1024, 1, True)


def _stem_extra(patch_size: int, img: int, training: bool, batch: int) -> int:
    """Bytes the memory estimate adds for a conv stem over the same model with timm's patch projection."""
    model = timm.create_model("visattn_vit_tiny_patch16", attn="floor", stem="conv", img_size=img,
                              patch_size=patch_size, embed_dim=64, depth=1, num_heads=2, num_classes=10,
                              class_token=False, global_pool="avg")
    with_stem = ViTShape.from_model(model)
    without = dataclasses.replace(with_stem, stem=())
    return (estimate_memory(with_stem, (img, img), "floor", {}, batch, training, 4, 1000, device="cpu")
            - estimate_memory(without, (img, img), "floor", {}, batch, training, 4, 1000, device="cpu"))


def test_a_conv_stem_adds_what_its_norms_keep_to_the_training_estimate():
    """Patch 4, width 64, 128 px: convolutions to 32 x 64 x 64, 64 x 32 x 32, then the 1x1 to 64 x 32 x 32.
    Training keeps both stride-2 outputs and both ReLU outputs: 2 (131,072 + 65,536) elements per image."""
    assert _stem_extra(4, 128, True, 3) == 3 * 4 * 2 * (131_072 + 65_536)


def test_a_conv_stem_counts_in_inference_where_its_live_set_is_the_largest():
    """Inference holds the largest of the stem's live sets (a batch norm's input and output: 2 x 131,072 at
    128 px, patch 4) and the block's (its MLP stage, 2 N C + 2 N C_mlp = 655,360 there, width 64, MLP 256): the
    block's. At 256 px in 16 px patches the first batch norm's 2 x (8 x 128 x 128) = 262,144 elements exceed the
    block's 2 x 256 x 64 + 2 x 256 x 256 = 163,840, and the estimate grows by the difference."""
    assert _stem_extra(4, 128, False, 3) == 0
    assert _stem_extra(16, 256, False, 2) == 2 * 4 * (262_144 - 163_840)


# ---------------------------------------------------------------------------------------------------
# Exponent fit and crossover


def test_fit_exponent_recovers_the_slope_of_the_largest_sizes():
    tokens = [196, 1024, 4096, 16384, 65536]
    times = [5.0, 7.0] + [3e-6 * t**1.7 for t in tokens[2:]]  # the small sizes are off the power law
    assert sweep_summary.fit_exponent(tokens, times, points=3) == pytest.approx(1.7, abs=1e-12)
    assert sweep_summary.fit_exponent(tokens, times, points=5) < 1.6
    assert sweep_summary.fit_exponent(tokens, [None, None, 2.0, None, 0.0]) is None
    assert sweep_summary.fit_exponent([10, 20], [1.0, 4.0], points=3) == pytest.approx(2.0)


@pytest.mark.parametrize(
    "points, expected",
    [
        ([(196, False), (1024, True), (4096, True)], 1024),
        ([(196, False), (1024, False)], None),  # never beats timm
        ([(196, True), (1024, False)], None),  # beats it at the small size only
        ([(196, True), (1024, False), (4096, True)], 4096),
        ([(196, False), (1024, True), (4096, None)], 1024),  # neither ran at the largest size: ignored
    ],
)
def test_crossover_tokens(points, expected):
    assert sweep_summary.crossover_tokens(points) == expected
    assert sweep_summary.crossover_tokens(list(reversed(points))) == expected


def _timed(attn: str, tokens: int, round_seconds: list[float] | None, mode: str = "infer") -> Result:
    """A model row at ``tokens`` whose round k took ``round_seconds[k]``; None: it did not run (out of memory)."""
    case = Case(kind="model", attn=attn, mode=mode, size=(tokens, tokens), batch_size=1, device="cpu", dtype="fp32",
                compile=False)
    r = Result(case, tokens, (1, tokens), flops=1, estimate_bytes=0, param_count=0)
    if round_seconds is None:
        r.status = "oom"
    else:
        r.times, r.rounds = list(round_seconds), list(range(len(round_seconds)))
    return r


@pytest.mark.parametrize(
    "own, timm, beats",
    [
        ([1.0, 1.0, 1.0], [2.0, 2.0, 2.0], True),
        ([2.0, 2.0, 2.0], [2.0, 2.0, 2.0], False),  # a tie is not a win
        ([1.0, 1.0, 1.0], None, True),  # timm out of memory, the type ran
        (None, [2.0, 2.0, 2.0], False),  # the type out of memory
        (None, None, None),  # neither ran: ignored
    ],
)
def test_beats_reference_by_the_median_of_the_per_round_ratio(own, timm, beats):
    results = [_timed("timm", 100, timm), _timed("linear", 100, own)]
    assert sweep_summary.beats_reference(results, results[1], "timm") is beats


def test_crossover_reads_the_per_round_ratio_as_x_timm_does_not_the_median_steps():
    """Drift that slows timm's first rounds and the type's last: the median steps say the type is faster
    (1.5 s against 2.0 s), while in three rounds of five it is slower than timm beside it. The crossover
    follows the per-round ratio, the statistic of the x timm column, and both say it does not win."""
    timm = [2.0, 2.0, 2.0, 0.5, 0.5]
    own = [1.5, 1.5, 2.5, 0.6, 0.6]
    results = [_timed("timm", 100, timm), _timed("linear", 100, own)]
    assert results[1].step_time < results[0].step_time
    speedup = ratios.speedup_vs_timm(results, results[1])
    assert speedup.median == pytest.approx(0.5 / 0.6)
    summary = sweep_summary.summarize(results, 3)
    assert summary["crossover"]["linear"]["infer"]["1"] is None
    results += [_timed("timm", 400, [4.0] * 5), _timed("linear", 400, [1.0] * 5)]
    assert sweep_summary.summarize(results, 3)["crossover"]["linear"]["infer"]["1"] == 400


# ---------------------------------------------------------------------------------------------------
# attn="auto"


def test_thresholds_from_timings_switch_halfway_between_sizes():
    timings = {
        196: {"softmax": 1.0, "linear": 2.0, "floor": 0.1},
        1024: {"softmax": 3.0, "linear": 2.5, "floor": 0.2},
        4096: {"softmax": 9.0, "linear": 4.0, "sparse": 3.0},
        16384: {"softmax": 40.0, "linear": 9.0, "sparse": 8.0},
    }
    assert auto.thresholds_from_timings(timings) == [(0, "softmax"), (448, "linear"), (2048, "sparse")]
    with pytest.raises(ValueError, match="floor is never chosen"):
        auto.thresholds_from_timings({196: {"floor": 0.1}})


def _save(model: str, thresholds: dict[int, list[tuple[int, str]]], tokens: tuple[int, int] = (1, 10**6), **details) -> None:
    """A calibration of ``model`` with ``thresholds`` per batch size, measured over ``tokens``."""
    batches = {b: auto.BatchCalibration(tuple(t), tokens) for b, t in thresholds.items()}
    auto.save_calibration(model, batches, {"mode": "train", "device": "cpu", "dtype": "fp32"} | details)


def test_select_attention_defaults_without_calibration(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert auto.calibration_path() == tmp_path / "visattn" / "calibration.json"
    first, last = auto.DEFAULT_THRESHOLDS[0], auto.DEFAULT_THRESHOLDS[-1]
    with caplog.at_level(logging.INFO, logger="visattn.models.auto"):
        assert auto.select_attention("visattn_vit_small_patch16", (16, 16)) == first[1]
        assert auto.select_attention("visattn_vit_small_patch16", (4096, 4096)) == last[1]
    assert "from built-in defaults" in caplog.text and "(65536 patch tokens)" in caplog.text
    assert all(name in visattn.list_attentions() and name != "floor" for _, name in auto.DEFAULT_THRESHOLDS)
    assert [t for t, _ in auto.DEFAULT_THRESHOLDS] == sorted({t for t, _ in auto.DEFAULT_THRESHOLDS}) and first[0] == 0


def test_select_attention_uses_the_calibration(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    _save("visattn_vit_small_patch16", {1: [(0, "axial"), (600, "neighborhood")]}, mode="train")
    _save("visattn_vit_tiny_patch16", {1: [(0, "linformer")]}, mode="infer")
    with caplog.at_level(logging.INFO, logger="visattn.models.auto"):
        assert auto.select_attention("visattn_vit_small_patch16", (224, 224)) == "axial"  # 196 tokens
        assert auto.select_attention("visattn_vit_small_patch16", (512, 384)) == "neighborhood"  # 768 tokens
    assert "'neighborhood' for visattn_vit_small_patch16 at 512x384 px (768 patch tokens), from calibration" in caplog.text
    assert auto.select_attention("visattn_vit_tiny_patch16", (224, 224)) == "linformer"
    assert auto.select_attention("visattn_vit_base_patch16", (224, 224)) == auto.DEFAULT_THRESHOLDS[0][1]


def test_unusable_calibration_falls_back_to_defaults(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    _save("visattn_vit_small_patch16", {1: [(0, "no_such_type")]})
    with caplog.at_level(logging.WARNING, logger="visattn.models.auto"):
        assert auto.select_attention("visattn_vit_small_patch16", (224, 224)) == auto.DEFAULT_THRESHOLDS[0][1]
    assert "unknown attention type(s) no_such_type" in caplog.text
    auto.calibration_path().write_text("{not json")
    assert auto.select_attention("visattn_vit_small_patch16", (224, 224)) == auto.DEFAULT_THRESHOLDS[0][1]


def test_auto_model_builds_the_selected_type(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    _save("visattn_vit_small_patch16", {1: [(0, "softmax"), (10, "axial")]})
    kwargs = dict(embed_dim=32, depth=1, num_heads=2, num_classes=10)
    small = timm.create_model("visattn_vit_small_patch16", attn="auto", img_size=32, **kwargs)  # 4 tokens
    large = timm.create_model("visattn_vit_small_patch16", attn="auto", img_size=64, **kwargs)  # 16 tokens
    assert small.blocks[0].attn.name == "softmax" and large.blocks[0].attn.name == "axial"
    # the model's own patch size counts: 32 px in 4 x 4 patches is 64 tokens
    fine = timm.create_model("visattn_vit_small_patch16", attn="auto", img_size=32, patch_size=4, **kwargs)
    assert fine.blocks[0].attn.name == "axial"


def test_patch_size_of_names():
    assert auto.num_patch_tokens("visattn_vit_base_patch16", (224, 320)) == 14 * 20
    assert auto.num_patch_tokens("visattn_vit_base_patch16", (224, 320), patch_size=(8, 8)) == 28 * 40
    assert auto.patch_size_of("vit_small_patch8_224") == (8, 8)
    with pytest.raises(ValueError, match="cannot tell the patch size"):
        auto.patch_size_of("resnet50")


@pytest.mark.parametrize("whole_model, dtype", [(False, "fp32"), (True, "fp32"), (False, "bf16")])
def test_profile_block_script_reports_each_type(capsys, whole_model, dtype):
    """scripts/profile_block.py: one line of time against floor, then the top operators beside floor's, per type."""
    module = load_script("profile_block")
    argv = ["--attn", "linear", "axial", "--size", "64", "--repeats", "1", "--top", "100", "--dtype", dtype]
    assert module.main(argv + ["--whole-model"] * whole_model) == 0
    out = capsys.readouterr().out
    unit = "model" if whole_model else "block"
    assert out.startswith(f"visattn_vit_small_patch16 {'the whole model' if whole_model else 'block 0'} at 64 px, batch 1, infer, {dtype}")
    for attn in ("linear", "axial"):
        lines = r"(  \S+ +[\d.]+ ms +\d+ +[\d.]+ ms +\d+\n){2}"
        assert re.search(rf"## {attn}: [\d.]+ ms per {unit}, floor [\d.]+ ms: \d+% of floor\n  operator .+\n{lines}", out)
    # floor's linear layers, in its column: 4 per block (qkv, proj, two in the MLP); the model has 12 blocks and the head
    # (autocast dispatches each aten::linear twice: once to cast, once to run)
    floor_calls = [int(calls) for calls in re.findall(r"\n  aten::linear +[\d.]+ ms +\d+ +[\d.]+ ms +(\d+)\n", out)]
    assert floor_calls == [(4 * 12 + 1 if whole_model else 4) * (2 if dtype == "bf16" else 1)] * 2


def test_crossover_not_reached_names_the_largest_size_of_its_mode():
    def result(attn: str, mode: str, tokens: int, seconds: float) -> Result:
        case = Case(kind="model", attn=attn, mode=mode, size=(tokens, tokens), batch_size=1, device="cpu",
                          dtype="fp32", compile=False)
        r = Result(case, tokens, (1, tokens), flops=1, estimate_bytes=0, param_count=0)
        r.times = [seconds]
        return r

    results = [result(attn, "infer", n, t) for n in (100, 400) for attn, t in (("timm", 1.0), ("slow", 2.0))]
    results += [result(attn, "train", 100, t) for attn, t in (("timm", 1.0), ("slow", 2.0))]
    text = sweep_report.markdown_report(results, sweep_summary.summarize(results, 3), 3)
    assert "| slow | not up to 400 | not up to 100 |" in text
