"""Variants of the data for an accuracy table (``--variants``): the named variants, their dataset options in
every stage's train.py command, their run folders and tables; and the epochs a run spends at chance."""
from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest

from tests.experiments.test_accuracy import finish
from tests.helpers import REPO
from visattn.experiments import accuracy, execute, plan, summarize, variants
from visattn.train.cli import parse_args as train_parse_args
from visattn.train.config import make_config
from visattn.train.generated_tasks import task_options
from visattn.train.generated_tasks.cluttered_digits import training_sources

CURRICULUM = str(REPO / "configs" / "cluttered-digits-curriculum.yaml")
# A small model; the data's options stay the variant's (nothing is drawn: train.py is faked).
SMALL = ["--embed-dim", "16", "--depth", "1", "--num-heads", "1", "--epochs", "1"]


# -- the variants ---------------------------------------------------------------------------------------------
def test_the_variants_are_the_fixed_ones_in_two_groups():
    columns = ("train_size", "digit_size", "digit_size_max", "clutter_size", "clutter_count", "placements", "seed")
    table = {variant.name: tuple(variant.dataset_kwargs[key] for key in columns)
             for variant in (*variants.TUNING, *variants.HELD_OUT)}
    assert table == {
        "tune-base": (4000, 32, 0, 8, 0, 0, 0), "tune-scaled": (4000, 24, 40, 12, 24, 0, 1),
        "tune-few": (2000, 32, 0, 16, 16, 10, 2),
        "held-dense": (4000, 20, 36, 10, 32, 0, 11), "held-big": (3000, 28, 44, 14, 16, 3, 12),
        "held-coarse": (6000, 32, 0, 20, 12, 0, 13),
    }
    assert [variant.name for variant in variants.TUNING] == ["tune-base", "tune-scaled", "tune-few"]
    for variant in variants.VARIANTS.values():
        assert variant.dataset_kwargs["val_size"] == variant.dataset_kwargs["test_size"] == 1000
    assert [variants.group_of(variants.VARIANTS[name]) for name in ("tune-few", "held-big")] == ["tuning", "held-out"]


def test_tune_few_shows_a_fifth_of_the_distinct_digits_of_a_random_draw():
    """2,000 canvases drawn at random from the ~1,078 training digits show ~915 of them; with 10 canvases per
    digit, tune-few shows 200 (20 per class)."""
    options = task_options("cluttered-digits", variants.VARIANTS["tune-few"].dataset_kwargs, (128, 128))
    shown = training_sources(options)
    assert [len(per_class) for per_class in shown] == [20] * 10
    assert sum(len(set(per_class.tolist())) for per_class in shown) == 200


@pytest.mark.parametrize("name", sorted(variants.VARIANTS))
def test_every_variant_passes_the_generator_s_checks_at_both_stages_of_the_curriculum(name):
    variant = variants.VARIANTS[name]
    for side in (64, 128):
        task_options(variant.dataset, variant.dataset_kwargs, (side, side))


def test_tune_base_is_the_curriculum_recipe_s_data():
    recipe = make_config(train_parse_args(["--config", CURRICULUM])[0])
    as_recipe = task_options(recipe.dataset, recipe.dataset_kwargs, recipe.image_hw)
    assert task_options("cluttered-digits", variants.VARIANTS["tune-base"].dataset_kwargs, recipe.image_hw) == as_recipe


def test_group_words_expand_in_order_and_each_variant_comes_once():
    def names(words: list[str]) -> list[str]:
        return [variant.name for variant in variants.parse_variants(words)]

    assert names(["tuning"]) == ["tune-base", "tune-scaled", "tune-few"]
    assert names(["held-big", "held-out"]) == ["held-big", "held-dense", "held-coarse"]
    assert names(["tune-few", "tuning", "tune-few"]) == ["tune-few", "tune-base", "tune-scaled"]
    args, _ = accuracy.parse_args(["--attn", "floor", "--variants", "held-out", "tune-base"])
    assert [variant.name for variant in args.variants] == ["held-dense", "held-big", "held-coarse", "tune-base"]
    assert accuracy.parse_args(["--attn", "floor"])[0].variants == []


def test_an_unknown_variant_is_refused_in_one_line_listing_the_names(capsys):
    with pytest.raises(SystemExit):
        accuracy.parse_args(["--attn", "floor", "--variants", "tuning", "held-outt"])
    assert capsys.readouterr().err.splitlines()[-1].endswith(
        "--variants: unknown variant 'held-outt'; valid: tune-base, tune-scaled, tune-few, held-dense, held-big, "
        "held-coarse, or a group: tuning, held-out"
    )


