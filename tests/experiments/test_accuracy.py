"""visattn.experiments.accuracy: rows, the summary over seeds, the files it writes, reuse and resumption of runs;
and ``train.py --attn timm``, the table's reference, training timm's own attention."""
from __future__ import annotations

import csv
import json
import os
import subprocess
import threading
from pathlib import Path

import pytest
import yaml
from timm.layers import Attention

import train  # the script at the repository root, importable from there as pytest runs the tests
from visattn.experiments import accuracy, execute, plan, report, summarize
from visattn.experiments.variants import VARIANTS
from visattn.layers import GridAttention
from visattn.predict import load_trained_model
from visattn.train.config import config_yaml

from tests.helpers import REPO, TINY


# -- rows -------------------------------------------------------------------------------------------------
def test_rows_are_types_or_types_with_options():
    rows = plan.parse_rows(["timm,floor", "linear:dwconv_kernel=null,chunk_size=32", "neighborhood:kernel_size=5"])
    assert [(row.attn, row.options) for row in rows] == [
        ("timm", {}), ("floor", {}), ("linear", {"dwconv_kernel": None, "chunk_size": 32}),
        ("neighborhood", {"kernel_size": 5}),
    ]
    assert [row.folder for row in rows] == ["timm", "floor", "linear+dwconv_kernel=null+chunk_size=32",
                                            "neighborhood+kernel_size=5"]
    assert rows[2].label == "linear (dwconv_kernel=null,chunk_size=32)"


@pytest.mark.parametrize(
    "words, message",
    [
        (["nope"], "unknown attention 'nope' in row 'nope'; valid: timm, softmax"),
        (["timm:qk_norm=true"], "timm (timm's own Attention) takes no options"),
        (["linear:dwconv_kernel"], "expected KEY=VALUE pairs"),
        (["floor", "axial,floor"], "rows given twice (or that share a folder): floor"),
    ],
)
def test_bad_rows_are_refused_by_name(words, message):
    with pytest.raises(ValueError) as caught:
        plan.parse_rows(words)
    assert message in str(caught.value)


def test_flags_the_table_sets_cannot_come_after_the_separator(capsys):
    with pytest.raises(SystemExit):
        accuracy.parse_args(["--attn", "floor", "--", "--seed", "3"])
    assert "after --: --seed set by the table for each run" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        accuracy.parse_args(["--attn", "floor", "--", "--resu"])  # --resume, abbreviated
    assert "after --: not train.py flags: --resu (python train.py --help lists them, in full)" in capsys.readouterr().err


# -- the summary over seeds, the table and its files (synthetic runs) -----------------------------------------
def synthetic_run(row: str, seed: int, test_acc: float | None, images_per_s: float = 100.0, status: str = "finished",
                  val_accs: tuple[float, ...] = (0.5, 0.7)) -> plan.Run:
    run = plan.Run(plan.parse_rows([row])[0], seed, Path("runs") / row / f"seed{seed}", argv=[], status=status)
    if status == "finished":
        run.num_classes = 10
        run.history = [
            dict(epoch=epoch, val_acc=acc, val_samples=1000, train_time_s=10.0 * epoch, eval_time_s=1.0,
                 train_images=1000)
            for epoch, acc in enumerate(val_accs, start=1)
        ]
        run.summary = dict(test_acc=test_acc, best_acc=max(val_accs), best_epoch=2, epochs=len(val_accs),
                           images_per_s=images_per_s, peak_mem_mib=1000.0 + seed, mem_kind="cpu_peak_rss",
                           wall_time_s=40.0)
    return run


def synthetic_runs() -> list[plan.Run]:
    return [
        synthetic_run("timm", 0, 0.90, images_per_s=50),
        synthetic_run("timm", 1, 0.94, images_per_s=60, val_accs=(0.1, 0.7)),  # its first epoch at chance
        synthetic_run("timm", 2, 0.93, images_per_s=40),
        synthetic_run("linear", 0, 0.91, images_per_s=100), synthetic_run("linear", 1, 0.89, images_per_s=120),
        synthetic_run("linear", 2, None, status="out of memory"),
        synthetic_run("axial", 0, 0.80, images_per_s=75),
        synthetic_run("axial", 1, None, status="failed"),
        synthetic_run("floor", 0, None, status="not run"),
    ]


def recipe():
    return plan.expected_config(["--config", str(REPO / "configs" / "cluttered-digits.yaml")])


def test_images_per_second_keep_three_figures():
    assert [report._rate(value) for value in (None, 1234.5, 123.4, 12.34, 1.234)] == ["—", "1,234", "123", "12.3", "1.23"]


def test_rows_sum_up_their_seeds_as_median_and_range():
    runs = synthetic_runs()
    rows = plan.parse_rows(["timm", "linear", "axial", "floor"])
    timm, linear, axial, floor = summarize.summarize_rows(rows, runs)
    assert (timm.accs, timm.images_per_s, timm.peak_mem_mib, timm.status) == ([0.90, 0.94, 0.93], 50, 1001, "yes")
    assert report.accuracy_cell(timm) == "93.00% [90.00–94.00] (3)"
    assert timm.epoch_s == 16.0  # epochs of 10 + 1 and 20 + 1 seconds: median 16, the same on every seed
    assert (report.accuracy_cell(linear), linear.images_per_s, linear.status) == ("90.00% [89.00–91.00] (2)", 110, "no: out of memory")
    assert (report.accuracy_cell(axial), axial.status) == ("80.00% (1)", "failed")
    assert (report.accuracy_cell(floor), floor.images_per_s, floor.status) == ("—", None, "not run yet")


