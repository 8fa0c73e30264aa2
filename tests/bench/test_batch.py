"""visattn-bench's batch axis (sweep, CSV, table, summary, targets, calibration), the per-round ratios with
their spread, the targets check, and attn='auto' by batch size."""
from __future__ import annotations

import argparse
import json
import logging
import math

import pytest
import timm

from visattn.bench import cli, memory, sweep_cli, targets
from visattn.bench import calibrate as calibrate_module
from visattn.bench import timing as timing_module
from visattn.bench.ratios import Spread, per_round_ratios, rate_ratio, spread
from visattn.bench.sweep import Case, Result
from visattn.bench.targets import OTHER_TYPES, Target, check_targets
from visattn.models import auto
from visattn.train.attention import names_per_block
from visattn.train.cli import resolve_config
from tests.bench.test_bench import FAST, TINY_MODEL, _read_csv

# The tiny model of TINY_MODEL, as the targets check sees its rows.
TINY_SETTING = {"kind": "model", "model_kwargs": {"embed_dim": 32, "depth": 1, "num_heads": 2}, "attn_kwargs": {}}


@pytest.fixture(scope="module")
def batched(tmp_path_factory):
    """One tiny inference sweep at 32 px in batches of 1 and 3, with a target at batch 3 and one at 64 px
    (not measured), calibrated."""
    out, cache = tmp_path_factory.mktemp("bench"), tmp_path_factory.mktemp("cache")
    tiny_targets = (
        Target("linear", "infer", 32, 3, "pct_of_floor", ">=", 1),
        Target("linear", "infer", 64, 3, "pct_of_floor", ">=", 1),
    )
    argv = TINY_MODEL + FAST + ["--attn", "linear", "--sizes", "32", "--batch-size", "1", "3", "1", "--modes", "infer"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(cache))
        mp.setattr(targets, "TARGETS", tiny_targets)
        mp.setattr(targets, "TARGET_SETTING", TINY_SETTING)
        args = sweep_cli.parse_args(argv + ["--min-iters", "5", "--device", "cpu", "--calibrate", "--out", str(out)])
        results, summary = sweep_cli.run(args)
    return out, cache, results, summary


def test_batch_sizes_are_points_of_the_sweep(batched):
    out, _, results, _ = batched
    assert [(r.case.batch_size, r.case.attn) for r in results] == [(b, a) for b in (1, 3) for a in ("timm", "floor", "linear")]
    rows = _read_csv(out / "bench.csv")
    assert [(r["batch_size"], r["infer_batch_size"], r["attn"]) for r in rows] == [
        (b, b, a) for b in ("1", "3") for a in ("timm", "floor", "linear")
    ]
    for r in rows:
        assert math.isclose(float(r["infer_tokens_per_sec"]), 4 * float(r["infer_samples_per_sec"]), rel_tol=1e-3)
        assert float(r["infer_pct_of_floor_q1"]) <= float(r["infer_pct_of_floor"]) <= float(r["infer_pct_of_floor_q3"])
    for r in (r for r in rows if r["attn"] == "floor"):  # each batch against its own floor: 100% in every round
        assert (r["infer_pct_of_floor"], r["infer_pct_of_floor_q1"], r["infer_pct_of_floor_q3"]) == ("100.0",) * 3


def test_rounds_are_shared_within_a_point_only(batched):
    _, _, results, _ = batched
    by_batch = {b: {r.case.attn: r for r in results if r.case.batch_size == b} for b in (1, 3)}
    for rows in by_batch.values():
        assert len(rows["linear"].rounds) == 5
        assert set(rows["linear"].rounds) <= set(rows["floor"].rounds)
        assert set(rows["timm"].rounds) <= set(rows["floor"].rounds)
    assert not set(by_batch[1]["floor"].rounds) & set(by_batch[3]["floor"].rounds)