@pytest.mark.parametrize(
    "argv, where",
    [
        (["--stage", "--img-size 64 --dataset-kwargs clutter_size=4"], "--stage 1"),
        (["--stage", "--epochs 1", "--stage", "--dataset-kwargs=seed=3"], "--stage 2"),
        (["--", "--dataset-kwargs", "seed=3"], "after --"),
    ],
)
def test_dataset_options_of_a_stage_are_refused_with_variants(capsys, argv, where):
    with pytest.raises(SystemExit):
        accuracy.parse_args(["--attn", "floor", "--variants", "tune-base", *argv])
    assert capsys.readouterr().err.splitlines()[-1].endswith(
        f"{where}: --dataset-kwargs is set by --variants in every stage; leave it out"
    )
    accuracy.parse_args(["--attn", "floor", *argv])  # without variants a stage sets them


def test_a_variant_of_another_dataset_than_the_recipe_s_stops_before_any_run(tmp_path, capsys):
    argv = ["--attn", "floor", "--variants", "tune-base", "--run-root", str(tmp_path / "runs"), "--", *SMALL]
    assert accuracy.main(argv) == 2  # the default recipe is configs/digits.yaml
    assert ("--variants tune-base: a variant of cluttered-digits, but the recipe trains on digits"
            in capsys.readouterr().err)
    assert not (tmp_path / "runs").exists()


# -- a table over variants (train.py faked) ------------------------------------------------------------------
def variant_argv(tmp_path: Path) -> list[str]:
    return ["--config", CURRICULUM, "--attn", "timm", "floor", "--variants", "tune-base", "held-big",
            "--stage", "--img-size 64 --epochs 2", "--run-root", str(tmp_path / "runs"),
            "--output", str(tmp_path / "tables" / "v.md"), "--", *SMALL]


def test_variant_options_reach_every_stage_and_runs_go_to_the_variant_s_folder(tmp_path):
    args, train_args = accuracy.parse_args(variant_argv(tmp_path))
    runs = plan.plan(accuracy.grid(args, train_args))
    every_run = plan.all_runs(runs)
    root = tmp_path / "runs"
    assert [run.run_dir.relative_to(root) for run in every_run] == [
        Path(path) for path in ("tune-base/timm/seed0-stage1", "tune-base/timm/seed0", "tune-base/floor/seed0-stage1",
                                "tune-base/floor/seed0", "held-big/timm/seed0-stage1", "held-big/timm/seed0",
                                "held-big/floor/seed0-stage1", "held-big/floor/seed0")
    ]
    for run in every_run:
        variant = variants.VARIANTS[run.variant]
        assert run.run_dir.relative_to(root).parts[0] == variant.name
        config = plan.expected_config(run.argv)
        assert config.dataset_kwargs == variant.dataset_kwargs
        assert json.loads(run.argv[run.argv.index("--dataset-kwargs") + 1]) == variant.dataset_kwargs
        assert config.img_size == (64 if run.stage == 1 else 128)
    assert plan.run_name(runs[2]) == "held-big: timm seed 0"
    assert plan.run_name(runs[2].previous) == "held-big: timm seed 0 (stage 1)"


