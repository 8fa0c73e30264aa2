"""visattn-bench max-tokens: the doubling-and-bisecting search on known predicates, the token grids, the
memory sizes, one trial under a cap in its own process, the command end to end at tiny sizes, and its
argument errors."""
from __future__ import annotations

import contextlib
import csv
import io
import math
import resource

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from visattn.bench import cli, max_tokens_cli
from visattn.bench.arguments import MAX_TOKENS, parse_memory
from visattn.bench.max_tokens import Row, Search, search_largest, square_grid
from visattn.bench.max_tokens_report import max_tokens_csv_rows, max_tokens_report
from visattn.bench.sweep import Case
from visattn.bench.trial import Trial, run_trial

MiB, GiB = 2**20, 2**30


def _threshold(limit: int, asked: list[int] | None = None):
    def fits(n: int) -> bool:
        if asked is not None:
            asked.append(n)
        return n <= limit

    return fits


# ---------------------------------------------------------------------------------------------------
# The search


def test_exact_search_doubles_then_bisects_to_the_threshold():
    asked: list[int] = []
    search = search_largest(_threshold(1000, asked), start=1, stop=10**6)
    assert (search.largest, search.smallest_failing) == (1000, 1001)
    # 1, 2, ..., 512 fit and 1024 does not (11 trials), then 512 -> 1 between the bounds (9 trials).
    assert asked[:11] == [2**k for k in range(11)]
    assert asked[11:] == [768, 896, 960, 992, 1008, 1000, 1004, 1002, 1001]
    assert search.trials == tuple((n, n <= 1000) for n in asked)
    assert not search.undecided


def test_tolerance_stops_the_bisection_early():
    asked: list[int] = []
    search = search_largest(_threshold(70_000, asked), start=256, stop=2**20, tolerance=1 / 16)
    # 256 ... 65,536 fit, 131,072 does not; bisect until the bounds are at most 65,536 / 16 apart.
    assert asked == [256 * 2**k for k in range(10)] + [98_304, 81_920, 73_728, 69_632]
    assert (search.largest, search.smallest_failing) == (69_632, 73_728)
    assert search.smallest_failing - search.largest <= search.largest / 16


def test_ceiling_first_failure_and_undecided():
    ceiling = search_largest(lambda n: True, start=3, stop=20)
    assert ceiling.trials == ((3, True), (6, True), (12, True), (20, True))
    assert (ceiling.largest, ceiling.smallest_failing) == (20, None)

    nothing = search_largest(lambda n: False, start=3, stop=20)
    assert nothing.trials == ((3, False),) and (nothing.largest, nothing.smallest_failing) == (None, 3)

    # None (the time limit) ends the search: while doubling, the last fit is a lower bound ...
    doubling = search_largest(lambda n: True if n <= 100 else None, start=1, stop=1000)
    assert doubling.trials[-1] == (128, None) and doubling.undecided
    assert (doubling.largest, doubling.smallest_failing) == (64, None)
    # ... while bisecting, the bounds found so far stay.
    bisecting = search_largest(lambda n: n <= 100 or (False if n >= 128 else None), start=1, stop=1000)
    assert bisecting.trials[-3:] == ((128, False), (96, True), (112, None))
    assert (bisecting.largest, bisecting.smallest_failing) == (96, 128) and bisecting.undecided


@settings(max_examples=100, deadline=None)
@given(start=st.integers(1, 50), span=st.integers(0, 5000), threshold=st.integers(0, 6000))
def test_search_finds_any_threshold_within_the_trial_bound(start, span, threshold):
    stop = start + span
    search = search_largest(_threshold(threshold), start, stop)
    expected = None if threshold < start else min(threshold, stop)
    assert search.largest == expected
    assert search.smallest_failing == (None if threshold >= stop else max(threshold + 1, start))
    # Doubling: start, 2 start, ... below stop, then stop; bisecting: halving a gap of at most stop.
    assert len(search.trials) <= math.ceil(math.log2(stop / start)) + 1 + math.ceil(math.log2(stop))