def test_seeds_on_a_gpu_and_a_cpu_give_no_median_time_or_memory():
    on_gpu = synthetic_run("axial", 0, 0.97, images_per_s=300)
    on_gpu.summary["mem_kind"] = "cuda_allocated"
    runs = [on_gpu, synthetic_run("axial", 1, 0.95, images_per_s=20), synthetic_run("linear", 0, 0.9, images_per_s=30)]
    axial, linear = summarize.summarize_rows(plan.parse_rows(["axial", "linear"]), runs)
    assert report.accuracy_cell(axial) == "96.00% [95.00–97.00] (2)"  # accuracy does not depend on the machine
    assert (axial.images_per_s, axial.epoch_s, axial.peak_mem_mib, axial.all_stages_s) == (None, None, None, None)
    assert (linear.images_per_s, linear.peak_mem_mib) == (30, 1000)
    text = report.accuracy_markdown([axial, linear], runs, recipe(), "python -m visattn.experiments.accuracy")
    assert "| axial | 96.00% [95.00–97.00] (2) | 0 | — | — | — | — | yes |" in text.splitlines()
    assert "read — in a row whose seeds ran on different kinds of device" in text
    assert "the whole process's peak resident set for runs on a CPU" in text
    one_device = report.accuracy_markdown([linear], runs[2:], recipe(), "python -m visattn.experiments.accuracy")
    assert "kinds of device" not in one_device
    on_gpu.previous = synthetic_run("axial", 0, 0.90)  # a first stage on the CPU, the last on a GPU
    assert summarize.summarize_row(plan.parse_rows(["axial"])[0], [on_gpu]).mixed_devices


def test_rows_on_different_kinds_of_device_name_theirs_and_are_not_compared():
    """Each row on one kind of device, the rows on two: each row's images/s names its device, and the speed-up
    over timm is given only where both ran on the same kind."""
    runs = [synthetic_run("timm", 0, 0.9, images_per_s=200), synthetic_run("axial", 0, 0.97, images_per_s=300),
            synthetic_run("linear", 0, 0.9, images_per_s=30)]
    for run in runs[:2]:
        run.summary["mem_kind"] = "cuda_allocated"
    results = summarize.summarize_rows(plan.parse_rows(["timm", "axial", "linear"]), runs)
    lines = report.accuracy_markdown(results, runs, recipe(), "python -m visattn.experiments.accuracy").splitlines()
    assert lines[2:5] == ["| timm | 90.00% (1) | 0 | 200 (GPU) | 16.0 | 1,000 | 1.00× | yes |",
                          "| axial | 97.00% (1) | 0 | 300 (GPU) | 16.0 | 1,000 | 1.50× | yes |",
                          "| linear | 90.00% (1) | 0 | 30.0 (CPU) | 16.0 | 1,000 | — | yes |"]
    assert "named beside its images/s: a GPU's and a CPU's are not compared." in lines[-1]
    same = report.accuracy_markdown(results[:2], runs[:2], recipe(), "python -m visattn.experiments.accuracy")
    assert "(GPU)" not in same and "named beside" not in same
    # the summary over variants of the data: each row's seconds for all stages, named the same way
    variants = [(VARIANTS["tune-base"], results[1:2]), (VARIANTS["held-dense"], results[2:])]
    summary = report.variants_markdown(variants, Path("t.md"), "cmd").splitlines()
    assert summary[4].endswith("| 40 (GPU) | 0 |") and summary[5].endswith("| 40 (CPU) | 0 |")
    assert "on the kind of device named beside them: a GPU's and a CPU's are not compared" in summary[-1]
    assert "(GPU)" not in report.variants_markdown(variants[:1], Path("t.md"), "cmd")


def test_markdown_has_every_column_and_the_speedup_over_timm():
    runs = synthetic_runs()
    results = summarize.summarize_rows(plan.parse_rows(["timm", "linear", "axial", "floor"]), runs)
    text = report.accuracy_markdown(results, runs, recipe(), "python -m visattn.experiments.accuracy --seeds 0 1 2")
    lines = text.splitlines()
    assert lines[0] == (
        "| attention | test accuracy, median [min–max] (seeds) | epochs at chance | train images/s | s per epoch | "
        "peak memory (MiB) | speed-up over timm | runs at 1,024 tokens |"
    )
    assert lines[2] == "| timm | 93.00% [90.00–94.00] (3) | 0 [0–1] | 50.0 | 16.0 | 1,001 | 1.00× | yes |"
    assert lines[3] == "| linear | 90.00% [89.00–91.00] (2) | 0 | 110 | 16.0 | 1,000 | 2.20× | no: out of memory |"
    assert lines[4] == (
        f"| axial | 80.00% (1) | 0 | 75.0 | 16.0 | 1,000 | 1.50× | failed (see `{Path('runs/axial/seed1.log')}`) |"
    )
    assert lines[5] == "| floor | — | — | — | — | — | — | not run yet |"
    assert "`python -m visattn.experiments.accuracy --seeds 0 1 2`: cluttered-digits at 128×128 px, patch 4 (32×32 grid" in text
    assert "seeds 0, 1, 2" in text and "peak resident set" in text
    assert "epochs at chance: the leading epochs of the first stage whose validation accuracy is below" in text