def test_report_and_summary_are_per_batch(batched):
    out, _, _, summary = batched
    report = (out / "bench.md").read_text()
    assert report.startswith("# visattn-bench: visattn_vit_small_patch16 vs timm vit_small_patch16_224, batch 1, 3,")
    assert "## Inference (forward), batch 1\n" in report and "## Inference (forward), batch 3\n" in report
    assert "## Scaling exponents" not in report  # one size: no exponent to fit
    assert "| attn | infer batch 1 | infer batch 3 |" in report  # the crossover, per batch
    assert set(summary["exponents"]["linear"]["infer"]) == {"1", "3"}
    assert set(summary["crossover"]["linear"]["infer"]) == {"1", "3"}
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_targets_are_checked_at_their_batch_only(batched):
    out, _, results, summary = batched
    (verdict,) = summary["targets"]
    assert verdict["target"] == "infer 32² batch 3: linear >= 1% of floor's images/s"
    assert verdict["verdict"] == "met" and verdict["rounds"] == 5 and verdict["q1"] <= verdict["value"] <= verdict["q3"]
    assert "| infer 32² batch 3: linear >= 1% of floor's images/s |" in (out / "bench.md").read_text()
    assert "1 of 1 measured targets met; decided by the spread: none." in (out / "bench.md").read_text()


def test_calibration_records_each_batch(batched, monkeypatch):
    _, cache, _, summary = batched
    assert summary["calibration"]["mode"] == "infer"
    assert summary["calibration"]["batches"] == {
        "1": {"thresholds": [[0, "linear"]], "tokens": [4, 4]}, "3": {"thresholds": [[0, "linear"]], "tokens": [4, 4]},
    }
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    entry = json.loads(auto.calibration_path().read_text())["models"]["visattn_vit_small_patch16"]
    assert (entry["mode"], entry["device"], entry["dtype"], sorted(entry["batches"])) == ("infer", "cpu", "fp32", ["1", "3"])
    assert set(entry["batches"]["3"]["seconds_per_image"]["4"]) == {"floor", "linear"}