@pytest.mark.parametrize("start, stop, tolerance", [(0, 10, 0.0), (10, 9, 0.0), (1, 10, 1.0), (1, 10, -0.1)])
def test_search_rejects_bad_bounds(start, stop, tolerance):
    with pytest.raises(ValueError, match="start|tolerance"):
        search_largest(lambda n: True, start, stop, tolerance)


# ---------------------------------------------------------------------------------------------------
# Grids and sizes


def test_square_grids_of_the_doubling_counts():
    assert [square_grid(256 * 2**k) for k in range(7)] == [
        (16, 16), (22, 23), (32, 32), (45, 45), (64, 64), (90, 91), (128, 128)
    ]


@given(st.integers(1, 10**7))
def test_square_grid_is_the_most_square_grid_of_at_most_n_tokens(n):
    h, w = square_grid(n)
    assert h <= w <= h + 2 and n - h < h * w <= n
    assert h * w <= square_grid(n + 1)[0] * square_grid(n + 1)[1]  # more tokens asked, never fewer run


@pytest.mark.parametrize(
    "text, expected",
    [("16GiB", 16 * GiB), ("512MiB", 512 * MiB), ("4GB", 4 * 10**9), ("1.5gib", 3 * GiB // 2), ("8", 8 * GiB),
     ("100 kB", 100_000), ("2048B", 2048)],
)
def test_parse_memory(text, expected):
    assert parse_memory(text) == expected


@pytest.mark.parametrize("text", ["lots", "0GiB", "-1GiB", "8XB", "GiB", ""])
def test_parse_memory_rejects(text):
    with pytest.raises(ValueError, match="expected a positive size such as 16GiB"):
        parse_memory(text)


# ---------------------------------------------------------------------------------------------------
# One trial in its own process


def _op_case(attn: str, grid: tuple[int, int], mode: str = "infer") -> Case:
    return Case(kind="op", attn=attn, mode=mode, size=grid, batch_size=1, device="cpu", dtype="fp32", compile=False,
                num_heads=2, head_dim=8)


def test_a_trial_over_the_limit_fails_alone_and_the_parent_keeps_its_limit():
    before = resource.getrlimit(resource.RLIMIT_DATA)
    # 2 heads of 4,096 x 4,096 fp32 scores: 128 MiB per matrix, over a 64 MiB cap.
    over = run_trial(_op_case("softmax_explicit", (64, 64)), (64, 64), 64 * MiB, timeout=120)
    assert over.status == "oom" and "can't allocate memory" in over.message
    fits = run_trial(_op_case("softmax_explicit", (64, 64)), (64, 64), 1 * GiB, timeout=120)
    assert fits.status == "ok" and 2 * 128 * MiB <= fits.peak_bytes < 1 * GiB
    assert resource.getrlimit(resource.RLIMIT_DATA) == before


def test_a_trial_past_the_time_limit_is_stopped():
    trial = run_trial(_op_case("softmax", (128, 128), "train"), (128, 128), 1 * GiB, timeout=0.01)
    assert trial.status == "time" and "--trial-timeout" in trial.message and trial.seconds < 60


def test_a_trial_that_cannot_build_reports_its_error():
    case = Case(kind="op", attn="linformer", mode="infer", size=(4, 4), batch_size=1, device="cpu", dtype="fp32",
                compile=False, attn_kwargs={"k": 0}, num_heads=2, head_dim=8)
    trial = run_trial(case, (4, 4), 1 * GiB, timeout=120)
    assert trial.status == "error" and "k must be" in trial.message


# ---------------------------------------------------------------------------------------------------
# The command


def _run(argv: list[str]) -> str:
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert cli.main([MAX_TOKENS, *argv]) == 0
    return stdout.getvalue()


def _read_csv(path) -> list[dict[str, str]]:
    with path.open() as f:
        return list(csv.DictReader(f))


def test_ops_rows_from_doubling_to_the_ceiling(tmp_path):
    # 64 MiB: explicit softmax (2 heads of N x N fp32 scores and probabilities: 16 MiB at 1,024 tokens,
    # 63 MiB at 2,025) stops between the two; linear and the fused kernel run 4,096 tokens in a few MB.
    out = _run(["--ops", "--attn", "linear", "--heads", "2", "--head-dim", "8", "--modes", "infer", "--max-memory", "64MiB",
                "--min-tokens", "1024", "--max-tokens", "4096", "--tolerance", "0.25", "--device", "cpu", "--out", str(tmp_path)])
    rows = {r["attn"]: r for r in _read_csv(tmp_path / "max_tokens.csv")}
    assert list(rows) == ["softmax", "softmax_explicit", "linear"]
    assert rows["linear"]["max_tokens"] == rows["softmax"]["max_tokens"] == "4096"
    assert rows["linear"]["stopped_by"] == "ceiling" and rows["linear"]["trials"] == "3"  # 1,024, 2,048 -> 2,025, 4,096
    explicit = rows["softmax_explicit"]
    assert explicit["stopped_by"] == "oom" and 1024 <= int(explicit["max_tokens"]) < int(explicit["failed_tokens"]) <= 2025
    assert not any("seed" in column for column in explicit)
    trials = _read_csv(tmp_path / "max_tokens_trials.csv")
    assert {t["status"] for t in trials if t["attn"] == "softmax_explicit"} == {"ok", "oom"}
    assert "| `linear` | ≥ 4,096 | 64×64 |" in out and "fits at --max-tokens" in out and "seed" not in out
    assert (tmp_path / "max_tokens.md").read_text() == out


def test_model_rows_name_grid_and_image(tmp_path):
    # --references timm: floor is a row of --attn here, after timm.
    out = _run(["--attn", "linear", "floor", "--references", "timm", "--num-classes", "10", "--modes", "train",
                "--model-kwargs", "embed_dim=16", "depth=1", "num_heads=2", "patch_size=4", "--max-memory", "1GiB",
                "--min-tokens", "64", "--max-tokens", "100", "--device", "cpu", "--out", str(tmp_path)])
    rows = _read_csv(tmp_path / "max_tokens.csv")
    assert [(r["attn"], r["mode"]) for r in rows] == [("timm", "train"), ("linear", "train"), ("floor", "train")]
    for r in rows:  # 64 (8x8), then the ceiling 100 (10x10 patches of 4 px)
        assert (r["max_tokens"], r["grid"], r["img_size"], r["stopped_by"]) == ("100", "10x10", "40x40", "ceiling")
    assert "| `timm` | ≥ 100 | 10×10 (40×40 px) |" in out
    assert "visattn_vit_small_patch16 (embed_dim=16, depth=1, num_heads=2, patch_size=4)" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--max-memory", "lots"], "--max-memory: expected a positive size such as 16GiB"),
        (["--max-memory", "1000TiB"], "--max-memory 1.02e+06 GiB is more than the"),
        (["--attn", "nope"], "unknown attention(s) nope"),
        (["--min-tokens", "512", "--max-tokens", "256"], "--max-tokens must be >= --min-tokens (512), got 256"),
        (["--tolerance", "1"], "--tolerance must be in [0, 1), got 1.0"),
        (["--trial-timeout", "0"], "--trial-timeout must be > 0"),
        (["--ops", "--grad-checkpointing"], "--grad-checkpointing applies to the model's train mode"),
        (["--model-kwargs", "img_size=64"], "--model-kwargs cannot set img_size"),
        (["--attn", "linformer", "--attn-kwargs", "k=0"], "cannot build the rows at 256 tokens"),
        (["--ops", "--references", "timm"], "--references: --ops takes softmax and softmax_explicit, got timm"),
        (["--ops", "--attn", "floor", "--references"], "no rows: --attn leaves only floor"),
    ],
)
def test_argument_errors_are_one_line(capsys, argv, message):
    limit = [] if "--max-memory" in argv else ["--max-memory", "1GiB"]
    with pytest.raises(SystemExit) as exit_info:
        cli.main([MAX_TOKENS, *argv, *limit, "--device", "cpu"])
    assert exit_info.value.code == 2
    error_lines = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(error_lines) == 1 and message in error_lines[0], error_lines