def test_a_table_per_variant_and_a_summary_row_per_variant_and_attention(tmp_path, monkeypatch, capsys):
    commands: list[list[str]] = []
    # timm spends its first two epochs of stage 1 at chance on held-big (10 classes, 50 images: below 0.2273)
    first_stage_accs = {("tune-base", "timm"): (0.5, 0.6), ("tune-base", "floor"): (0.1, 0.6),
                        ("held-big", "timm"): (0.2, 0.22, 0.5), ("held-big", "floor"): (0.3,)}

    def fake_train(command, **kwargs):
        commands.append(command)
        run_dir = Path(command[command.index("--run-dir") + 1])
        variant, row, folder = run_dir.relative_to(tmp_path / "runs").parts
        config = plan.expected_config(command[2:-1])
        if folder.endswith("stage1"):
            finish_at(run_dir, config, 0.3, first_stage_accs[variant, row], wall_time_s=10.0)
        else:
            finish_at(run_dir, config, 0.9 if row == "timm" else 0.6, (0.1, 0.8), wall_time_s=25.0)
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(execute, "run_train_process", fake_train)
    assert accuracy.main(variant_argv(tmp_path)) == 0
    assert len(commands) == 2 * 2 * 2  # variants x rows x stages
    for command in commands:
        run_dir = Path(command[command.index("--run-dir") + 1])
        variant = variants.VARIANTS[run_dir.relative_to(tmp_path / "runs").parts[0]]
        assert plan.expected_config(command[2:-1]).dataset_kwargs == variant.dataset_kwargs
    out = capsys.readouterr().out
    assert "held-big: floor seed 0 (stage 1): started" in out
    tables = tmp_path / "tables"
    assert {path.name for path in tables.iterdir()} == {
        f"{stem}.{suffix}" for stem in ("v-tune-base", "v-held-big") for suffix in ("md", "png", "json", "csv")
    } | {"v.md", "v.json"}
    summary = (tables / "v.md").read_text()
    lines = summary.splitlines()
    assert lines[0].startswith("Command: `python -m visattn.experiments.accuracy --config ")
    assert "--variants tune-base held-big --stage '--img-size 64 --epochs 2'" in lines[0]
    assert lines[2:8] == [
        "| variant | group | attention | test accuracy, median [min–max] (seeds) | s, all stages (median) | "
        "epochs at chance |",
        "|---|---|---|---:|---:|---:|",
        "| tune-base | tuning | timm | 90.00% (1) | 35 | 0 |",
        "| tune-base | tuning | floor | 60.00% (1) | 35 | 1 |",
        "| held-big | held-out | timm | 90.00% (1) | 35 | 2 |",
        "| held-big | held-out | floor | 60.00% (1) | 35 | 0 |",
    ]
    assert "[held-big](v-held-big.md)" in summary
    assert "Recipe decisions are made on the tuning variants and reported on the held-out ones" in summary
    held_big = (tables / "v-held-big.md").read_text()
    assert held_big.splitlines()[2].startswith("| timm | 90.00% (1) | 2 |")
    assert "cluttered-digits variant held-big (options {'seed': 12, 'train_size': 3000" in held_big
    saved = json.loads((tables / "v.json").read_text())
    assert [(row["variant"], row["group"], row["row"], row["epochs_at_chance"]) for row in saved["rows"]] == [
        ("tune-base", "tuning", "timm", [0]), ("tune-base", "tuning", "floor", [1]),
        ("held-big", "held-out", "timm", [2]), ("held-big", "held-out", "floor", [0]),
    ]
    records = json.loads((tables / "v-held-big.json").read_text())["runs"]
    assert {(record["variant"], record["epochs_at_chance"]) for record in records if record["row"] == "timm"} == {
        ("held-big", 2)
    }  # the first stage's count, on every stage's record


def finish_at(run_dir: Path, config, test_acc: float, val_accs: tuple[float, ...], wall_time_s: float) -> None:
    run = plan.Run(plan.parse_rows(["floor"])[0], 0, run_dir, argv=[])
    finish(run, test_acc, config=config, val_accs=val_accs, wall_time_s=wall_time_s)


# -- epochs at chance -----------------------------------------------------------------------------------------
def test_the_chance_threshold_is_chance_plus_three_standard_errors():
    # by hand: 10 classes, 1,000 images: 0.1 + 3 * sqrt(0.1 * 0.9 / 1000) = 0.1 + 3 * 0.0094868 = 0.128460
    assert math.isclose(summarize.chance_threshold(10, 1000), 0.128460, abs_tol=1e-6)
    # 2 classes, 100 images: 0.5 + 3 * sqrt(0.25 / 100) = 0.5 + 3 * 0.05
    assert math.isclose(summarize.chance_threshold(2, 100), 0.65)


def test_epochs_at_chance_counts_the_leading_epochs_below_the_threshold():
    def history(accs, split="val", samples=1000):
        return [{"epoch": epoch, f"{split}_acc": acc, f"{split}_samples": samples} for epoch, acc in enumerate(accs, 1)]

    # 0.128 is below 0.128460, 0.1285 is not; a later dip does not count
    assert summarize.epochs_at_chance(history([0.10, 0.128, 0.1285, 0.11]), 10) == 2
    assert summarize.epochs_at_chance(history([0.13, 0.10]), 10) == 0
    assert summarize.epochs_at_chance(history([0.1, 0.1, 0.1]), 10) == 3
    assert summarize.epochs_at_chance(history([0.6, 0.7], samples=100), 2) == 1  # threshold 0.65
    assert summarize.epochs_at_chance(history([0.6, 0.7], split="test", samples=100), 2) == 1  # no validation split


def test_a_run_s_epochs_at_chance_are_its_first_stage_s():
    first = plan.Run(plan.parse_rows(["floor"])[0], 0, Path("runs/floor/seed0-stage1"), argv=[], status="finished",
                     stage=1, last=False, num_classes=10)
    first.history = [{"epoch": e, "val_acc": acc, "val_samples": 1000} for e, acc in enumerate((0.1, 0.11, 0.5), 1)]
    last = plan.Run(first.row, 0, Path("runs/floor/seed0"), argv=[], status="finished", stage=2, previous=first,
                    num_classes=10)
    last.history = [{"epoch": 1, "val_acc": 0.1, "val_samples": 1000}]
    assert summarize.run_epochs_at_chance(last) == 2 and summarize.run_epochs_at_chance(first) == 2
    first.status = "failed"
    assert summarize.run_epochs_at_chance(last) is None
