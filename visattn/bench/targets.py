"""The speed and memory targets of visattn.

:data:`TARGETS`: each target names a point of the model sweep (mode, square image size, batch size), a
type (or :data:`OTHER_TYPES`), a measure and a threshold; :func:`check_targets` judges the ones a run
measured. They are set for ViT-S/16 in fp32 with each type's default options (:data:`TARGET_SETTING`),
on a 2-core CPU; :data:`GPU_TARGETS` for the same model in bf16 on one NVIDIA H100 or H200
(:data:`GPU_TARGET_SETTING`). Rows of another setting are not judged. A speed target is met only when the median of
its per-round ratio (:mod:`visattn.bench.ratios`) clears the threshold; where the ratio's interquartile
range straddles the threshold, the verdict says that the spread decided it (a rerun may turn it). Targets
that are not a ratio at one point (the scaling exponents, the largest image that trains) are judged in
the README from the summary and from their own runs.
"""
from __future__ import annotations

import operator
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from visattn.bench.ratios import Spread, rate_ratio
from visattn.bench.sweep import DEFAULT_MODEL, FLOOR, TIMM, Result
from visattn.layers import list_attentions

# What a target is stated for: rows whose case differs in any of these fields are not judged.
TARGET_SETTING: dict[str, Any] = {
    "kind": "model", "model_name": DEFAULT_MODEL, "timm_name": "vit_small_patch16_224", "device": "cpu",
    "dtype": "fp32", "compile": False, "grad_checkpointing": False, "model_kwargs": {}, "attn_kwargs": {},
}
GPU_TARGET_SETTING: dict[str, Any] = TARGET_SETTING | {"device": "cuda", "dtype": "bf16"}
# A target for every measured type (floor aside) without a target of the same measure at its point.
OTHER_TYPES = "every other type"
# Rounds a speed ratio should rest on; a verdict on fewer says so.
MIN_ROUNDS = 5

# measure: (unit of the threshold, what it is of)
MEASURES = {
    "pct_of_floor": ("%", "of floor's images/s"),
    "speedup_vs_timm": ("x", "timm's images/s"),
    "peak_mem_vs_floor": ("x", "floor's peak memory"),
}
_OPERATORS = {">=": operator.ge, ">": operator.gt, "<=": operator.le}


@dataclass(frozen=True)
class Target:
    """``attn``'s ``measure`` at one point (``mode``, ``size`` x ``size`` px, ``batch_size``) ``op`` ``threshold``."""

    attn: str  # a registry name, or OTHER_TYPES
    mode: str  # "infer" or "train"
    size: int  # square image, pixels
    batch_size: int
    measure: str  # a key of MEASURES
    op: str  # a key of _OPERATORS
    threshold: float  # percent for pct_of_floor, a factor otherwise

    def describe(self, attn: str) -> str:
        """E.g. ``infer 2048² batch 1: linear >= 95% of floor's images/s``, for row ``attn``."""
        unit, what = MEASURES[self.measure]
        return f"{self.mode} {self.size}² batch {self.batch_size}: {attn} {self.op} {self.threshold:g}{unit} {what}"

    def is_met(self, value: float) -> bool:
        return _OPERATORS[self.op](value, self.threshold)


def _targets(mode: str, size: int, batch_size: int, measure: str, op: str, thresholds: Mapping[str, float]) -> list[Target]:
    return [Target(attn, mode, size, batch_size, measure, op, t) for attn, t in thresholds.items()]


TARGETS: tuple[Target, ...] = (
    # batch 1
    *_targets("infer", 2048, 1, "pct_of_floor", ">=", {
        "linear": 95, "axial": 85, "linformer": 85, "neighborhood": 80, "sparse": 80, "longformer": 80,
    }),
    *_targets("infer", 2048, 1, "speedup_vs_timm", ">=", {"linear": 6}),
    *_targets("infer", 1024, 1, "pct_of_floor", ">=", {"linear": 90}),
    *_targets("train", 1024, 1, "pct_of_floor", ">=", {"linear": 90, "axial": 80}),
    *_targets("train", 1024, 1, "peak_mem_vs_floor", "<=", {"linear": 1.25, "axial": 1.25}),
    # the crossover: linear beats timm from 576 tokens (384²) at every larger size
    *(t for mode in ("infer", "train") for size in (384, 512, 1024)
      for t in _targets(mode, size, 1, "speedup_vs_timm", ">", {"linear": 1})),
    # batched
    *_targets("infer", 512, 16, "pct_of_floor", ">=", {"linear": 90, "axial": 85, OTHER_TYPES: 75}),
    *_targets("infer", 512, 16, "speedup_vs_timm", ">=", {"linear": 1.2}),
    *_targets("infer", 224, 64, "pct_of_floor", ">=", {OTHER_TYPES: 85}),
    *_targets("train", 512, 16, "pct_of_floor", ">=", {"linear": 85}),
    *_targets("train", 512, 16, "speedup_vs_timm", ">", {"linear": 1}),
    *_targets("train", 1024, 4, "pct_of_floor", ">=", {"linear": 80, "axial": 80}),
    *_targets("train", 1024, 4, "peak_mem_vs_floor", "<=", {"linear": 1.25, "axial": 1.25}),
)