ARGS = ["--num-classes", "10", "--modes", "train", "--model-kwargs", "embed_dim=16", "depth=1", "num_heads=2",
        "patch_size=4", "--max-memory", "1GiB", "--device", "cpu"]


def test_a_stopped_search_keeps_what_it_measured_and_says_where_it_stopped(tmp_path, monkeypatch):
    # A time limit ends the command during linear's second trial (SIGTERM unwinds as SystemExit): the files
    # hold timm's and floor's rows, linear's first trial and a row marked stopped, and axial as not searched.
    from visattn.bench import max_tokens as max_tokens_module

    real_trial, linear_trials = max_tokens_module.run_trial, []

    def stop_in_linear(case, *rest):
        if case.attn == "linear":
            linear_trials.append(case)
            if len(linear_trials) == 2:
                raise SystemExit(143)
        return real_trial(case, *rest)

    monkeypatch.setattr(max_tokens_module, "run_trial", stop_in_linear)
    with pytest.raises(SystemExit):
        cli.main([MAX_TOKENS, "--attn", "linear", "axial", "--references", "timm", "floor", *ARGS,
                  "--min-tokens", "64", "--max-tokens", "100", "--out", str(tmp_path)])
    rows = {r["attn"]: r for r in _read_csv(tmp_path / "max_tokens.csv")}
    assert list(rows) == ["timm", "floor", "linear"]
    assert rows["timm"]["max_tokens"] == rows["floor"]["max_tokens"] == "100"
    assert (rows["linear"]["max_tokens"], rows["linear"]["stopped_by"]) == ("64", "stopped")
    trials = [(t["attn"], t["tokens"]) for t in _read_csv(tmp_path / "max_tokens_trials.csv")]
    assert trials == [("timm", "64"), ("timm", "100"), ("floor", "64"), ("floor", "100"), ("linear", "64")]
    table = (tmp_path / "max_tokens.md").read_text()
    assert "| `linear` | ≥ 64 | 8×8 (32×32 px) |" in table and "stopped during its search, after 1 trial(s)" in table
    assert "| `axial` | not searched |" in table