def test_outputs_are_a_table_a_png_and_every_run_as_json_and_csv(tmp_path):
    runs = synthetic_runs()
    results = summarize.summarize_rows(plan.parse_rows(["timm", "linear", "axial", "floor"]), runs)
    output = tmp_path / "tables" / "cluttered.md"
    text = report.write_accuracy(output, results, runs, recipe(), "python -m visattn.experiments.accuracy")
    assert output.read_text() == text
    assert output.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = json.loads(output.with_suffix(".json").read_text())["runs"]
    assert [(r["row"], r["seed"], r["status"], r["test_acc"]) for r in saved] == [
        (run.row.text, run.seed, run.status, run.summary["test_acc"] if run.summary else None) for run in runs
    ]
    assert [r["val_acc"] for r in saved[0]["history"]] == [0.5, 0.7]
    with open(output.with_suffix(".csv")) as handle:
        rows = list(csv.DictReader(handle))
    assert [row["row"] for row in rows] == [run.row.text for run in runs]
    assert rows[0]["test_acc"] == "0.9" and rows[0]["epoch_time_s"] == "16.0" and rows[5]["status"] == "out of memory"
    assert [row["epochs_at_chance"] for row in rows[:3]] == ["0", "1", "0"] and rows[5]["epochs_at_chance"] == ""
    assert [r["epochs_at_chance"] for r in saved[:3]] == [0, 1, 0] and saved[0]["variant"] is None


@pytest.mark.parametrize(
    "returncode, log, expected",
    [
        (-9, "", "out of memory"),  # killed by the kernel's OOM killer
        (1, "RuntimeError: [enforce fail at alloc_cpu.cpp] DefaultCPUAllocator: can't allocate memory", "out of memory"),
        (1, "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", "out of memory"),
        (2, "error: attn_kwargs: unknown option(s) bogus", "failed"),
    ],
)
def test_a_failed_run_says_whether_memory_ran_out(returncode, log, expected):
    assert execute.failure(returncode, log) == expected


def test_eta_is_each_rows_mean_time_times_its_runs_left():
    runs = [synthetic_run(row, seed, None, status="not run") for row in ("timm", "floor") for seed in (0, 1, 2)]
    assert execute.eta_seconds(runs) is None
    runs[0].seconds, runs[3].seconds = 100.0, 20.0
    assert execute.eta_seconds(runs) == 2 * 100.0 + 2 * 20.0
    runs[1].action = "reuse"  # finished before: nothing left to do
    assert execute.eta_seconds(runs) == 100.0 + 2 * 20.0


# -- reuse and resumption ---------------------------------------------------------------------------------
def planned(tmp_path: Path, *extra: str) -> tuple[object, list[str], list[plan.Run]]:
    args, train_args = accuracy.parse_args(
        ["--attn", "timm", "floor", "--seeds", "0", "1", "--run-root", str(tmp_path / "runs"),
         "--output", str(tmp_path / "table.md"), *extra, "--", *TINY]
    )
    return args, train_args, plan.plan(accuracy.grid(args, train_args))