def test_bad_batch_sizes_exit_with_a_message(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--batch-size", "4", "0", "--device", "cpu"])
    assert "--batch-size must be >= 1, got 4 0" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------
# Ratios per round: synthetic timings


def test_spread_is_the_median_and_the_inclusive_quartiles():
    assert spread([4.0, 100.0, 1.0, 3.0, 2.0]) == Spread(3.0, 2.0, 4.0, 5)
    assert spread([1.0, 2.0, 3.0, 4.0]) == Spread(2.5, 1.75, 3.25, 4)
    assert spread([7.0]) == Spread(7.0, 7.0, 7.0, 1)
    with pytest.raises(ValueError, match="at least one round"):
        spread([])
    assert Spread(3.0, 2.0, 4.0, 5).straddles(4.0) and not Spread(3.0, 2.0, 4.0, 5).straddles(4.5)


def test_per_round_ratios_pair_the_steps_of_one_round():
    own = {0: 2.0, 1: 1.0, 3: 5.0}  # round 3: the reference did not step
    reference = {0: 1.0, 1: 1.0, 2: 9.0}
    assert per_round_ratios(own, reference) == [0.5, 1.0]
    # rates: 4 images in 2 s against 1 image in 1 s
    assert per_round_ratios({0: 2.0}, {0: 1.0}, own_batch=4, reference_batch=1) == [2.0]


def _result(attn: str, times: dict[int, float], mode: str = "infer", size: int = 32, batch_size: int = 1,
            peak_bytes: int | None = None, **case_fields) -> Result:
    fields = dict(TINY_SETTING) | case_fields
    kind = fields.pop("kind")
    case = Case(kind=kind, attn=attn, mode=mode, size=(size, size), batch_size=batch_size, device="cpu", dtype="fp32",
                compile=False, **fields)
    r = Result(case, (size // 16) ** 2, (size // 16, size // 16), flops=1, estimate_bytes=0, param_count=0)
    r.rounds, r.times, r.peak_bytes = list(times), list(times.values()), peak_bytes
    return r


def test_drift_that_hits_every_row_alike_cancels_in_the_per_round_ratio():
    drift = [1.0, 1.6, 1.0, 2.5, 1.1, 0.9]  # the machine slows down and recovers
    floor = _result("floor", {k: 1.0 * d for k, d in enumerate(drift)})
    linear = _result("linear", {k: 1.25 * d for k, d in enumerate(drift)})
    assert rate_ratio(linear, floor).scaled(100) == Spread(80.0, 80.0, 80.0, 6)
    # timed in other rounds than floor's (and not linked), no ratio is formed
    assert rate_ratio(_result("linear", {10: 1.0}), floor) is None


def test_rows_of_different_memory_groups_are_linked_through_floor():
    floor = _result("floor", {0: 1.0, 1: 1.0, 2: 2.0, 3: 2.0, 4: 2.0})
    linear = _result("linear", {0: 2.0, 1: 4.0})  # group A: 50% and 25% of floor
    timm = _result("timm", {2: 4.0, 3: 4.0, 4: 8.0})  # group B: 50%, 50%, 25%
    linked = rate_ratio(linear, timm, link=floor)
    quotients = sorted(a / b for a in (0.5, 0.25) for b in (0.5, 0.5, 0.25))
    assert linked == spread(quotients, rounds=2)
    assert rate_ratio(linear, timm) is None


def test_groups_that_fit_put_floor_in_every_group():
    rows = [_result(attn, {}) for attn in ("timm", "floor", "linear", "axial", "sparse")]
    for r in rows:
        r.estimate_bytes = 100 - memory.RUNTIME_BYTES
    # room for three workers: floor and two others
    groups = memory.groups_that_fit(rows, 300, shared=[rows[1]])
    assert [[r.case.attn for r in g] for g in groups] == [["timm", "floor", "linear"], ["floor", "axial", "sparse"]]
    assert [[r.case.attn for r in g] for g in memory.groups_that_fit(rows, 300)] == [
        ["timm", "floor", "linear"], ["axial", "sparse"],
    ]
    # room for floor alone: one other row per group all the same
    assert [len(g) for g in memory.groups_that_fit(rows, 100, shared=[rows[1]])] == [2, 2, 2, 2]


def test_a_floor_that_failed_in_one_group_is_not_started_again(monkeypatch):
    rows = [_result(attn, {}) for attn in ("timm", "floor", "linear", "axial", "sparse")]
    for r in rows:
        r.estimate_bytes = 100 - memory.RUNTIME_BYTES
    measured = []

    def measure_group(group, timing, progress):
        measured.append([r.case.attn for r in group])
        for r in group:
            r.status = "oom" if r.case.attn == "floor" else r.status

    monkeypatch.setattr(timing_module, "_measure_group", measure_group)
    timing_module.measure(rows, timing=None, max_memory=10**9, capacity=300, progress=_NoProgress())
    assert measured == [["timm", "floor", "linear"], ["axial", "sparse"]]
    assert rows[1].status == "oom"


class _NoProgress:
    def update(self, n: int) -> None:
        pass


# ---------------------------------------------------------------------------------------------------
# The targets check: synthetic timings


def _point(times_by_attn: dict[str, dict[int, float]], **kwargs) -> list[Result]:
    return [_result(attn, times, **kwargs) for attn, times in times_by_attn.items()]


FIVE = range(5)


def test_a_target_is_met_by_its_median_and_flagged_when_the_spread_straddles_it():
    results = _point({
        "floor": {k: 1.0 for k in FIVE},
        "linear": dict(zip(FIVE, [1 / 0.95, 1 / 0.97, 1 / 0.91, 1 / 0.93, 1 / 0.99])),  # 91 to 99% of floor
        "axial": dict(zip(FIVE, [1 / 0.80, 1 / 0.81, 1 / 0.82, 1 / 0.83, 1 / 0.84])),
    }, batch_size=16)
    goals = (
        Target("linear", "infer", 32, 16, "pct_of_floor", ">=", 94),  # median 95, IQR 93 to 97: met by the spread
        Target("linear", "infer", 32, 16, "pct_of_floor", ">=", 96),  # missed, by the spread
        Target("axial", "infer", 32, 16, "pct_of_floor", ">=", 75),  # met clearly
        Target("axial", "infer", 32, 16, "pct_of_floor", ">=", 85),  # missed clearly
        Target("linear", "infer", 32, 1, "pct_of_floor", ">=", 1),  # batch 1: not in this run
    )
    verdicts = check_targets(results, goals, TINY_SETTING)
    assert [(v.target.threshold, v.met, v.decided_by_spread) for v in verdicts] == [
        (94, True, True), (96, False, True), (75, True, False), (85, False, False),
    ]
    assert verdicts[0].value == pytest.approx(95) and verdicts[0].spread.q1 == pytest.approx(93)
    assert not verdicts[0].too_few_rounds


def test_other_types_are_the_measured_types_without_their_own_target():
    results = _point({
        "timm": {0: 1.0}, "floor": {0: 1.0}, "linear": {0: 2.0}, "axial": {0: 1.0}, "sparse": {0: 4.0},
    })
    goals = (Target("linear", "infer", 32, 1, "pct_of_floor", ">=", 40), Target(OTHER_TYPES, "infer", 32, 1, "pct_of_floor", ">=", 50))
    verdicts = check_targets(results, goals, TINY_SETTING)
    assert [(v.attn, v.value, v.met) for v in verdicts] == [("linear", 50, True), ("axial", 100, True), ("sparse", 25, False)]
    assert all(v.too_few_rounds for v in verdicts)


def test_speed_up_and_memory_targets_and_rows_that_did_not_run():
    results = _point({"timm": {k: 3.0 for k in FIVE}, "floor": {k: 1.0 for k in FIVE}, "linear": {k: 2.0 for k in FIVE}},
                     mode="train", size=64, batch_size=4)
    results[1].peak_bytes, results[2].peak_bytes = 1000, 1300
    neighborhood = _result("neighborhood", {}, mode="train", size=64, batch_size=4)
    neighborhood.status = "oom"
    goals = (
        Target("linear", "train", 64, 4, "speedup_vs_timm", ">", 1),
        Target("linear", "train", 64, 4, "peak_mem_vs_floor", "<=", 1.25),
        Target("neighborhood", "train", 64, 4, "pct_of_floor", ">=", 80),
        Target("axial", "train", 64, 4, "pct_of_floor", ">=", 80),  # not in --attn: not judged
    )
    speedup, peak, oom = check_targets(results + [neighborhood], goals, TINY_SETTING)
    assert (speedup.value, speedup.met, speedup.spread.rounds) == (1.5, True, 5)
    assert (peak.value, peak.met, peak.spread, peak.decided_by_spread) == (1.3, False, None, False)
    assert (oom.value, oom.met, oom.why) == (None, False, "neighborhood: oom")


def test_rows_of_another_setting_are_not_judged():
    goal = (Target("linear", "infer", 32, 1, "pct_of_floor", ">=", 1),)
    results = _point({"floor": {0: 1.0}, "linear": {0: 1.0}})
    assert len(check_targets(results, goal, TINY_SETTING)) == 1
    assert check_targets(results, goal) == []  # the targets' own setting: ViT-S/16 without model_kwargs
    options = _point({"floor": {0: 1.0}}) + [_result("linear", {0: 1.0}, attn_kwargs={"dwconv_kernel": 5})]
    assert check_targets(options, goal, TINY_SETTING) == []


def test_the_targets_cover_batch_1_and_the_batched_points():
    points = {(t.mode, t.size, t.batch_size) for t in targets.TARGETS}
    assert {("infer", 2048, 1), ("train", 1024, 1), ("infer", 512, 16), ("infer", 224, 64), ("train", 512, 16),
            ("train", 1024, 4)} <= points
    assert all(t.measure in targets.MEASURES and t.op in (">=", ">", "<=") for t in targets.TARGETS)
    batched = [t for t in targets.TARGETS if (t.mode, t.size, t.batch_size) == ("infer", 512, 16)]
    assert {(t.attn, t.measure, t.threshold) for t in batched} == {
        ("linear", "pct_of_floor", 90), ("linear", "speedup_vs_timm", 1.2), ("axial", "pct_of_floor", 85),
        (OTHER_TYPES, "pct_of_floor", 75),
    }


# ---------------------------------------------------------------------------------------------------
# attn="auto" by batch size


@pytest.mark.parametrize("calibrated, batch_size, nearest", [
    ((1, 64), 16, 64), ((1, 16), 4, 1), ((1, 16, 64), 200, 64), ((4,), 1, 4), ((1, 16), 16, 16),
])
def test_nearest_batch_size_by_ratio(calibrated, batch_size, nearest):
    assert auto.nearest_batch_size(calibrated, batch_size) == nearest


def _calibrate(**batches: tuple[list[tuple[int, str]], tuple[int, int]]) -> None:
    auto.save_calibration(
        "visattn_vit_small_patch16",
        {int(b.removeprefix("b")): auto.BatchCalibration(tuple(t), tokens) for b, (t, tokens) in batches.items()},
        {"mode": "train", "device": "cpu", "dtype": "fp32"},
    )


def test_auto_chooses_with_the_nearest_calibrated_batch(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    _calibrate(b1=([(0, "softmax"), (500, "linear")], (196, 4096)), b16=([(0, "axial")], (196, 1024)))
    select = auto.select_attention
    with caplog.at_level(logging.INFO, logger="visattn.models.auto"):
        assert select("visattn_vit_small_patch16", (224, 224)) == "softmax"  # 196 tokens, batch 1
        assert select("visattn_vit_small_patch16", (512, 512)) == "linear"
        assert select("visattn_vit_small_patch16", (224, 224), batch_size=8) == "axial"  # nearer 16 than 1
    assert "from calibration" in caplog.text and "at batch 16 (asked: batch 8)" in caplog.text
    assert "WARNING" not in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="visattn.models.auto"):
        assert select("visattn_vit_small_patch16", (1024, 1024), batch_size=64) == "axial"
    warning = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warning == [
        f"attn='auto' for visattn_vit_small_patch16 extrapolates 'axial' beyond what the calibration "
        f"{auto.calibration_path()} measured: batch 64 (calibrated: batch 1, 16); 4096 patch tokens (measured at "
        "batch 16: 196 to 1024); to measure it on this machine: visattn-bench --calibrate --model "
        "visattn_vit_small_patch16 --batch-size 64 --sizes 1024"
    ]
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match=f"^batch_size must be an int >= 1, got {bad!r}$"):
            select("visattn_vit_small_patch16", (224, 224), batch_size=bad)


def test_the_built_in_defaults_say_when_they_extrapolate(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="visattn.models.auto"):
        auto.select_attention("visattn_vit_small_patch16", (512, 512), batch_size=1)
        assert caplog.text == ""
        auto.select_attention("visattn_vit_small_patch16", (512, 512), batch_size=16)
    assert "batch 16 (calibrated: batch 1)" in caplog.text and "built-in defaults" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="visattn.models.auto"):  # a patch size other than the name's
        auto.select_attention("visattn_vit_small_patch16", (32, 48), (4, 4), batch_size=16)
    assert caplog.text.rstrip().endswith(
        "to measure it on this machine: visattn-bench --calibrate --model visattn_vit_small_patch16 --batch-size 16 "
        "--sizes 32x48 --model-kwargs patch_size=4"
    )
    command = caplog.text.rstrip().split("on this machine: ")[1].split()
    args = sweep_cli.parse_args(command[1:])  # the command it gives runs as written
    assert (args.calibrate, args.batch_sizes, args.sizes, args.model_kwargs) == (True, [16], [(32, 48)], {"patch_size": 4})


def test_a_calibration_run_adds_its_batches_within_one_setting(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    _calibrate(b1=([(0, "softmax")], (196, 4096)))
    _calibrate(b16=([(0, "axial")], (196, 1024)))
    stored = json.loads(auto.calibration_path().read_text())["models"]["visattn_vit_small_patch16"]
    assert sorted(stored["batches"]) == ["1", "16"]
    auto.save_calibration("visattn_vit_small_patch16", {4: auto.BatchCalibration(((0, "linear"),), (196, 196))},
                          {"mode": "train", "device": "cpu", "dtype": "bf16"})
    stored = json.loads(auto.calibration_path().read_text())["models"]["visattn_vit_small_patch16"]
    assert sorted(stored["batches"]) == ["4"] and stored["dtype"] == "bf16"



def test_calibration_falls_back_to_inference_where_no_training_row_ran(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    args = argparse.Namespace(modes=["infer", "train"], model="visattn_vit_small_patch16", device="cpu", dtype="fp32")
    failed = _result("linear", {0: 0.5}, mode="train")
    failed.status = "oom"
    rows = [_result("softmax", {0: 1.0}), _result("linear", {0: 2.0}), failed]
    written = calibrate_module.calibrate(rows, args)
    assert written["mode"] == "infer" and written["batches"] == {"1": {"thresholds": [[0, "softmax"]], "tokens": [4, 4]}}
    with pytest.raises(ValueError, match="^no row ran: nothing to calibrate from$"):
        calibrate_module.calibrate([failed], args)

def test_a_calibration_file_of_another_version_is_ignored_then_replaced(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = auto.calibration_path()
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"version": 1, "models": {"visattn_vit_small_patch16": {"thresholds": [[0, "axial"]]}}}))
    with caplog.at_level(logging.WARNING, logger="visattn.models.auto"):
        assert auto.select_attention("visattn_vit_small_patch16", (224, 224)) == auto.DEFAULT_THRESHOLDS[0][1]
        _calibrate(b1=([(0, "axial")], (196, 4096)))
    assert "not a visattn calibration file of version 2" in caplog.text and "replacing unusable calibration" in caplog.text
    assert auto.select_attention("visattn_vit_small_patch16", (224, 224)) == "axial"


def test_models_and_training_runs_choose_for_their_batch(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    _calibrate(b1=([(0, "softmax")], (1, 4096)), b32=([(0, "axial")], (1, 4096)))
    kwargs = dict(attn="auto", img_size=32, embed_dim=32, depth=1, num_heads=2, num_classes=10)
    assert timm.create_model("visattn_vit_small_patch16", **kwargs).blocks[0].attn.name == "softmax"
    model = timm.create_model("visattn_vit_small_patch16", auto_batch_size=32, **kwargs)
    assert model.blocks[0].attn.name == "axial"
    with pytest.raises(ValueError, match="auto_batch_size applies to attn='auto' only"):
        timm.create_model("visattn_vit_small_patch16", **kwargs | {"attn": "linear"}, auto_batch_size=4)
    with pytest.raises(ValueError, match="auto_batch_size must be an int >= 1"):
        timm.create_model("visattn_vit_small_patch16", **kwargs, auto_batch_size=0)
    config, _, _ = resolve_config(["--model", "visattn_vit_small_patch16", "--attn", "auto", "--batch-size", "32"])
    assert set(names_per_block(config)) == {"axial"}
    assert config.model_kwargs_for_timm(num_classes=10)["auto_batch_size"] == 32
    config, _, _ = resolve_config(["--model", "visattn_vit_small_patch16", "--attn", "auto", "--batch-size", "2"])
    assert set(names_per_block(config)) == {"softmax"}


def _row(attn, device, dtype, seconds):
    case = Case("model", attn, "infer", (2048, 2048), 4, device, dtype, False, timm_name="vit_small_patch16_224")
    return Result(case, 16384, (128, 128), 1, 1, 1, times=[seconds] * 5, rounds=list(range(5)))


@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_gpu_targets_judge_bf16_cuda_rows_and_cpu_targets_do_not(device):
    """A bf16 row on any CUDA device is judged by the GPU targets (linear >= 5x timm at 2048 px, batch 4),
    never by the CPU ones; the same rows in fp32 on CPU are judged by neither (no CPU target at that point)."""
    rows = [_row("floor", device, "bf16", 0.9), _row("timm", device, "bf16", 6.0), _row("linear", device, "bf16", 1.0)]
    verdicts = check_targets(rows)
    linear = [v for v in verdicts if v.attn == "linear" and v.target.measure == "speedup_vs_timm"]
    assert [(v.target.threshold, v.met) for v in linear] == [(5, True)]
    assert all(v.target in targets.GPU_TARGETS for v in verdicts)
    cpu_rows = [_row(r.case.attn, "cpu", "fp32", r.times[0]) for r in rows]
    assert check_targets(cpu_rows) == []
