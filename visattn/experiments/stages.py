"""The runs a resolution table tests: the first stages of a curriculum table's rows and seeds, or runs named
by path, each with the second stage that trained it on at the larger size."""
from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

from visattn.experiments.plan import Row, run_folder
from visattn.experiments.summarize import FinishedRun, read_finished, started_from
from visattn.train import ConfigError

# What a second stage must share with its first: the model and the data, all but the image size.
SAME_IN_BOTH_STAGES = ("model", "attn", "attn_kwargs", "patch_size", "embed_dim", "depth", "num_heads", "mlp_ratio",
                       "global_pool", "class_token", "model_kwargs", "dataset", "dataset_kwargs")


def first_stage(row_dir: Path, seed: int) -> Path:
    """``<row_dir>/seed<seed>-stage1``; ValueError where the row's curriculum has more than one earlier stage:
    its ``seed<k>`` starts from the last of them, not from ``seed<k>-stage1``, so it is no second stage of it."""
    first = run_folder(seed, 1)
    later: dict[int, str] = {}  # stage number: folder name
    for path in row_dir.glob(f"{run_folder(seed)}-stage*"):
        match = re.fullmatch(rf"{run_folder(seed)}-stage([1-9]\d*)", path.name)  # not the table's logs beside them
        if match and int(match[1]) > 1:
            later[int(match[1])] = path.name
    if later:
        raise ValueError(
            f"--run-root: {row_dir} holds {', '.join(later[number] for number in sorted(later))} beside "
            f"{first}: a curriculum of more than one earlier stage; accepted: a table trained with one --stage"
        )
    return row_dir / first


def table_stages(run_root: Path, rows: list[Row], seeds: list[int]) -> list[FinishedRun]:
    """The first stages of a table's rows and seeds, each with its second stage (``seed<k>`` beside it)."""
    stages = []
    for row in rows:
        for seed in seeds:
            stage = read_finished(row.label, seed, first_stage(run_root / row.folder, seed))
            stages.append(replace(stage, second_stage=stage.run_dir.parent / run_folder(seed)))
    return stages


def check_second_stage(first: FinishedRun, second: FinishedRun, img_size: int) -> None:
    """ValueError, one line, unless ``second`` is ``first``'s model trained on at ``img_size``: trained at that
    size with the same model and data, from a checkpoint in ``first``'s folder or, where that checkpoint no
    longer exists (``first`` renamed since), in the folder ``first`` recorded as its ``run_dir``."""
    trained = second.config.image_hw
    if trained != (img_size, img_size):
        raise ValueError(f"--runs: {second.run_dir} was trained at {trained[0]}x{trained[1]} px, not at --img-size "
                         f"{img_size}: not a second stage of {first.run_dir} at that size")
    start = second.config.initial_checkpoint
    recorded = first.config.run_dir
    if start is not None and Path(start).exists():
        source = started_from(second.config)
        from_first = source is not None and source.resolve() == first.run_dir.resolve()
    else:  # a checkpoint gone since, in the folder first recorded as its run_dir
        from_first = (start is not None and recorded is not None
                      and Path(start).resolve().is_relative_to(Path(recorded).resolve()))
    if not from_first:
        also = f" or the folder it recorded as its run_dir ({recorded})" if recorded else ""
        raise ValueError(f"--runs: {second.run_dir} starts from {start or 'no checkpoint'}, not from {first.run_dir}"
                         f"{also}; accepted: a run trained with --initial-checkpoint {first.run_dir}")
    differ = [name for name in SAME_IN_BOTH_STAGES if getattr(first.config, name) != getattr(second.config, name)]
    if differ:
        raise ValueError(f"--runs: {second.run_dir} differs from {first.run_dir} in {', '.join(differ)}; accepted: "
                         f"the same model and data at another image size")


def named_stages(runs: list[tuple[Path, Path | None]], img_size: int) -> list[FinishedRun]:
    """Each run of ``--runs`` as a row named by its path, with the seed it was trained with and its second
    stage, checked by :func:`check_second_stage`. ValueError, one line naming the run, otherwise."""
    stages = []
    for first, second in runs:
        stage = read_finished(str(first), 0, first)
        stage = replace(stage, seed=stage.config.seed, second_stage=second)
        if second is not None:
            try:
                stage_two = read_finished(str(first), stage.seed, second)
            except (ValueError, OSError) as error:
                raise ValueError(f"--runs: second stage of {first}: {error}") from None
            check_second_stage(stage, stage_two, img_size)
        stages.append(stage)
    return stages


def second_stage_accuracy(stage: FinishedRun, img_size: int) -> float | None:
    """The test accuracy of ``stage``'s second stage, if it has one that finished at ``img_size``."""
    if stage.second_stage is None:
        return None
    try:
        stage_two = read_finished(stage.row, stage.seed, stage.second_stage)
    except (ValueError, ConfigError, OSError):
        return None
    return stage_two.summary["test_acc"] if stage_two.config.image_hw == (img_size, img_size) else None