def test_a_row_whose_bisection_hit_the_time_limit_reports_both_bounds():
    # timm on an H200: 262,144 tokens fitted, 524,176 ran out of memory, then 393,129 ran past the time limit:
    # the memory limit lies between 262,144 and 524,176, and the row says both.
    args = max_tokens_cli.parse_args(["--attn", "linear", "--references", "timm", *ARGS])
    status = {262_144: "ok", 524_176: "oom", 393_129: "time"}
    row = Row("timm", "train")
    for tokens, verdict in status.items():
        grid = square_grid(tokens)
        row.trials[grid] = Trial(args.plan.case("timm", "train", grid), grid, status=verdict, message=verdict)
    row.search = Search(262_144, 524_176, ((262_144, True), (524_176, False), (393_129, None)))
    record = max_tokens_csv_rows([row], args.plan)[0]
    assert (record["max_tokens"], record["failed_tokens"], record["timed_out_tokens"]) == (262_144, 524_176, 393_129)
    assert record["stopped_by"] == "time" and record["message"] == "time; oom"
    table = max_tokens_report([row], args.plan)
    assert ("| `timm` | ≥ 262,144 | 512×512 (2048×2048 px) |  | time limit at 393,129 tokens, 627×627 (2508×2508 px); "
            "out of memory at 524,176 tokens, 724×724 (2896×2896 px) |") in table
    assert "| `linear` | not searched |" in table
