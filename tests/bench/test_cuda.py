"""The benchmark on a GPU: what can be checked on CPU (flags, dtypes, the timer and the worker groups by
device, out-of-memory handling, step-by-step ratios, attn="auto" by device), and the same paths run on
CUDA in the tests marked ``cuda``, which skip without a GPU."""
from __future__ import annotations

import statistics
import time
from types import SimpleNamespace

import pytest
import torch

from visattn.bench import arguments, cli, sweep_cli, timing
from tests.bench.test_bench import _read_csv, _run
from visattn.bench.memory import start_on_device
from visattn.bench.ratios import rate_ratio
from visattn.bench.runners import build_runner
from visattn.bench.sweep import DTYPES, FLOOR, Case, Result
from visattn.bench.trial import cap_memory, run_trial
from visattn.layers import get_attention, list_attentions
from visattn.layers.cost import CostCase, TokenLayout
from visattn.models import auto

TINY_MODEL = ["--model-kwargs", "embed_dim=32", "depth=1", "num_heads=2", "--num-classes", "10"]
FAST = ["--min-iters", "1", "--min-seconds", "0", "--warmup", "0", "--settle", "0"]
GiB = 2**30


def _op_case(attn: str = "softmax", grid=(8, 8), mode: str = "infer", device: str = "cpu", dtype: str = "fp32",
             compile: bool = False) -> Case:
    return Case(kind="op", attn=attn, mode=mode, size=grid, batch_size=1, device=device, dtype=dtype, compile=compile,
                num_heads=2, head_dim=8)


def _result(attn: str, device: str, times: list[float] = (), rounds: list[int] = ()) -> Result:
    r = Result(_op_case(attn, device=device), 64, (8, 8), flops=1, estimate_bytes=100, param_count=0)
    r.times, r.rounds = list(times), list(rounds)
    return r


def _errors(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit):
        cli.main(argv)
    return capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------
# Flags and dtypes