# One NVIDIA H100 or H200, bf16 (GPU_TARGET_SETTING): where the types must win for a GPU user to want them.
GPU_TARGETS: tuple[Target, ...] = (
    *_targets("infer", 2048, 4, "speedup_vs_timm", ">=", {
        "linear": 5, "axial": 4, "neighborhood": 3, "sparse": 3, "longformer": 3,
    }),
    *_targets("infer", 2048, 4, "pct_of_floor", ">=", {"linear": 75}),
    *_targets("infer", 1024, 16, "speedup_vs_timm", ">=", {"linear": 2, OTHER_TYPES: 1.5}),
    *_targets("infer", 224, 128, "speedup_vs_timm", ">=", {OTHER_TYPES: 0.8}),
    *_targets("train", 1024, 8, "speedup_vs_timm", ">=", {"linear": 2}),
    *_targets("train", 1024, 8, "peak_mem_vs_floor", "<=", {"linear": 1.2}),
    *_targets("train", 2048, 2, "speedup_vs_timm", ">=", {"linear": 4}),
)


def target_sets() -> tuple[tuple[tuple[Target, ...], Mapping[str, Any]], ...]:
    """(targets, the setting their rows must have): what :func:`check_targets` judges by default."""
    return (TARGETS, TARGET_SETTING), (GPU_TARGETS, GPU_TARGET_SETTING)


@dataclass(frozen=True)
class Verdict:
    """One target judged on one row: ``value`` is the median of a speed ratio (its spread beside it) or
    the peak-memory ratio (no spread); None where the row did not run (``why``)."""

    target: Target
    attn: str  # the row judged: the target's type, or one of OTHER_TYPES
    value: float | None
    spread: Spread | None = None
    why: str = ""

    @property
    def met(self) -> bool:
        return self.value is not None and self.target.is_met(self.value)

    @property
    def decided_by_spread(self) -> bool:
        """The interquartile range straddles the threshold: the median decided, a rerun may not agree."""
        return self.spread is not None and self.spread.straddles(self.target.threshold)

    @property
    def too_few_rounds(self) -> bool:
        return self.spread is not None and self.spread.rounds < MIN_ROUNDS


def in_setting(result: Result, setting: Mapping[str, Any]) -> bool:
    """Whether the row's case has every value of ``setting`` (a device by its type: ``cuda:1`` is ``cuda``)."""
    def value_of(key: str) -> Any:
        value = getattr(result.case, key)
        return value.split(":")[0] if key == "device" else value

    return all(value_of(key) == value for key, value in setting.items())


def _judge(target: Target, attn: str, rows: Mapping[str, Result]) -> Verdict | None:
    """The verdict on row ``attn`` of one point (``rows``: {attn: result}); None where the run lacks the row
    or the reference (not asked for)."""
    own, floor = rows.get(attn), rows.get(FLOOR)
    reference = rows.get(TIMM) if target.measure == "speedup_vs_timm" else floor
    if own is None or reference is None:
        return None
    for row in (own, reference):
        if not row.ok:
            return Verdict(target, attn, None, why=f"{row.case.attn}: {row.status}")
    if target.measure == "peak_mem_vs_floor":
        if not (own.peak_bytes and reference.peak_bytes):
            return Verdict(target, attn, None, why="no peak memory")
        return Verdict(target, attn, own.peak_bytes / reference.peak_bytes)
    ratio = rate_ratio(own, reference, link=floor)
    if ratio is None:
        return Verdict(target, attn, None, why="no round connects the rows")
    if target.measure == "pct_of_floor":
        ratio = ratio.scaled(100)
    return Verdict(target, attn, ratio.median, ratio)


def check_targets(
    results: list[Result], targets: tuple[Target, ...] | None = None, setting: Mapping[str, Any] | None = None
) -> list[Verdict]:
    """The verdicts on every target at a point this run measured, in the order of ``targets`` (an
    :data:`OTHER_TYPES` target in the run's row order), on the rows of ``setting``; by default every set of
    :func:`target_sets` on the rows of its own setting."""
    if targets is None and setting is None:
        return [v for own, own_setting in target_sets() for v in check_targets(results, own, own_setting)]
    targets = TARGETS if targets is None else targets
    setting = TARGET_SETTING if setting is None else setting
    points: dict[tuple[str, tuple[int, int], int], dict[str, Result]] = {}
    for r in results:
        if in_setting(r, setting):
            points.setdefault((r.case.mode, r.case.size, r.case.batch_size), {})[r.case.attn] = r
    types = [name for name in list_attentions() if name != FLOOR]
    verdicts = []
    for target in targets:
        rows = points.get((target.mode, (target.size, target.size), target.batch_size))
        if rows is None:
            continue
        if target.attn == OTHER_TYPES:
            named = {t.attn for t in targets if t.measure == target.measure and t.mode == target.mode
                     and t.size == target.size and t.batch_size == target.batch_size}
            names = [attn for attn in rows if attn in types and attn not in named]
        else:
            names = [target.attn]
        verdicts += [v for v in (_judge(target, attn, rows) for attn in names) if v is not None]
    return verdicts