def finish(run: plan.Run, test_acc: float, config=None, val_accs: tuple[float, ...] = (0.5,),
           wall_time_s: float = 3.0) -> None:
    """Leave ``run`` as train.py leaves a finished run: its config, model file, per-epoch records and summary."""
    run.run_dir.mkdir(parents=True)
    (run.run_dir / "config.yaml").write_text(config_yaml(config or plan.expected_config(run.argv)))
    model_file = dict(model="visattn_vit_tiny_patch16", kwargs=dict(num_classes=10))
    (run.run_dir / "model.json").write_text(json.dumps(model_file))
    records = [dict(epoch=epoch, val_acc=acc, val_samples=50, train_time_s=2.0, eval_time_s=0.5, train_images=96)
               for epoch, acc in enumerate(val_accs, start=1)]
    (run.run_dir / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    (run.run_dir / "summary.json").write_text(json.dumps(
        dict(test_acc=test_acc, best_acc=max(val_accs), best_epoch=1, epochs=len(val_accs), images_per_s=48.0,
             peak_mem_mib=800.0, mem_kind="cpu_peak_rss", wall_time_s=wall_time_s)
    ))


def test_finished_runs_of_the_same_config_are_reused_not_retrained(tmp_path, monkeypatch, capsys):
    _, _, runs = planned(tmp_path)
    for index, run in enumerate(runs):
        finish(run, test_acc=0.5 + index / 100)
    monkeypatch.setattr(execute, "run_train_process", lambda *a, **k: pytest.fail(f"trained again: {a}"))
    argv = ["--attn", "timm", "floor", "--seeds", "0", "1", "--run-root", str(tmp_path / "runs"),
            "--output", str(tmp_path / "table.md"), "--", *TINY]
    assert accuracy.main(argv) == 0
    assert "4 runs: 4 finished before, 0 to train" in capsys.readouterr().out
    text = (tmp_path / "table.md").read_text()
    assert "| timm | 51.00% [50.00–52.00] (2) | 0 | 48.0 | 2.5 | 800 | 1.00× | yes |" in text  # runs seed by seed
    assert "| floor | 52.00% [51.00–53.00] (2) |" in text


def test_tables_only_writes_the_finished_runs_and_trains_none(tmp_path, monkeypatch, capsys):
    _, _, runs = planned(tmp_path)
    timm0, floor0, timm1, floor1 = runs  # seed by seed
    finish(timm0, 0.5)
    finish(floor0, 0.6)
    finish(timm1, 0.7)
    (floor0.run_dir / "summary.json").unlink()  # stopped, or still training in another invocation
    monkeypatch.setattr(execute, "run_train_process", lambda *a, **k: pytest.fail(f"trained: {a}"))
    argv = ["--attn", "timm", "floor", "--seeds", "0", "1", "--run-root", str(tmp_path / "runs"),
            "--output", str(tmp_path / "table.md"), "--tables-only", "--", *TINY]
    assert accuracy.main(argv) == 1  # not every run finished
    assert "4 runs: 2 finished, 2 not (--tables-only: none trained)" in capsys.readouterr().out
    text = (tmp_path / "table.md").read_text()
    assert "| timm | 60.00% [50.00–70.00] (2) |" in text and "| floor | — | — | — | — | — | — | not run yet |" in text
    assert "--tables-only" not in text and "--attn timm floor --seeds 0 1" in text  # the command that trains it
    assert not floor1.run_dir.exists()


def test_tables_only_refuses_retrain(capsys):
    with pytest.raises(SystemExit):
        accuracy.parse_args(["--tables-only", "--retrain", "--", *TINY])
    assert "--tables-only trains no run: leave out --retrain" in capsys.readouterr().err


def test_a_changed_config_is_retrained_and_a_stopped_run_resumed(tmp_path):
    _, _, runs = planned(tmp_path)
    timm0, floor0, timm1, floor1 = runs  # seed by seed
    other = plan.expected_config(timm0.argv)
    other.lr = 0.5
    finish(timm0, 0.5, config=other)
    assert execute.choose_action(timm0, retrain=False) == ("train", "its config differs: lr: 0.5 -> 0.002")
    bookkeeping = plan.expected_config(timm1.argv)
    bookkeeping.num_workers, bookkeeping.run_dir = 3, "elsewhere"  # where and how a run is kept: still the same run
    finish(timm1, 0.5, config=bookkeeping)
    assert execute.choose_action(timm1, retrain=False) == ("reuse", "finished with this config")
    assert execute.choose_action(timm1, retrain=True) == ("train", "--retrain")
    finish(floor0, 0.5)
    (floor0.run_dir / "summary.json").unlink()  # stopped mid-run: a checkpoint, no summary
    (floor0.run_dir / "checkpoints" / "step_00000003").mkdir(parents=True)
    assert execute.choose_action(floor0, retrain=False)[0] == "resume"
    assert execute.choose_action(floor1, retrain=False) == ("train", "new")


def test_each_run_is_its_own_train_py_process_resumed_or_overwritten(tmp_path, monkeypatch):
    args, train_args, runs = planned(tmp_path, "--seeds", "4")
    commands = []

    def fake_train(command, **kwargs):
        commands.append(command)
        run_dir = Path(command[command.index("--run-dir") + 1])
        if not run_dir.exists():
            finish(next(run for run in runs if run.run_dir == run_dir), 0.75)
        else:
            (run_dir / "summary.json").write_text(json.dumps(dict(
                test_acc=0.75, best_acc=0.5, best_epoch=1, epochs=1, images_per_s=48.0, peak_mem_mib=800.0,
                mem_kind="cpu_peak_rss", wall_time_s=3.0)))
        return subprocess.CompletedProcess(command, 0)

    timm, floor = runs
    finish(floor, 0.5)
    (floor.run_dir / "summary.json").unlink()
    (floor.run_dir / "checkpoints" / "step_00000003").mkdir(parents=True)
    monkeypatch.setattr(execute, "run_train_process", fake_train)
    argv = ["--attn", "timm", "floor", "--seeds", "4", "--run-root", str(tmp_path / "runs"),
            "--output", str(tmp_path / "table.md"), "--", *TINY]
    assert accuracy.main(argv) == 0
    assert [command[1:] for command in commands] == [
        [str(REPO / "train.py"), "--config", str(REPO / "configs" / "digits.yaml"), *TINY, "--attn", "timm",
         "--seed", "4", "--run-dir", str(timm.run_dir), "--overwrite"],
        [str(REPO / "train.py"), "--config", str(REPO / "configs" / "digits.yaml"), *TINY, "--attn", "floor",
         "--seed", "4", "--run-dir", str(floor.run_dir), "--resume"],
    ]
    assert "| floor | 75.00% (1) |" in (tmp_path / "table.md").read_text()


def test_a_rows_options_are_laid_over_the_recipes(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("attn_kwargs: {kernel_size: 5, tile_size: 4}\n")
    args, train_args = accuracy.parse_args(["--config", str(recipe), "--attn", "neighborhood:tile_size=8", "--", *TINY])
    (run,) = plan.plan(accuracy.grid(args, train_args))
    assert plan.expected_config(run.argv).attn_kwargs == {"kernel_size": 5, "tile_size": 8}


# -- train.py --attn timm: the reference row ------------------------------------------------------------------
def test_attn_timm_trains_timms_own_attention_and_resumes(tmp_path, capsys):
    run_dir = tmp_path / "timm"
    assert train.main([*TINY, "--attn", "timm", "--attn-kwargs", "dwconv_kernel=3", "--run-dir", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "attn_kwargs: dwconv_kernel dropped: timm (timm's own Attention) takes no options" in out
    assert "attention: timm's Attention in all 2 blocks" in out
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert (saved["attn"], saved["attn_kwargs"]) == ("timm", {})
    assert json.loads((run_dir / "model.json").read_text())["kwargs"]["attn"] == "timm"
    model = load_trained_model(run_dir)
    assert [type(block.attn) for block in model.blocks] == [Attention, Attention]
    assert not any(isinstance(module, GridAttention) for module in model.modules())
    summary = (run_dir / "summary.json").read_text()
    assert train.main([*TINY, "--attn", "timm", "--run-dir", str(run_dir), "--resume"]) == 0
    assert (run_dir / "summary.json").read_text() == summary
    assert "resuming" not in capsys.readouterr().out  # the saved config is the config resolved again: no change


def test_attn_timm_is_for_every_block(tmp_path, capsys):
    assert train.main([*TINY, "--attn", "timm,softmax", "--run-dir", str(tmp_path / "run")]) == 2
    assert "attn: 'timm' (timm's own Attention) is for every block; give it alone" in capsys.readouterr().err


# -- a curriculum: earlier stages (a smaller size, easier data), then the recipe's from their weights ---------
@pytest.mark.parametrize(
    "stage, message",
    [
        ("", "--stage 1 '': empty; give train.py flags in one quoted word, as \"--img-size 64 --epochs 4\""),
        ("--epochs 2 --initial-checkpoint runs/x", "--stage 1 '--epochs 2 --initial-checkpoint runs/x': "
                                                   "--initial-checkpoint set by the table for each stage"),
        ("--seed=3", "--stage 1 '--seed=3': --seed set by the table for each stage"),
        ("--dataset-kwargs 'level=easy", "--stage 1 \"--dataset-kwargs 'level=easy\": No closing quotation"),
        ("--img-sz 64", "--stage 1 '--img-sz 64': not train.py flags: --img-sz 64 (python train.py --help lists them"),
        ("--init runs/x", "--stage 1 '--init runs/x': not train.py flags: --init runs/x"),  # --initial-checkpoint
        ("--see 3", "--stage 1 '--see 3': not train.py flags: --see 3"),  # --seed
        ("--epochs", "--stage 1 '--epochs': argument --epochs: expected one argument"),
    ],
)
def test_a_bad_stage_is_refused_by_name(capsys, stage, message):
    with pytest.raises(SystemExit):
        accuracy.parse_args(["--attn", "floor", "--stage", stage])
    error = capsys.readouterr().err.splitlines()[-1]
    assert message in error and "usage:" not in error


def test_a_stage_of_one_flag_word_is_the_stage_and_the_table_takes_no_abbreviation(capsys):
    args, _ = accuracy.parse_args(["--attn", "floor", "--stage", "--epochs=4", "--epochs", "2"])
    assert (args.stage_flags, args.epochs) == ([["--epochs=4"]], 2)
    with pytest.raises(SystemExit):
        accuracy.parse_args(["--attn", "floor", "--stag", "--epochs 4"])
    assert "unrecognized arguments: --stag" in capsys.readouterr().err


def test_a_bad_flag_in_a_stage_stops_before_any_run(tmp_path, capsys):
    argv = ["--attn", "floor", "--run-root", str(tmp_path / "runs"), "--output", str(tmp_path / "table.md"),
            "--stage", "--epochs 1", "--stage", "--epochs two", "--", *TINY]
    assert accuracy.main(argv) == 2
    assert "in stage 2 (--stage --epochs two): --epochs: expected int, got 'two'" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_each_stage_starts_from_the_one_before_with_its_own_flags(tmp_path):
    _, _, runs = planned(tmp_path, "--stage", "--img-size 8 --epochs 2", "--stage", "--epochs 3 --lr 0.01")
    last = runs[0]
    first, second = last.earlier
    configs = [plan.expected_config(run.argv) for run in (first, second, last)]
    assert [run.run_dir.name for run in (first, second, last)] == ["seed0-stage1", "seed0-stage2", "seed0"]
    assert [(run.stage, run.last) for run in (first, second, last)] == [(1, False), (2, False), (3, True)]
    assert [(config.img_size, config.epochs) for config in configs] == [(8, 2), (16, 3), (16, 1)]
    assert [config.lr for config in configs] == [configs[0].lr, 0.01, configs[0].lr] and configs[0].lr != 0.01
    assert [config.initial_checkpoint for config in configs] == [None, str(first.run_dir), str(second.run_dir)]
    assert (second.previous, last.previous) == (first, second)
    assert plan.all_runs(runs)[:3] == [first, second, last]
    assert plan.run_name(second) == "timm seed 0 (stage 2)" and plan.run_name(last) == "timm seed 0"
    assert report.curriculum(runs) == (
        ", after 2 earlier stages (2 epochs at 8×8 px (2×2 grid); 3 epochs at 16×16 px (4×4 grid)), each from the "
        "weights of the one before, and this last stage from those of stage 2 (speed and memory: this last stage alone)"
    )


def test_the_note_names_an_earlier_stage_s_dataset_and_options_where_they_differ_from_the_last_one_s(tmp_path):
    other_dataset = "--dataset cluttered-digits --dataset-kwargs digit_size=8 clutter_size=2 --epochs 2"
    _, _, runs = planned(tmp_path, "--stage", other_dataset, "--stage", "--epochs 3")
    assert report.curriculum(runs) == (
        ", after 2 earlier stages (2 epochs at 16×16 px (4×4 grid) of cluttered-digits, dataset options "
        "{'digit_size': 8, 'clutter_size': 2}; 3 epochs at 16×16 px (4×4 grid)), each from the weights of the "
        "one before, and this last stage from those of stage 2 (speed and memory: this last stage alone)"
    )


@pytest.mark.parametrize("failing", [1, 2])
def test_a_failed_stage_stops_the_stages_after_it_and_names_its_log(tmp_path, monkeypatch, capsys, failing):
    _, _, runs = planned(tmp_path, "--stage", "--img-size 8 --epochs 2", "--stage", "--epochs 1")
    commands = []

    def fake_train(command, **kwargs):
        run_dir = Path(command[command.index("--run-dir") + 1])
        commands.append(run_dir.relative_to(tmp_path / "runs"))
        run = next(run for run in plan.all_runs(runs) if run.run_dir == run_dir)
        if run.row.attn == "floor" and run.stage == failing:
            return subprocess.CompletedProcess(command, 2)
        finish(run, 0.75)
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(execute, "run_train_process", fake_train)
    argv = ["--attn", "timm", "floor", "--run-root", str(tmp_path / "runs"), "--output", str(tmp_path / "table.md"),
            "--stage", "--img-size 8 --epochs 2", "--stage", "--epochs 1", "--", *TINY]
    assert accuracy.main(argv) == 1
    floor_stages = ["floor/seed0-stage1", "floor/seed0-stage2"][:failing]
    assert commands == [Path(p) for p in ("timm/seed0-stage1", "timm/seed0-stage2", "timm/seed0", *floor_stages)]
    out = capsys.readouterr().out
    if failing == 1:
        assert "floor seed 0 (stage 2): not started, its stage 1 failed" in out
    assert f"floor seed 0: not started, its stage {failing} failed" in out
    text = (tmp_path / "table.md").read_text()
    assert "--stage '--img-size 8 --epochs 2' --stage '--epochs 1' -- " in text  # the command, as a shell reads it
    log = tmp_path / "runs" / "floor" / f"seed0-stage{failing}.log"
    assert f"| floor | — | — | — | — | — | — | failed (see `{log}`) |" in text


def test_a_curriculum_trains_the_first_stage_then_the_recipe_from_its_weights(tmp_path, monkeypatch, capsys):
    _, _, runs = planned(tmp_path, "--stage", "--img-size 8 --epochs 2")
    timm0, floor0, _, _ = runs
    (first,) = timm0.earlier
    assert (first.run_dir, first.stage, timm0.stage) == (tmp_path / "runs" / "timm" / "seed0-stage1", 1, 2)
    stage1_config, config = plan.expected_config(first.argv), plan.expected_config(timm0.argv)
    assert (stage1_config.img_size, stage1_config.epochs, stage1_config.initial_checkpoint) == (8, 2, None)
    assert (config.img_size, config.epochs, config.initial_checkpoint) == (16, 1, str(first.run_dir))
    assert plan.all_runs(runs)[:4] == [first, timm0, floor0.previous, floor0]

    commands = []

    def fake_train(command, **kwargs):
        commands.append(command)
        run_dir = Path(command[command.index("--run-dir") + 1])
        run = next(run for run in plan.all_runs(runs) if run.run_dir == run_dir)
        if run.row.attn == "floor" and run.stage == 1:
            return subprocess.CompletedProcess(command, 2)  # the first stage fails: the second never starts
        finish(run, 0.25 if run.stage == 1 else 0.75)
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(execute, "run_train_process", fake_train)
    argv = ["--attn", "timm", "floor", "--seeds", "0", "1", "--run-root", str(tmp_path / "runs"),
            "--output", str(tmp_path / "table.md"), "--stage", "--img-size 8 --epochs 2", "--", *TINY]
    assert accuracy.main(argv) == 1
    trained = [Path(command[command.index("--run-dir") + 1]).relative_to(tmp_path / "runs") for command in commands]
    assert trained == [Path(p) for p in ("timm/seed0-stage1", "timm/seed0", "floor/seed0-stage1",
                                         "timm/seed1-stage1", "timm/seed1", "floor/seed1-stage1")]
    assert "floor seed 0: not started, its stage 1 failed" in capsys.readouterr().out
    text = (tmp_path / "table.md").read_text()
    assert "| timm | 75.00% [75.00–75.00] (2) |" in text  # the second stage's accuracy
    log = tmp_path / "runs" / "floor" / "seed0-stage1.log"
    assert f"| floor | — | — | — | — | — | — | failed (see `{log}`) |" in text
    assert "1 epoch, after a first stage of 2 epochs at 8×8 px (2×2 grid) whose weights it starts from" in text
    with open(tmp_path / "table.csv") as handle:
        records = list(csv.DictReader(handle))
    assert [(r["row"], r["seed"], r["stage"], r["status"]) for r in records] == [
        ("timm", "0", "1", "finished"), ("timm", "0", "2", "finished"), ("floor", "0", "1", "failed"),
        ("floor", "0", "2", "failed"), ("timm", "1", "1", "finished"), ("timm", "1", "2", "finished"),
        ("floor", "1", "1", "failed"), ("floor", "1", "2", "failed"),
    ]


def test_jobs_trains_runs_side_by_side_each_stage_after_the_one_before(tmp_path, monkeypatch, capsys):
    _, _, runs = planned(tmp_path, "--stage", "--img-size 8 --epochs 2")
    lock, running, ended, most = threading.Lock(), set(), set(), [0]
    first_two = threading.Barrier(2, timeout=10)  # broken, and the test failed, unless both run at once

    def fake_train(command, **kwargs):
        run_dir = Path(command[command.index("--run-dir") + 1])
        run = next(run for run in plan.all_runs(runs) if run.run_dir == run_dir)
        with lock:
            assert all(stage.run_dir in ended for stage in run.earlier), f"{run_dir} started before its first stage"
            running.add(run_dir)
            most[0] = max(most[0], len(running))
        if run.seed == 0 and run.stage == 1:
            first_two.wait()  # timm's and floor's first stages of seed 0: the first two runs, started together
        finish(run, 0.25 if run.row.attn == "timm" else 0.75)
        with lock:
            running.remove(run_dir)
            ended.add(run_dir)
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(execute, "run_train_process", fake_train)
    argv = ["--attn", "timm", "floor", "--seeds", "0", "1", "--run-root", str(tmp_path / "runs"), "--jobs", "2",
            "--output", str(tmp_path / "table.md"), "--stage", "--img-size 8 --epochs 2", "--", *TINY]
    assert accuracy.main(argv) == 0
    assert ended == {run.run_dir for run in plan.all_runs(runs)}
    assert most[0] == 2
    out = capsys.readouterr().out
    assert "8 runs: 0 finished before, 8 to train (0 resumed), 2 at a time" in out
    text = (tmp_path / "table.md").read_text()
    assert "| timm | 25.00% [25.00–25.00] (2) |" in text and "| floor | 75.00% [75.00–75.00] (2) |" in text


@pytest.mark.parametrize("jobs", ["1", "3"])
def test_a_failed_first_stage_or_a_run_that_cannot_start_is_reported_and_the_others_go_on(tmp_path, monkeypatch, capsys,
                                                                                      jobs):
    _, _, runs = planned(tmp_path, "--stage", "--img-size 8 --epochs 2")
    trained = []

    def fake_train(command, **kwargs):
        run_dir = Path(command[command.index("--run-dir") + 1])
        run = next(run for run in plan.all_runs(runs) if run.run_dir == run_dir)
        trained.append(run_dir)
        if run.row.attn == "floor" and run.seed == 0:
            return subprocess.CompletedProcess(command, 2)  # floor's first stage of seed 0 fails
        if run.row.attn == "timm" and run.seed == 1 and run.stage == 1:
            raise OSError("no such file: train.py")  # this one's process cannot be started
        finish(run, 0.5)
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(execute, "run_train_process", fake_train)
    argv = ["--attn", "timm", "floor", "--seeds", "0", "1", "--run-root", str(tmp_path / "runs"), "--jobs", jobs,
            "--output", str(tmp_path / "table.md"), "--stage", "--img-size 8 --epochs 2", "--", *TINY]
    assert accuracy.main(argv) == 1
    root = tmp_path / "runs"
    assert sorted(trained) == sorted(root / name for name in (
        "timm/seed0-stage1", "timm/seed0", "floor/seed0-stage1", "timm/seed1-stage1", "floor/seed1-stage1",
        "floor/seed1"))
    out = capsys.readouterr().out
    assert "floor seed 0: not started, its stage 1 failed" in out
    assert "timm seed 1 (stage 1): failed: no such file: train.py" in out
    assert "timm seed 1: not started, its stage 1 failed" in out
    assert "| timm | 50.00% (1) |" in (tmp_path / "table.md").read_text()


def test_with_fewer_runs_left_than_jobs_the_time_left_is_the_longest_run_not_a_share():
    runs = [plan.Run(row=plan.Row("floor", "floor"), seed=seed, run_dir=Path(f"r{seed}"), argv=[]) for seed in range(3)]
    runs[0].seconds = 60.0
    assert execute.eta_seconds(runs, jobs=4) == 60.0  # two runs left, at 60 s each, side by side
    assert execute.eta_seconds(runs, jobs=1) == 120.0


@pytest.mark.parametrize("jobs", ["0", "-1"])
def test_jobs_below_one_is_refused(jobs, capsys):
    with pytest.raises(SystemExit):
        accuracy.parse_args(["--attn", "timm", "--jobs", jobs])
    assert f"--jobs: at least 1 process at a time, got {jobs}" in capsys.readouterr().err


def staged_grid_trained_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The two-stage grid of :func:`planned` run by the runner, train.py a stand-in that finishes each run it is
    given; the last three words of each train.py command, in the order run."""
    commands = []

    def fake_train(command, **kwargs):
        commands.append(command[-3:])
        run_dir = Path(command[command.index("--run-dir") + 1])
        (run_dir / "summary.json").write_text(json.dumps(dict(
            test_acc=0.75, best_acc=0.5, best_epoch=1, epochs=1, images_per_s=48.0, peak_mem_mib=800.0,
            mem_kind="cpu_peak_rss", wall_time_s=3.0)))
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(execute, "run_train_process", fake_train)
    argv = ["--attn", "timm", "floor", "--seeds", "0", "1", "--run-root", str(tmp_path / "runs"),
            "--output", str(tmp_path / "table.md"), "--stage", "--img-size 8 --epochs 2", "--", *TINY]
    assert accuracy.main(argv) == 0
    return commands


def test_a_second_stage_whose_first_is_trained_again_is_trained_again(tmp_path, monkeypatch, capsys):
    _, _, runs = planned(tmp_path, "--stage", "--img-size 8 --epochs 2")
    for run in plan.all_runs(runs):
        finish(run, 0.5)
    timm0 = runs[0]
    (timm0.previous.run_dir / "summary.json").unlink()
    (timm0.previous.run_dir / "checkpoints" / "step_00000003").mkdir(parents=True)  # the first stage was stopped
    commands = staged_grid_trained_again(tmp_path, monkeypatch)
    assert commands == [["--run-dir", str(timm0.previous.run_dir), "--resume"],
                        ["--run-dir", str(timm0.run_dir), "--overwrite"]]
    out = capsys.readouterr().out
    assert "timm seed 0: trained afresh: the stage it starts from is trained in this invocation" in out
    assert "8 runs: 6 finished before, 2 to train (1 resumed)" in out


def test_a_finished_first_stage_without_its_weights_is_trained_again_for_the_second(tmp_path, monkeypatch, capsys):
    """Runs copied from another machine without their weights: a first stage whose second is to be trained is
    trained again for its weights; one whose second stage finished (or resumes from its own checkpoint) is not."""
    _, _, runs = planned(tmp_path, "--stage", "--img-size 8 --epochs 2")
    for run in plan.all_runs(runs):
        finish(run, 0.5)
        (run.run_dir / "model_best.safetensors").write_bytes(b"")
    timm0, timm1 = runs[0], runs[1]
    (timm0.previous.run_dir / "model_best.safetensors").unlink()
    (timm0.run_dir / "summary.json").unlink()  # its second stage never finished here
    (timm1.previous.run_dir / "model_best.safetensors").unlink()  # its second stage finished: nothing to do
    commands = staged_grid_trained_again(tmp_path, monkeypatch)
    assert commands == [["--run-dir", str(timm0.previous.run_dir), "--overwrite"],
                        ["--run-dir", str(timm0.run_dir), "--overwrite"]]
    out = capsys.readouterr().out
    assert ("timm seed 0 (stage 1): trained afresh: finished, but its model_best.safetensors, which its next stage "
            "starts from, is not there") in out
    assert "8 runs: 6 finished before, 2 to train (0 resumed)" in out


def test_a_second_stage_older_than_its_first_stages_finish_is_trained_again(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args, train_args = accuracy.parse_args(["--attn", "floor", "--run-root", "runs", "--stage", "--img-size 8 --epochs 2",
                                         "--", *TINY])
    (run,) = plan.plan(accuracy.grid(args, train_args))
    finish(run.previous, 0.5)
    finish(run, 0.5)
    assert execute.choose_action(run, retrain=False) == ("reuse", "finished with this config")
    # the same runs, named from another spelling of the run root: still the same runs
    args, train_args = accuracy.parse_args(["--attn", "floor", "--run-root", str(tmp_path / "runs"),
                                         "--stage", "--img-size 8 --epochs 2", "--", *TINY])
    (spelled,) = plan.plan(accuracy.grid(args, train_args))
    assert execute.choose_action(spelled, retrain=False) == ("reuse", "finished with this config")
    # a run of the same config trained from scratch in that folder is not this second stage
    scratch = plan.expected_config(run.argv)
    scratch.initial_checkpoint = None
    (run.run_dir / "config.yaml").write_text(config_yaml(scratch))
    assert execute.choose_action(run, retrain=False)[1] == (
        f"its config differs: initial_checkpoint: None -> {str(run.previous.run_dir)!r}"
    )
    (run.run_dir / "config.yaml").write_text(config_yaml(plan.expected_config(run.argv)))
    # its first stage finished again (an invocation stopped between the stages): the second is stale
    later = (run.run_dir / "config.yaml").stat().st_mtime + 10
    os.utime(run.previous.run_dir / "summary.json", (later, later))
    assert execute.choose_action(run, retrain=False) == ("train", "the stage it starts from finished again after it started")


def test_eta_counts_each_stage_at_its_own_time_and_not_the_runs_that_will_not_start():
    first = [synthetic_run(row, 0, None, status="not run") for row in ("timm", "floor")]
    second = [synthetic_run(row, 0, None, status="not run") for row in ("timm", "floor")]
    for stage1, run in zip(first, second):
        stage1.stage, stage1.last, run.stage, run.previous = 1, False, 2, stage1
    runs = [first[0], second[0], first[1], second[1]]
    first[0].seconds, second[0].seconds = 10.0, 70.0
    first[0].status = second[0].status = "finished"
    assert execute.eta_seconds(runs) == 10.0 + 70.0  # floor's stages at timm's time of the same stage
    first[1].seconds, first[1].status = 5.0, "out of memory"  # its second stage will not start
    assert execute.eta_seconds(runs) == 0


def test_a_first_stage_out_of_memory_names_its_log():
    run = synthetic_run("axial", 0, None, status="out of memory")
    run.previous = synthetic_run("axial", 0, None, status="out of memory")
    run.previous.run_dir, run.previous.stage, run.previous.last, run.stage = Path("runs/axial/seed0-stage1"), 1, False, 2
    results = summarize.summarize_rows(plan.parse_rows(["axial"]), [run])
    assert report.accuracy_markdown(results, [run], recipe(), "c").splitlines()[2] == (
        f"| axial | — | — | — | — | — | — | no: out of memory in stage 1 "
        f"(see `{Path('runs/axial/seed0-stage1.log')}`) |"
    )