def test_dtypes_map_to_torch_dtypes():
    assert DTYPES == {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    args = sweep_cli.parse_args(["--ops", "--dtype", "fp16", "--device", "cpu"])
    assert args.dtype == "fp16"


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_op_inputs_are_created_in_the_dtype_asked(dtype):
    runner = build_runner(_op_case(dtype=dtype))
    assert [t.dtype for t in runner.qkv] == [DTYPES[dtype]] * 3
    autocast = runner.autocast()
    assert (autocast.fast_dtype, autocast._enabled) == (DTYPES[dtype], True) if dtype != "fp32" else not autocast._enabled


def test_compile_needs_a_warmup_round(capsys):
    err = _errors(capsys, ["--compile", "--warmup", "0", "--device", "cpu"])
    assert "--compile needs --warmup >= 1" in err
    assert sweep_cli.parse_args(["--compile", "--device", "cpu"]).compile


def test_the_gpu_table_commands_parse():
    commands = [line.strip().split()[1:] for line in sweep_cli.__doc__.splitlines() if line.strip().startswith("visattn-bench --device cuda")]
    assert len(commands) == 5
    settings = []
    for argv in commands:
        args = sweep_cli.build_parser().parse_args(argv)  # the device check needs a GPU; the flags do not
        settings.append((args.modes, args.sizes, args.batch_sizes, args.dtype, args.model))
    assert settings == [
        (["infer"], [(224, 224)], [128], "bf16", "visattn_vit_small_patch16"),
        (["infer"], [(1024, 1024)], [16], "bf16", "visattn_vit_small_patch16"),
        (["infer"], [(2048, 2048)], [4], "bf16", "visattn_vit_small_patch16"),
        (["train"], [(1024, 1024)], [8], "bf16", "visattn_vit_small_patch16"),
        (["train"], [(2048, 2048)], [2], "bf16", "visattn_vit_small_patch16"),
    ]


@pytest.mark.parametrize("text, expected", [("8GiB", 8 * GiB), ("512MiB", 512 * 2**20), ("4GB", 4 * 10**9), ("2", 2 * GiB)])
def test_the_sweep_reads_max_memory_like_max_tokens(text, expected):
    assert sweep_cli.parse_args(["--max-memory", text, "--device", "cpu"]).max_memory_bytes == expected
    assert arguments.parse_memory(text) == expected


@pytest.mark.parametrize("command", [[], [arguments.MAX_TOKENS]])
def test_both_commands_reject_a_bad_memory_size_alike(capsys, command):
    err = _errors(capsys, [*command, "--max-memory", "lots", "--device", "cpu"])
    assert "--max-memory: expected a positive size such as 16GiB, 512MiB or 4GB (a bare number is GiB), got 'lots'" in err


# ---------------------------------------------------------------------------------------------------
# Timer, rest and worker groups by device


def test_the_timer_is_chosen_by_device():
    assert timing.step_timer(torch.device("cpu")) is timing.time_on_cpu
    assert timing.step_timer(torch.device("cuda")) is timing.time_with_cuda_events
    assert timing.step_timer(torch.device("cuda:1")) is timing.time_with_cuda_events
    assert 0.02 <= timing.time_on_cpu(lambda: time.sleep(0.02)) < 1.0


def test_no_rest_between_steps_on_cuda():
    assert timing.settle_on(torch.device("cpu"), 0.5) == 0.5
    assert timing.settle_on(torch.device("cuda"), 0.5) == 0.0


def test_one_worker_at_a_time_on_cuda_floor_in_every_group_on_cpu():
    cpu = [_result(a, "cpu") for a in ("softmax", FLOOR, "linear")]
    groups, shared = timing.worker_groups(cpu, capacity=10**12)
    assert groups == [cpu] and shared == [cpu[1]]
    cuda = [_result(a, "cuda") for a in ("softmax", FLOOR, "linear")]
    groups, shared = timing.worker_groups(cuda, capacity=10**12)
    assert groups == [[r] for r in cuda] and shared == []


def test_rows_that_ran_alone_on_cuda_are_compared_step_by_step():
    own, reference = _result("linear", "cuda", [1.0, 2.0], [1, 2]), _result("softmax", "cuda", [2.0, 4.0], [3, 4])
    ratio = rate_ratio(own, reference)
    quotients = [(1 / a) / (1 / b) for a in (1.0, 2.0) for b in (2.0, 4.0)]  # 2, 4, 1, 2
    q1, _, q3 = statistics.quantiles(quotients, n=4, method="inclusive")
    assert (ratio.median, ratio.q1, ratio.q3, ratio.rounds) == (2.0, q1, q3, 2)
    # On CPU rows that share no round and no floor are not compared.
    assert rate_ratio(_result("linear", "cpu", [1.0], [1]), _result("softmax", "cpu", [2.0], [2])) is None


# ---------------------------------------------------------------------------------------------------
# Out of memory


class _Conn:
    """A worker's end of the pipe: replies with ``requests`` in turn, keeps what the worker sends."""

    def __init__(self, requests: list[str]) -> None:
        self.requests, self.sent = list(requests), []

    def recv(self) -> str:
        return self.requests.pop(0)

    def send(self, message) -> None:
        self.sent.append(message)


class _OutOfMemoryRunner:
    param_count = 7

    def __init__(self, case: Case) -> None:
        self.case = case

    def step(self) -> None:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")


def test_an_out_of_memory_step_ends_its_row_as_oom(monkeypatch):
    monkeypatch.setattr(timing, "build_runner", _OutOfMemoryRunner)
    conn = _Conn(["step", "step"])
    timing._worker_main(conn, _op_case())
    assert conn.sent[0][:2] == ("ready", 7)
    assert conn.sent[1] == ("failed", "oom", "OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB")
    assert len(conn.sent) == 2 and conn.requests == ["step"]  # the worker ended; the parent goes on to the next row


def test_out_of_memory_on_cuda_empties_the_cache(monkeypatch):
    emptied = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    oom = torch.cuda.OutOfMemoryError("CUDA out of memory")
    assert timing.handle_failure(oom, torch.device("cuda")) == ("oom", "OutOfMemoryError: CUDA out of memory")
    assert emptied == [True]
    assert timing.handle_failure(oom, torch.device("cpu"))[0] == "oom" and emptied == [True]
    assert timing.handle_failure(ValueError("k must be >= 1"), torch.device("cuda")) == ("error", "ValueError: k must be >= 1")
    assert emptied == [True]


# ---------------------------------------------------------------------------------------------------
# attn="auto" by device


def _mixing_flops(grid: tuple[int, int]) -> dict[str, int]:
    flops = {}
    for name in list_attentions():
        if name == FLOOR:
            continue
        options = get_attention(name).type_options()
        if "ref_grid" in options:
            options["ref_grid"] = grid
        flops[name] = get_attention(name).mixing_flops(CostCase(TokenLayout(grid, 1), 6, 64, options))
    return flops


@pytest.mark.parametrize("grid", [(14, 14), (32, 32), (40, 40), (64, 64), (128, 128)])
def test_cuda_choice_follows_the_cost_models(grid):
    flops = _mixing_flops(grid)
    cheapest = min((n for n in flops if n != "softmax"), key=flops.get)
    expected = cheapest if auto.CUDA_EFFICIENCY_GAP * flops[cheapest] < flops["softmax"] else "softmax"
    assert auto.cuda_choice("visattn_vit_small_patch16", grid) == expected
    assert auto.cuda_choice("visattn_vit_small_patch16", grid, gap=1e9) == "softmax"
    assert auto.cuda_choice("visattn_vit_small_patch16", grid, gap=1) == min(flops, key=flops.get)


def test_auto_uses_the_cuda_rule_on_cuda_and_the_cpu_thresholds_on_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    model = "visattn_vit_small_patch16"
    # 4,096 tokens: the CPU defaults pick linformer; on CUDA softmax's N^2 loses to the cheapest type.
    assert auto.select_attention(model, (1024, 1024), device="cpu") == auto.DEFAULT_THRESHOLDS[-1][1]
    assert auto.select_attention(model, (1024, 1024), device="cuda") == auto.cuda_choice(model, (64, 64))
    assert auto.select_attention(model, (224, 224), device=torch.device("cuda:0")) == "softmax"
    assert auto.select_attention(model, (1024, 1024)) == auto.DEFAULT_THRESHOLDS[-1][1]  # default device: CPU here
    # A calibration applies on the device type it was measured on only.
    batches = {1: auto.BatchCalibration(((0, "axial"),), (1, 10**6))}
    auto.save_calibration(model, batches, {"mode": "train", "device": "cpu", "dtype": "fp32"})
    assert auto.select_attention(model, (224, 224), device="cpu") == "axial"
    assert auto.select_attention(model, (224, 224), device="cuda") == "softmax"
    auto.save_calibration(model, batches, {"mode": "train", "device": "cuda:0", "dtype": "bf16"})
    assert auto.select_attention(model, (224, 224), device="cuda") == "axial"
    assert auto.select_attention(model, (1024, 1024), device="cpu") == auto.DEFAULT_THRESHOLDS[-1][1]
    with pytest.raises(ValueError, match="device must be cpu or cuda, got 'meta'"):
        auto.select_attention(model, (224, 224), device="meta")


# ---------------------------------------------------------------------------------------------------
# On a GPU


@pytest.mark.cuda
def test_cuda_events_time_the_device():
    x = torch.randn(2048, 2048, device="cuda")

    def step() -> None:
        for _ in range(20):
            x @ x

    timing.time_with_cuda_events(step)  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    seconds = timing.time_with_cuda_events(step)
    wall = time.perf_counter() - start
    assert 0 < seconds <= wall


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_cuda_op_runner_in_half_precision_compiled(dtype):
    runner = build_runner(_op_case("linear", (16, 16), "train", device="cuda", dtype=dtype, compile=True))
    assert [t.dtype for t in runner.qkv] == [DTYPES[dtype]] * 3 and runner.qkv[0].is_cuda
    runner.step()
    runner.step()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in runner.qkv)


