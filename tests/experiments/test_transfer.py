"""visattn.experiments.transfer: a tiny softmax parent converted to two types, with and without attention
transfer, its table checked against what the runs recorded; reuse of finished runs; the inputs it refuses; and the
pieces of the table (a parent's stages, the summary over seeds)."""
from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

import train  # the script at the repository root, importable from there as pytest runs the tests
from visattn.experiments import execute, summarize, transfer, transfer_table
from visattn.experiments.plan import Run, expected_config, parse_rows
from visattn.experiments.summarize import FinishedRun
from visattn.train.config import config_yaml, make_config, read_yaml

from tests.helpers import TINY

ROWS = ["linear:feature_map=learned", "axial"]


def in_process(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    """train.py in this process: the runs of seconds without the start of one."""
    return subprocess.CompletedProcess(command, train.main(command[2:]))


def table_argv(folder: Path, *extra: str) -> list[str]:
    return ["--parent", str(folder / "parent"), "--attn", *ROWS, "--transfer-epochs", "1", "--finetune-epochs", "1",
            "2", "--from-scratch-root", str(folder / "scratch"), "--from-scratch-rows", "linear", "axial",
            "--run-root", str(folder / "runs"), "--output", str(folder / "table.md"), *extra]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A softmax parent, axial trained from scratch as an accuracy table would, and the transfer table's runs
    (its stdout in ``out.txt``)."""
    folder = tmp_path_factory.mktemp("transfer-table")
    assert train.main([*TINY, "--attn", "softmax", "--epochs", "3", "--lr", "0.01", "--run-dir",
                       str(folder / "parent")]) == 0
    assert train.main([*TINY, "--attn", "axial", "--run-dir", str(folder / "scratch" / "axial" / "seed0")]) == 0
    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(printed):
        patch.setattr(execute, "run_train_process", in_process)
        assert transfer.main(table_argv(folder)) == 0
    (folder / "out.txt").write_text(printed.getvalue())
    return folder


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def pct(value: float) -> str:
    return f"{100 * value:.2f}% (1)"


def test_the_table_is_what_the_runs_recorded(folder):
    parent = read_json(folder / "parent" / "summary.json")["test_acc"]
    run_dir = folder / "runs" / "transfer" / "linear+feature_map=learned" / "seed0"
    summary, history = read_json(run_dir / "summary.json"), read_lines(run_dir / "metrics.jsonl")
    (transferred,) = read_lines(run_dir / "transfer_metrics.jsonl")
    transfer_s = transferred["train_time_s"] + transferred["eval_time_s"]
    epoch_s = [record["train_time_s"] + record["eval_time_s"] for record in history]
    without_dir = folder / "runs" / "no-transfer" / "linear+feature_map=learned" / "seed0"
    without = read_lines(without_dir / "metrics.jsonl")
    without_s = [record["train_time_s"] + record["eval_time_s"] for record in without]
    label = "linear (feature_map=learned)"

    def line(stage: str, acc: float, images: int, seconds: float) -> str:
        return (f"| {label} | {stage} | {pct(acc)} | {100 * (acc - parent):+.2f} | {images:,} | {seconds:,.1f} | "
                "1 of 1 finished |")

    text = (folder / "table.md").read_text()
    expected = [
        line("converted, no training", summary["initial_test_acc"], 0, 0.0),
        line("attention transfer, 1 epoch", summary["transfer_test_acc"], 96, transfer_s),
        line("transfer + fine-tune epoch 1 of 2", history[0]["test_acc"], 192, transfer_s + epoch_s[0]),
        line("transfer + fine-tune epoch 2 of 2", history[1]["test_acc"], 288, transfer_s + sum(epoch_s)),
        line("fine-tune without transfer, epoch 1 of 2", without[0]["test_acc"], 96, without_s[0]),
        line("fine-tune without transfer, epoch 2 of 2", without[1]["test_acc"], 192, sum(without_s)),
    ]
    assert [row for row in text.splitlines() if row.startswith(f"| {label} |")][:6] == expected
    parent_records = read_lines(folder / "parent" / "metrics.jsonl")
    parent_s = sum(record["train_time_s"] + record["eval_time_s"] for record in parent_records)
    assert text.splitlines()[2] == (f"| parent (softmax) | trained: 3 epochs at 16×16 px | {pct(parent)} | — | 288 | "
                                    f"{parent_s:,.1f} | 1 finished |")
    assert "Epoch k of 2 is epoch k of one 2-epoch schedule, not a k-epoch fine-tune of its own" in text
    assert text.count("`python -m visattn.experiments.transfer --parent ") == 1


def test_both_arms_start_from_the_same_converted_model_and_differ_only_in_the_transfer(folder):
    for row in ("linear+feature_map=learned", "axial"):
        runs = [folder / "runs" / arm / row / "seed0" for arm in ("transfer", "no-transfer")]
        with_transfer, without = (read_json(run / "summary.json") for run in runs)
        assert with_transfer["initial_test_acc"] == without["initial_test_acc"]
        configs = [make_config(yaml.safe_load((run / "config.yaml").read_text())) for run in runs]
        assert [config.transfer_epochs for config in configs] == [1, 0]
        for config in configs:
            assert (config.initial_checkpoint, config.epochs, config.test_every_epoch, config.seed) == (
                str(folder / "parent"), 2, True, 0)
        assert not (runs[1] / "transfer_metrics.jsonl").exists() and "transfer_test_acc" not in without


def test_a_type_with_nothing_to_learn_transfers_its_projections_and_says_so(folder):
    configs = {row: make_config(yaml.safe_load((folder / "runs" / "transfer" / row / "seed0" / "config.yaml").read_text()))
               for row in ("linear+feature_map=learned", "axial")}
    assert (configs["linear+feature_map=learned"].transfer_projections, configs["axial"].transfer_projections) == (False, True)
    out = (folder / "out.txt").read_text()
    assert "axial: adds no parameters to the parent's qkv, proj and norms: its transfer trains those" in out
    assert "linear:feature_map=learned: adds" not in out
    assert "axial (--transfer-projections) seed 0: started" in out
    text = (folder / "table.md").read_text()
    assert "| axial | attention transfer, 1 epoch (qkv, proj and norms too) |" in text
    assert "| linear (feature_map=learned) | attention transfer, 1 epoch |" in text


def test_with_low_rank_adapters_every_type_transfers_through_them(folder, tmp_path):
    args, train_args = transfer.parse_args(["--parent", str(folder / "parent"), "--attn", *ROWS, "--run-root",
                                            str(tmp_path / "runs"), "--", "--lora-rank", "2"])
    table, runs = transfer.plan_table(args, train_args)
    assert [row.train_flags for row in table.rows] == [(), ()]  # axial too: no --transfer-projections
    assert {expected_config(run.argv).lora_rank for run in runs} == {2}
    words = transfer_table.note(table, "cmd", [])
    assert "Low-rank adapters (lora_rank 2) on every qkv and proj: the transfer trains them too" in words
    assert "fine-tuning with low-rank adapters (below) with the parent's recipe" in words
    assert "the whole model" not in words


def test_the_runs_from_scratch_are_read_from_their_run_root(folder):
    scratch = folder / "scratch" / "axial" / "seed0"
    acc = read_json(scratch / "summary.json")["test_acc"]
    parent = read_json(folder / "parent" / "summary.json")["test_acc"]
    (record,) = read_lines(scratch / "metrics.jsonl")
    text = (folder / "table.md").read_text()
    assert (f"| axial | from scratch: axial, its recipe | {pct(acc)} | {100 * (acc - parent):+.2f} | 96 | "
            f"{record['train_time_s'] + record['eval_time_s']:,.1f} | 1 of 1 in `{folder / 'scratch' / 'axial'}` |") in text
    assert (f"| linear (feature_map=learned) | from scratch: linear, its recipe | — | — | — | — | 0 of 1 in "
            f"`{folder / 'scratch' / 'linear'}` |") in text


def test_every_stage_of_every_run_is_in_the_json_and_the_csv(folder):
    saved = read_json(folder / "table.json")
    with open(folder / "table.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert [(row["arm"], row["row"], row["stage"]) for row in rows] == [
        ("parent", "softmax", "trained"),
        *((arm, row, stage) for arm, stages in (("transfer", ("converted", "transfer", "epoch 1", "epoch 2")),
                                                ("no-transfer", ("converted", "epoch 1", "epoch 2")))
          for row in ROWS for stage in stages),
        ("from-scratch", "axial", "trained"),
    ]
    assert [(row["stage"], float(row["test_acc"]), int(row["images"])) for row in rows] == [
        (record["stage"], record["test_acc"], record["images"]) for record in saved["stages"]]
    parent = read_json(folder / "parent" / "summary.json")["test_acc"]
    assert {float(row["parent_test_acc"]) for row in rows} == {parent}
    axial = folder / "runs" / "transfer" / "axial" / "seed0"
    run = next(run for run in saved["runs"] if run["arm"] == "transfer" and run["row"] == "axial")
    assert run["history"] == read_lines(axial / "metrics.jsonl")
    assert run["transfer_history"] == read_lines(axial / "transfer_metrics.jsonl")
    assert [line["stage"] for line in saved["lines"][:3]] == [
        "trained: 3 epochs at 16×16 px", "converted, no training", "attention transfer, 1 epoch"]


def test_finished_runs_are_reused_not_retrained(folder, monkeypatch, capsys):
    before = (folder / "table.md").read_text()
    monkeypatch.setattr(execute, "run_train_process", lambda *a, **k: pytest.fail(f"trained again: {a}"))
    assert transfer.main(table_argv(folder)) == 0
    assert "4 runs: 4 finished before, 0 to train (0 resumed)" in capsys.readouterr().out
    assert (folder / "table.md").read_text() == before


def planned_runs(folder: Path, parent: str) -> list:
    args, train_args = transfer.parse_args(table_argv(folder)[2:] + ["--parent", parent])
    return transfer.plan_table(args, train_args)[1]


def test_a_parent_is_the_same_however_its_path_is_spelled(folder, monkeypatch):
    monkeypatch.chdir(folder / "runs")
    for parent in (str(folder / "parent"), "../parent", str(folder / "runs" / ".." / "parent")):
        runs = planned_runs(folder, parent)
        assert [execute.choose_action(run, retrain=False) for run in runs] == [
            ("reuse", "finished with this config")] * 4, parent


def test_runs_started_before_their_parent_was_retrained_in_place_are_trained_afresh(folder):
    runs = planned_runs(folder, str(folder / "parent"))
    summary = folder / "parent" / "summary.json"
    before = summary.stat()
    later = max((run.run_dir / "config.yaml").stat().st_mtime for run in runs) + 10
    os.utime(summary, (later, later))  # the parent trained again, as accuracy --retrain leaves it
    try:
        actions = [execute.choose_action(run, retrain=False) for run in runs]
    finally:
        os.utime(summary, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert actions == [("train", f"the run it starts from ({folder / 'parent'}) finished again after it started")] * 4


# -- what it refuses ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "argv, message",
    [
        (["--parent", "p", "--attn", "timm"], "--attn: timm (timm's own Attention) is no conversion target; accepted: softmax"),
        (["--parent", "p", "--attn", "nope"], "--attn: unknown attention 'nope' in row 'nope'; valid: timm, softmax"),
        (["--parent", "p", "--finetune-epochs", "0", "2"], "--finetune-epochs: epochs >= 1, got 0 2"),
        (["--parent", "p", "--finetune-epochs", "2", "2"], "--finetune-epochs: each value once, got 2 2"),
        (["--parent", "p", "--transfer-epochs", "0"], "--transfer-epochs: must be >= 1 (the arm without transfer is"),
        (["--parent", "p", "q", "--seeds", "0", "1", "2"], "--parent: 2 runs for 3 seeds; accepted: one parent for every seed"),
        (["--parent", "p", "--attn", "axial", "--from-scratch-rows", "axial"], "--from-scratch-rows: give --from-scratch-root"),
        (["--parent", "p", "--attn", "axial", "sparse", "--from-scratch-root", "r", "--from-scratch-rows", "axial"],
         "--from-scratch-rows: 1 rows for 2 --attn rows; accepted: one per --attn row, in order"),
        (["--parent", "p", "--attn", "axial", "--from-scratch-root", "r", "--from-scratch-rows", "sparse"],
         "--from-scratch-rows: 'sparse' for row 'axial' is another type; accepted: a row of type axial"),
        (["--parent", "p", "--attn", "axial", "--from-scratch-root", "r", "--from-scratch-rows", "axial,sparse"],
         "--from-scratch-rows: 'axial,sparse' is 2 rows; accepted: one row per word"),
        (["--parent", "p", "--", "--epochs", "3", "--initial-checkpoint", "x"],
         "after --: --epochs, --initial-checkpoint set by the table for each run"),
        (["--parent", "p", "--", "--no-test-every-epoch"], "after --: --no-test-every-epoch set by the table"),
        (["--parent", "p", "--", "--lr-x", "3"], "after --: not train.py flags: --lr-x 3"),
        (["--parent", "p", "--output", "table.txt"], "--output: a markdown file name ending in .md, got 'table.txt'"),
        (["--parent", "p", "--jobs", "0"], "--jobs: at least 1 process at a time, got 0"),
    ],
)
def test_bad_flags_are_refused_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit):
        transfer.parse_args(argv)
    error = capsys.readouterr().err.splitlines()[-1]
    assert message in error and error.startswith("python -m visattn.experiments.transfer: error:")


def test_one_parent_serves_every_seed_or_each_seed_has_its_own():
    args, _ = transfer.parse_args(["--parent", "p", "--seeds", "3", "4"])
    assert args.parents == {3: Path("p"), 4: Path("p")}
    args, _ = transfer.parse_args(["--parent", "p", "q", "--seeds", "3", "4"])
    assert args.parents == {3: Path("p"), 4: Path("q")}
    assert (args.transfer_epochs, args.finetune_epochs) == (2, [1, 2, 4])
    assert [row.text for row in args.rows] == transfer.DEFAULT_ROWS == [
        "linear:feature_map=learned,dwconv_kernel=null", "linear:feature_map=learned", "axial", "neighborhood", "sparse"]


def edited_copy(source: Path, target: Path, **values) -> Path:
    """A copy of the finished run ``source`` whose config.yaml says ``values``."""
    shutil.copytree(source, target)
    config = yaml.safe_load((target / "config.yaml").read_text())
    (target / "config.yaml").write_text(yaml.safe_dump({**config, **values}, sort_keys=False))
    return target


def test_bad_parents_and_runs_from_scratch_stop_before_any_run(folder, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(execute, "run_train_process", lambda *a, **k: pytest.fail(f"trained: {a}"))
    other_lr = edited_copy(folder / "parent", tmp_path / "other-lr", lr=0.5)
    wider = edited_copy(folder / "scratch" / "axial" / "seed0", tmp_path / "scratch" / "axial" / "seed0", img_size=32)
    (tmp_path / "empty").mkdir()
    common = ["--attn", "axial", "--run-root", str(tmp_path / "runs"), "--output", str(tmp_path / "t.md")]
    cases = [
        (["--parent", str(tmp_path / "empty"), *common],
         f"error: --parent: {tmp_path / 'empty' / 'config.yaml'} does not exist: not a finished training run"),
        (["--parent", str(folder / "scratch" / "axial" / "seed0"), *common],
         f"error: --parent: {folder / 'scratch' / 'axial' / 'seed0'} was trained with attn 'axial'; accepted: a run of "
         "softmax or timm attention"),
        (["--parent", str(folder / "parent"), str(other_lr), "--seeds", "0", "1", *common],
         f"error: --parent: {folder / 'parent'} and {other_lr} differ in lr: 0.01 -> 0.5; accepted: parents of one "
         "recipe, but for their seeds"),
        (["--parent", str(folder / "parent"), "--from-scratch-root", str(tmp_path / "nowhere"), *common],
         f"error: --from-scratch-root: {tmp_path / 'nowhere'} does not exist; accepted: an accuracy table's run root"),
        (["--parent", str(folder / "parent"), "--from-scratch-root", str(tmp_path / "scratch"), *common],
         f"error: --from-scratch-root: {wider} differs in image_hw (32, 32) (the table's runs: (16, 16)); accepted: "
         "runs of the same task and model (but for its attention) at the same size"),
        (["--parent", str(folder / "parent"), "--attn", "linear:dwconv_kernel=2", *common[2:]],
         "error: attn 'linear' with options {'dwconv_kernel': 2}: cannot build its model: linear: dwconv_kernel must be"),
    ]
    for argv, message in cases:
        assert transfer.main(argv) == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert line.startswith(message), line
    assert not (tmp_path / "runs").exists()


def test_a_parent_without_its_weights_is_refused_before_any_run_unless_none_is_to_train(folder, tmp_path, monkeypatch,
                                                                                          capsys):
    monkeypatch.setattr(execute, "run_train_process", lambda *a, **k: pytest.fail(f"trained: {a}"))
    parent = shutil.copytree(folder / "parent", tmp_path / "parent", ignore=shutil.ignore_patterns("*.safetensors"))
    common = ["--parent", str(parent), "--attn", *ROWS, "--transfer-epochs", "1", "--finetune-epochs", "1", "2",
              "--output", str(tmp_path / "t.md")]
    assert transfer.main([*common, "--run-root", str(tmp_path / "runs")]) == 2
    assert capsys.readouterr().err == (
        f"error: --parent: {parent} has no model_best.safetensors (a run copied without its weights?), which its "
        "seed's runs start from; accepted: a finished run with its best weights\n")
    assert not (tmp_path / "runs").exists()
    assert transfer.main([*common, "--run-root", str(tmp_path / "runs"), "--tables-only"]) == 1  # none finished


@pytest.mark.parametrize("values, differs", [
    (dict(model="visattn_vit_small_patch16"), "model 'visattn_vit_small_patch16' (the table's runs: 'visattn_vit_tiny_patch16')"),
    (dict(embed_dim=32, num_heads=4), "embed_dim 32 (the table's runs: 16), num_heads 4 (the table's runs: 2)"),
    (dict(depth=3), "depth 3 (the table's runs: 2)"),
    (dict(mlp_ratio=4.0), "mlp_ratio 4.0 (the table's runs: 2.0)"),
    (dict(stem="conv"), "stem 'conv' (the table's runs: 'patch')"),
    (dict(global_pool="token", class_token=True),
     "global_pool 'token' (the table's runs: 'avg'), class_token True (the table's runs: False)"),
])
def test_runs_from_scratch_of_another_model_are_refused_naming_what_differs(folder, tmp_path, monkeypatch, capsys,
                                                                             values, differs):
    monkeypatch.setattr(execute, "run_train_process", lambda *a, **k: pytest.fail(f"trained: {a}"))
    other = edited_copy(folder / "scratch" / "axial" / "seed0", tmp_path / "scratch" / "axial" / "seed0", **values)
    assert transfer.main(["--parent", str(folder / "parent"), "--attn", "axial", "--from-scratch-root",
                          str(tmp_path / "scratch"), "--run-root", str(tmp_path / "runs"), "--output",
                          str(tmp_path / "t.md")]) == 2
    assert capsys.readouterr().err == (f"error: --from-scratch-root: {other} differs in {differs}; accepted: runs of the "
                                       "same task and model (but for its attention) at the same size\n")


def without_train_images(metrics: Path) -> Path:
    """``metrics``, its records as train.py wrote transfer epochs before it counted their images."""
    records = [{key: value for key, value in record.items() if key != "train_images"} for record in read_lines(metrics)]
    metrics.write_text("".join(json.dumps(record) + "\n" for record in records))
    return metrics


def test_transfer_records_without_their_images_stop_the_table_in_one_line_naming_them(folder, tmp_path, monkeypatch,
                                                                                       capsys):
    monkeypatch.setattr(execute, "run_train_process", lambda *a, **k: pytest.fail(f"trained: {a}"))
    # a parent whose lineage holds an older transfer stage: refused before any run
    parent = shutil.copytree(folder / "parent", tmp_path / "parent")
    (parent / "transfer_metrics.jsonl").write_text(json.dumps(dict(train_time_s=1.0, eval_time_s=0.5)) + "\n")
    common = ["--attn", *ROWS, "--transfer-epochs", "1", "--finetune-epochs", "1", "2", "--output", str(tmp_path / "t.md")]
    assert transfer.main(["--parent", str(parent), *common, "--run-root", str(tmp_path / "new-runs")]) == 2
    assert capsys.readouterr().err == (
        f"error: {parent / 'transfer_metrics.jsonl'}: record 1 has no train_images (written before train.py counted "
        f"them); accepted: the records of a run trained since: train {parent} again\n")
    assert not (tmp_path / "new-runs").exists()
    # a run of the table's own, finished with older transfer records (resumed across the change): reused, then refused
    runs = shutil.copytree(folder / "runs", tmp_path / "runs")
    metrics = without_train_images(runs / "transfer" / "axial" / "seed0" / "transfer_metrics.jsonl")
    assert transfer.main(["--parent", str(folder / "parent"), *common, "--run-root", str(runs)]) == 2
    assert capsys.readouterr().err == (
        f"error: {metrics}: record 1 has no train_images (written before train.py counted them); accepted: the "
        f"records of a run trained since: train {metrics.parent} again\n")


# -- the pieces of the table ----------------------------------------------------------------------------------
def recorded_run(run_dir: Path, records: list[dict], **config) -> Path:
    """A run directory with ``config`` as its config.yaml and ``records`` as its epoch records."""
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(config_yaml(make_config(config)))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    return run_dir


def test_a_parent_s_training_counts_the_stages_it_started_from(tmp_path):
    epochs = make_config({}).epochs
    first = recorded_run(tmp_path / "seed0-stage1", [dict(train_images=10, train_time_s=1.5, eval_time_s=0.5)] * 2,
                         img_size=8, epochs=2)
    second = recorded_run(tmp_path / "seed0", [dict(train_images=20, train_time_s=1.5, eval_time_s=0.5)] * epochs,
                          initial_checkpoint=str(first))
    (second / "transfer_metrics.jsonl").write_text(json.dumps(dict(train_images=7, train_time_s=3.0, eval_time_s=1.0)))
    assert transfer_table.lineage(second) == [first, second]
    assert transfer_table.lineage_cost(second) == (2 * 10 + 7 + epochs * 20, 2 * 2.0 + 4.0 + epochs * 2.0)
    assert transfer_table.recipe_words(second) == f"2 epochs at 8×8 px, then {epochs} epochs at 16×16 px"
    assert transfer_table.lineage(first) == [first]


def test_a_run_started_from_a_weights_file_in_a_run_counts_that_run(tmp_path):
    first = recorded_run(tmp_path / "first", [dict(train_images=10, train_time_s=1.0)])
    best, checkpoint = first / "model_best.safetensors", first / "checkpoints" / "step_00000006" / "model.safetensors"
    for weights in (best, checkpoint):
        weights.parent.mkdir(parents=True, exist_ok=True)
        weights.write_bytes(b"")
        second = recorded_run(tmp_path / weights.name, [dict(train_images=20, train_time_s=2.0)],
                              initial_checkpoint=str(weights))
        assert transfer_table.lineage(second) == [first, second]
        assert transfer_table.lineage_cost(second) == (30, 3.0)
        # copied elsewhere without its weights, the run it started from is still counted; moved, it is not
        weights.unlink()
        assert transfer_table.lineage_cost(second) == (30, 3.0)
    first.rename(tmp_path / "moved")
    assert transfer_table.lineage(second) == [second]
    assert transfer_table.lineage_cost(second) == (20, 2.0)


def test_a_run_from_scratch_is_timed_by_its_epochs_here_and_by_wall_time_in_the_accuracy_table(tmp_path):
    """Training plus validation over every stage's epochs, an older record without eval_time_s at its training;
    the accuracy table sums the stages' wall time, start-up and data preparation included."""
    first = recorded_run(tmp_path / "seed0-stage1", [dict(train_images=10, train_time_s=1.5, eval_time_s=0.5)] * 2)
    second = recorded_run(tmp_path / "seed0", [dict(train_images=20, train_time_s=3.0)], initial_checkpoint=str(first))
    row = parse_rows(["axial"])[0]
    stage = Run(row, 0, first, argv=[], summary=dict(wall_time_s=60.0), stage=1, last=False)
    run = Run(row, 0, second, argv=[], summary=dict(wall_time_s=60.0), stage=2, previous=stage)
    assert transfer_table.lineage_cost(second) == (40, 2 * 2.0 + 3.0)
    assert summarize.all_stages_seconds(run) == 60.0 + 60.0


def test_each_seed_is_compared_with_its_own_parent():
    def parent(acc: float) -> FinishedRun:
        return FinishedRun("parent", 0, Path("p"), make_config({}), dict(test_acc=acc), (0.5,), (0.5,))

    points = [(0, transfer_table.Point("epoch 1", 0.60, 100, 10.0, "GPU")),
              (1, transfer_table.Point("epoch 1", 0.60, 300, 30.0, "GPU")),
              (2, transfer_table.Point("epoch 1", None, 200, 20.0, "GPU"))]
    line = transfer_table.summed("axial", "epoch 1", points, {0: parent(0.5), 1: parent(0.7), 2: parent(0.6)}, "3 of 3")
    assert line.accs == [0.60, 0.60] and line.deltas == pytest.approx([0.10, -0.10])
    assert (line.images, line.seconds) == (200, 20.0)  # of every finished run, its accuracy recorded or not
    assert (line.device, line.mixed_devices) == ("GPU", False)
    assert transfer_table.points_cell(line.deltas) == "+0.00 [-10.00–+10.00]"
    assert transfer_table.points_cell([0.004]) == "+0.40" and transfer_table.points_cell([]) == "—"


def test_seconds_measured_on_a_gpu_and_a_cpu_have_no_median_and_a_table_of_both_names_each_line_s(tmp_path):
    """A line whose seeds trained on different kinds of device, or a run whose stages did, has no seconds; a
    table whose lines ran on several kinds names the kind beside each line's seconds."""
    def run_on(run_dir: Path, mem_kind: str, seconds: float, **config) -> Path:
        recorded_run(run_dir, [dict(train_images=10, train_time_s=seconds)], **config)
        (run_dir / "summary.json").write_text(json.dumps(dict(test_acc=0.9, mem_kind=mem_kind)))
        return run_dir

    def finished(run_dir: Path, seed: int) -> FinishedRun:
        return FinishedRun("softmax", seed, run_dir, make_config(read_yaml(run_dir / "config.yaml")),
                           json.loads((run_dir / "summary.json").read_text()), (0.5,), (0.5,))

    gpu = run_on(tmp_path / "gpu", "cuda_allocated", 2.0)
    cpu = run_on(tmp_path / "cpu", "cpu_peak_rss", 50.0)
    assert transfer_table.lineage_point("trained", finished(gpu, 0)) == transfer_table.Point("trained", 0.9, 10, 2.0, "GPU")
    # a second stage on the CPU from the GPU's first: its training on both kinds, no seconds of one kind
    staged = run_on(tmp_path / "staged", "cpu_peak_rss", 50.0, initial_checkpoint=str(gpu))
    assert transfer_table.lineage_point("trained", finished(staged, 0)).device is None
    parents = {0: finished(gpu, 0), 1: finished(cpu, 1)}
    points = [(seed, transfer_table.lineage_point("trained", run)) for seed, run in parents.items()]
    mixed = transfer_table.summed("linear", "from scratch", points, parents, "2 of 2")
    assert (mixed.accs, mixed.images, mixed.seconds, mixed.device, mixed.mixed_devices) == ([0.9, 0.9], 10, None, None, True)
    one_kind = transfer_table.summed("linear", "from scratch", points[:1], parents, "1 of 2")
    assert (one_kind.seconds, one_kind.device, one_kind.mixed_devices) == (2.0, "GPU", False)
    on_cpu = transfer_table.summed("linear", "from scratch", points[1:], parents, "1 of 2")
    assert [transfer_table.seconds_cell(line, named=True) for line in (one_kind, on_cpu, mixed)] == [
        "2.0 (GPU)", "50.0 (CPU)", "—"]
    assert transfer_table.seconds_cell(one_kind, named=False) == "2.0"
    lines = [one_kind, on_cpu, mixed]
    table = transfer_table.TransferTable(rows=[], transfer_runs=[], no_transfer_runs=[], parents=parents,
                                         transfer_epochs=1, finetune_epochs=[1])
    table.transfer_runs = [Run(parse_rows(["axial"])[0], 0, tmp_path / "t", argv=["--img-size", "16"])]
    words = transfer_table.note(table, "cmd", lines)
    assert "named beside them: a GPU's and a CPU's are not compared." in words
    assert ("Seconds read — in a line whose seeds (or a run's stages) trained on different kinds of device, or where "
            "one did not record its device.") in words
    words = transfer_table.note(table, "cmd", [one_kind])
    assert "named beside them" not in words and "Seconds read —" not in words


def test_the_runs_of_the_table_start_from_their_seed_s_parent(folder, tmp_path):
    second = edited_copy(folder / "parent", tmp_path / "parent1", seed=1)
    args, train_args = transfer.parse_args(["--parent", str(folder / "parent"), str(second), "--seeds", "0", "1",
                                            "--attn", "axial", "--run-root", str(tmp_path / "runs"), "--", "--lr", "0.003"])
    table, runs = transfer.plan_table(args, train_args)
    assert [(run.run_dir.relative_to(tmp_path / "runs"), run.seed) for run in runs] == [
        (Path("transfer/axial/seed0"), 0), (Path("no-transfer/axial/seed0"), 0),
        (Path("transfer/axial/seed1"), 1), (Path("no-transfer/axial/seed1"), 1)]
    configs = [expected_config(run.argv) for run in runs]
    assert [config.initial_checkpoint for config in configs] == [str(folder / "parent")] * 2 + [str(second)] * 2
    assert {config.lr for config in configs} == {0.003}
    assert [config.transfer_epochs for config in configs] == [2, 0, 2, 0]
    assert (table.transfer_runs, table.no_transfer_runs) == (runs[0::2], runs[1::2])