@pytest.mark.cuda
def test_cuda_model_sweep_bf16(tmp_path):
    out = _run(TINY_MODEL + ["--min-iters", "5", "--min-seconds", "0", "--warmup", "1", "--attn", "linear", "--sizes", "32",
                             "--batch-size", "2", "--device", "cuda", "--dtype", "bf16", "--out", str(tmp_path)])
    rows = {r["attn"]: r for r in _read_csv(tmp_path / "bench.csv")}
    assert set(rows) == {"timm", "floor", "linear"}
    for r in rows.values():
        assert r["device"] == "cuda" and r["dtype"] == "bf16"
        for mode in ("infer", "train"):
            assert r[f"{mode}_status"] == "ok" and int(r[f"{mode}_iters"]) >= 5 and float(r[f"{mode}_peak_mem_mb"]) > 0
    assert rows["linear"]["infer_speedup_vs_timm"] and rows["linear"]["train_pct_of_floor"]
    assert "| peak MB | est. MB | params (M) |" in out and "the measured peaks were 1.02 to 1.46 times it." in out


@pytest.mark.cuda
def test_cuda_out_of_memory_in_one_row_leaves_the_others(tmp_path):
    # 65,536 tokens: explicit softmax's 6 heads of N x N fp32 scores and probabilities take 192 GiB, more
    # than an H100 or H200 holds; --max-memory lets the plan run it, the GPU refuses it.
    assert 6 * 65536**2 * 4 * 2 > torch.cuda.get_device_properties(0).total_memory
    _run(["--ops", "--attn", "linear", "--heads", "6", "--grids", "256x256", "--modes", "infer", *FAST,
          "--device", "cuda", "--max-memory", "100TiB", "--out", str(tmp_path)])
    rows = {r["attn"]: r for r in _read_csv(tmp_path / "ops.csv")}
    assert rows["softmax_explicit"]["infer_status"].startswith("oom: OutOfMemoryError")
    assert rows["linear"]["infer_status"] == rows["softmax"]["infer_status"] == "ok"


@pytest.mark.cuda
def test_cuda_trial_is_capped():
    case = _op_case("softmax_explicit", (64, 64), device="cuda")
    over = run_trial(case, (64, 64), 16 * 2**20, timeout=120)
    assert over.status == "oom" and "OutOfMemoryError" in over.message
    fits = run_trial(case, (64, 64), 1 * GiB, timeout=120)
    assert fits.status == "ok" and 2 * 2 * 64**4 * 4 <= fits.peak_bytes < 1 * GiB


@pytest.mark.parametrize("device, set_to", [("cuda", None), ("cuda:1", "cuda:1"), ("cpu", None)])
def test_a_worker_starts_on_a_bare_or_indexed_cuda_device(monkeypatch, device, set_to):
    """``torch.cuda.set_device`` refuses a device without an index: a bare ``cuda`` stays on the current
    GPU, ``cuda:N`` is made current; the peak statistics are zeroed on CUDA only."""
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set", str(d))))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d: calls.append(("reset", str(d))))
    start_on_device(torch.device(device))
    expected = [] if device == "cpu" else ([("set", set_to)] if set_to else []) + [("reset", device)]
    assert calls == expected


@pytest.mark.parametrize("device, index", [("cuda", 0), ("cuda:1", 1)])
def test_a_trial_caps_memory_on_a_bare_or_indexed_cuda_device(monkeypatch, device, index):
    """``torch.cuda.set_per_process_memory_fraction`` refuses a device without an index: a bare ``cuda``
    caps the current GPU."""
    calls = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=80 * 2**30))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda fraction, i: calls.append((fraction, i)))
    cap_memory(torch.device(device), 20 * 2**30)
    assert calls == [(0.25, index)]
