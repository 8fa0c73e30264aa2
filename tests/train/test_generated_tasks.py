"""The generated tasks: seeded and reproducible, drawn per sample as they always were, balanced, disjoint splits,
labels that the pixels bear out (a flood fill for pathfinder, the digit's own pixels for cluttered-digits), memory
that does not grow with the split, and normalisation statistics that are never trusted when they are not whole."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from scipy import ndimage

from tests.helpers import load_script
from visattn.bench.flops import ViTShape, estimate_memory, train_flops
from visattn.layers import get_attention
from visattn.train import overview, progress
from visattn.train.attention import resolve_attention
from visattn.train.build import build_model
from visattn.train.cli import parse_args
from visattn.train.config import ConfigError, make_config
from visattn.train.data import DataSplits, build_transform, load_splits
from visattn.train.generated_tasks import TASKS, GeneratedDataset, drawn_as, load_generated, statistics, task_options
from visattn.train.generated_tasks import cluttered_digits as cd
from visattn.train.generated_tasks import pathfinder as pf
from visattn.train.generated_tasks.common import SPLITS
from visattn.train.run_log import SUMMARY_FILE, significant

REPO = Path(__file__).resolve().parents[2]
PF_HW = (128, 128)  # the published geometry is for 128 px; smaller canvases scale strokes below 2 px
CD_HW = (64, 64)
# A flood fill over the rendered ink must cross a curve's dash gaps (2-3 px) but not the clearance
# between curves (7 px between stroke edges): every inked pixel grown by a disk of this radius.
BRIDGE_RADIUS = 2


def small(task: str, **values) -> object:
    sizes = dict(train_size=20, val_size=10, test_size=10)
    hw = PF_HW if task == "pathfinder" else CD_HW
    return task_options(task, {**sizes, **values}, hw)


def draw(task: str, options: object, split: str = "train") -> dict[str, np.ndarray]:
    """Every sample of ``split``, each drawn alone as the dataset serves it, stacked: images (n, H, W), labels (n,)..."""
    hw = PF_HW if task == "pathfinder" else CD_HW
    dataset = GeneratedDataset(TASKS[task], options, hw, split)
    samples = [dataset.sample(index) for index in range(len(dataset))]
    return {name: np.stack([sample[name] for sample in samples]) for name in samples[0]}


def joined_in_image(image: np.ndarray, markers: np.ndarray) -> bool:
    """Whether the inked pixels, grown by BRIDGE_RADIUS, join the two marker centres (x, y)."""
    yy, xx = np.mgrid[-BRIDGE_RADIUS:BRIDGE_RADIUS + 1, -BRIDGE_RADIUS:BRIDGE_RADIUS + 1]
    grown = ndimage.binary_dilation(image > 0, structure=xx**2 + yy**2 <= BRIDGE_RADIUS**2)
    regions, _ = ndimage.label(grown)
    first, second = (regions[int(round(y)), int(round(x))] for x, y in markers)
    assert first and second, "a marker centre is not inked"
    return first == second


def segment_distance(a0: np.ndarray, a1: np.ndarray, b0: np.ndarray, b1: np.ndarray) -> float:
    """Distance between segments a0-a1 and b0-b1 (points (x, y)), from 41 points along each."""
    t = np.linspace(0, 1, 41)[:, None]
    a, b = a0 + t * (a1 - a0), b0 + t * (b1 - b0)
    return float(np.sqrt(((a[:, None] - b[None]) ** 2).sum(-1)).min())


# -- determinism ---------------------------------------------------------------------------------
@pytest.mark.parametrize("task", sorted(TASKS))
def test_same_seed_same_bytes_other_seed_other_images(task):
    first, again = draw(task, small(task)), draw(task, small(task))
    for name in first:
        assert first[name].tobytes() == again[name].tobytes(), name
    other = draw(task, small(task, seed=1))
    assert not np.array_equal(first["images"], other["images"])
    assert all(not np.array_equal(a, b) for a, b in zip(first["images"], other["images"]))


@pytest.mark.parametrize("task", sorted(TASKS))
def test_a_sample_depends_on_its_seed_split_and_index_only(task):
    options = small(task)
    hw = PF_HW if task == "pathfinder" else CD_HW
    together = TASKS[task].generate(options, hw, "train", np.arange(20))
    alone = draw(task, options)
    for name in together:
        assert together[name].tobytes() == alone[name].tobytes(), name
    backwards = TASKS[task].generate(options, hw, "train", np.array([13, 4]))
    assert np.array_equal(backwards["images"], alone["images"][[13, 4]])
    dataset = GeneratedDataset(TASKS[task], options, hw, "train")
    image, label = dataset[13]
    assert image.mode == "RGB" and np.array_equal(np.asarray(image)[..., 0], alone["images"][13]) and label == alone["labels"][13]
    for outside in (-1, 20):
        with pytest.raises(IndexError):
            dataset[outside]


# Samples as the code before drawing on demand drew them (its split files held these bytes), as SHA-256 (first 32 hex
# digits) of each image's bytes followed by its label as int64: the quick start's 1024 px canvases, a 2048 px one,
# the recipes', the curriculum's first stage, variants with placements and digit_size_max, pathfinder's levels.
CURRICULUM = dict(train_size=4000, val_size=1000, test_size=1000, clutter_size=8)
TUNE_FEW = dict(seed=2, train_size=2000, val_size=1000, test_size=1000, digit_size=32, clutter_size=16,
                clutter_count=16, placements=10)
TUNE_SCALED = dict(seed=1, train_size=4000, val_size=1000, test_size=1000, digit_size=24, digit_size_max=40,
                   clutter_size=12, clutter_count=24)
LONE_CURVES = dict(level="easy", contour_length=2, distractors=0)
DRAWN_BEFORE = [
    ("cluttered-digits", {}, 1024, "train", 0, "a0a54a2a2fd2cced3793f832baf0b3f2"),
    ("cluttered-digits", {}, 1024, "train", 1, "5b11104f31c8fdc7c11fed0d9bd070ea"),
    ("cluttered-digits", {}, 1024, "train", 9999, "d41733b52321f6616786133acb3ef8b0"),
    ("cluttered-digits", {}, 1024, "val", 5, "83ae1bc4cf14ba044cdbce763fae20d9"),
    ("cluttered-digits", {}, 1024, "test", 1999, "f31fd760a9d95fca0b09ea620f00d099"),
    ("cluttered-digits", {}, 2048, "train", 0, "20f77ccb1982153a4799c661bc9994b6"),
    ("cluttered-digits", {}, 128, "train", 0, "17b1d9167799aefeb76b42e9e496a28e"),
    ("cluttered-digits", {}, 128, "train", 7, "baa54bfd4922e592ac9f2b7af8af45b6"),
    ("cluttered-digits", {}, 128, "train", 4242, "8516ad6561c304b321dbb27da9e5545c"),
    ("cluttered-digits", CURRICULUM, 64, "train", 3, "b69b5beb256f937b44e430b87ab1ad64"),
    ("cluttered-digits", TUNE_FEW, 128, "train", 0, "a7731a84381b368a690efec8d627673b"),
    ("cluttered-digits", TUNE_FEW, 128, "train", 1234, "329acb3f1bd1994ef7aec80a7a90a8da"),
    ("cluttered-digits", TUNE_SCALED, 128, "train", 5, "4fb85528026b610bdfcec8f447b48f3e"),
    ("pathfinder", {}, 128, "train", 0, "a3053a1c340afb71f6846cc1e2ed86c4"),
    ("pathfinder", {}, 128, "train", 1, "ab2285ffcc57a7d2837b14b79c9c3d6f"),
    ("pathfinder", {}, 128, "test", 7, "7b62669bfe2f916d5973a4cfe14306df"),
    ("pathfinder", LONE_CURVES, 64, "val", 3, "d1d4fcb58c247d7e559945b061edc7de"),
    ("pathfinder", {}, 1024, "train", 1, "8296e8ed9c91314889197dc108bc1e30"),
]


@pytest.mark.parametrize("task, values, side, split, index, expected", DRAWN_BEFORE)
def test_a_sample_drawn_on_demand_is_the_one_the_split_files_held(task, values, side, split, index, expected):
    options, hw = drawn_as(task_options(task, values, (side, side)), (side, side))
    dataset = GeneratedDataset(TASKS[task], options, hw, split)
    image, label = dataset[index]
    grey = np.asarray(image)[..., 0]
    assert image.size == (side, side) and np.array_equal(grey, dataset.sample(index)["images"])
    digest = hashlib.sha256(np.ascontiguousarray(grey).tobytes() + np.int64(label).tobytes()).hexdigest()[:32]
    assert digest == expected


# -- balance and splits --------------------------------------------------------------------------
@pytest.mark.parametrize("task", sorted(TASKS))
def test_classes_are_balanced(task):
    labels = draw(task, small(task))["labels"]
    classes = TASKS[task].num_classes
    assert np.array_equal(np.bincount(labels, minlength=classes), np.full(classes, len(labels) // classes))


@pytest.mark.parametrize("task", sorted(TASKS))
def test_splits_share_no_image(task):
    options = small(task)
    seen: dict[str, str] = {}
    for split in SPLITS:
        for image in draw(task, options, split)["images"]:
            digest = hashlib.sha256(image.tobytes()).hexdigest()
            assert seen.setdefault(digest, split) == split, f"an image of {split} is also in {seen[digest]}"


def test_cluttered_digits_splits_draw_on_disjoint_source_digits():
    _, labels, pools = cd.source_digits(32)
    assert sum(len(pool) for pool in pools.values()) == len(labels) == 1797
    assert len(np.unique(np.concatenate(list(pools.values())))) == 1797
    options = small("cluttered-digits")
    for split in SPLITS:
        assert np.isin(draw("cluttered-digits", options, split)["placement"][:, 3], pools[split]).all()
        assert set(labels[pools[split]]) == set(range(10))


# -- pathfinder: the label is what the pixels show --------------------------------------------------
def dashed_line(start: tuple[float, float], end: tuple[float, float], gap: float, curve: int) -> list[np.ndarray]:
    """Paddles of length 5 with ``gap`` between them from ``start`` towards ``end`` (x, y)."""
    start_xy, end_xy = np.array(start, float), np.array(end, float)
    unit = (end_xy - start_xy) / np.linalg.norm(end_xy - start_xy)
    paddles, at = [], start_xy
    while np.linalg.norm(end_xy - at) >= 5:
        paddles.append(np.stack([at, at + 5 * unit]))
        at = at + (5 + gap) * unit
    return paddles


def hand_scene(lines: list[list[np.ndarray]], markers: list[tuple[float, float]], marker_curves: tuple[int, int]) -> pf.Scene:
    paddles = [paddle for line in lines for paddle in line]
    curve_of = [curve for curve, line in enumerate(lines) for _ in line]
    return pf.Scene(
        paddles=np.stack(paddles), curve_of=np.array(curve_of), markers=np.array(markers, float),
        marker_curves=marker_curves, height=128, width=128, geometry=pf.GEOMETRY,
    )


@pytest.mark.parametrize("gap", [2.0, 3.0])
@pytest.mark.parametrize("end", [(108.0, 64.0), (100.0, 100.0)], ids=["horizontal", "diagonal"])
def test_a_straight_dashed_line_between_the_markers_joins_them(gap, end):
    line = dashed_line((20.0, 64.0), end, gap, curve=0)
    scene = hand_scene([line], [tuple(line[0][0]), tuple(line[-1][1])], (0, 0))
    assert scene.connected
    assert joined_in_image(pf.render(scene), scene.markers)


def test_two_dashed_lines_a_clearance_apart_do_not_join():
    g = pf.GEOMETRY
    apart = g.paddle_thickness + g.clearance  # between centre lines: the generator's closest
    upper = dashed_line((20.0, 60.0), (80.0, 60.0), 3.0, curve=0)
    lower = dashed_line((50.0, 60.0 + apart), (108.0, 60.0 + apart), 3.0, curve=1)
    markers = [tuple(upper[0][0]), tuple(lower[-1][1])]
    scene = hand_scene([upper, lower], markers, (0, 1))
    assert not scene.connected
    assert not joined_in_image(pf.render(scene), scene.markers)
    # the same lines with one stroke across do join: the check can fail
    bridge = [np.array([[64.0, 60.0], [64.0, 60.0 + apart]])]
    bridged = hand_scene([upper, lower, bridge], markers, (0, 1))
    assert joined_in_image(pf.render(bridged), bridged.markers)


@pytest.mark.parametrize("level", sorted(pf.LEVELS))
def test_every_pathfinder_label_matches_the_paddle_graph_and_a_flood_fill(level):
    options = small("pathfinder", level=level, val_size=40)
    arrays = draw("pathfinder", options, "val")
    for index, (image, label, markers) in enumerate(zip(arrays["images"], arrays["labels"], arrays["markers"])):
        scene = pf.scene_of(options, PF_HW, "val", index)
        assert np.array_equal(pf.render(scene), image) and np.allclose(scene.markers, markers)
        assert label == scene.connected == (index % 2 == 1)
        first_curve = scene.paddles[scene.curve_of == scene.marker_curves[0]]
        second_curve = scene.paddles[scene.curve_of == scene.marker_curves[1]]
        assert np.allclose(markers[0], first_curve[0, 0]) and np.allclose(markers[1], second_curve[-1, 1])
        assert len(first_curve) == len(second_curve) == pf.LEVELS[level].contour_length
        assert joined_in_image(image, markers) == bool(label), f"sample {index}: label {label}"


def test_pathfinder_curves_keep_their_clearance_and_stay_smooth():
    g = pf.GEOMETRY
    # a paddle may come near its curve's last two (the claims of a paddle 8.5 px + slack wide reach that far)
    exempt = pf._Claims(128, 128, g, point_spacing=1.0).exempt_neighbours
    assert exempt == 2
    for index in range(6):
        scene = pf.scene_of(small("pathfinder", level="easy"), PF_HW, "train", index)
        ends = {(c, end) for c in (0, 1) for end in (0, -1)}
        for i, (a0, a1) in enumerate(scene.paddles):
            for j in range(i + 1, len(scene.paddles)):
                if scene.curve_of[i] == scene.curve_of[j] and j <= i + exempt:
                    continue
                b0, b1 = scene.paddles[j]
                assert segment_distance(a0, a1, b0, b1) >= g.paddle_thickness + g.clearance - 1e-6, (index, i, j)
            for curve, end in ends:
                if scene.curve_of[i] != curve:
                    tip = scene.paddles[scene.curve_of == curve][end][0 if end == 0 else 1]
                    assert segment_distance(a0, a1, tip, tip) >= g.marker_radius + g.paddle_thickness / 2 + g.clearance - 1e-6
        for curve in np.unique(scene.curve_of):
            paddles = scene.paddles[scene.curve_of == curve]
            directions = paddles[:, 1] - paddles[:, 0]
            angles = np.arctan2(directions[:, 1], directions[:, 0])
            turns = np.abs((np.diff(angles) + np.pi) % (2 * np.pi) - np.pi)
            assert (turns < np.pi / (2 * g.continuity)).all()
            gaps = np.linalg.norm(paddles[1:, 0] - paddles[:-1, 1], axis=1)
            assert np.isclose(gaps, g.paddle_gaps[0]).all() or np.isclose(gaps, g.paddle_gaps[1]).all()


@pytest.mark.parametrize("distractors", [0, 3])
def test_the_distractor_count_changes_only_the_distractors(distractors):
    for index in range(4):
        level_scene = pf.scene_of(small("pathfinder", level="easy"), PF_HW, "train", index)
        scene = pf.scene_of(small("pathfinder", level="easy", distractors=distractors), PF_HW, "train", index)
        targets = level_scene.curve_of < 2  # drawn before the distractors, from the same generator
        assert np.array_equal(scene.paddles[scene.curve_of < 2], level_scene.paddles[targets])
        assert set(np.unique(scene.curve_of)) == set(range(2 + distractors))
        assert (scene.curve_of >= 2).sum() == distractors * pf.LEVELS["easy"].distractor_length
        assert scene.connected == (index % 2 == 1)
        assert joined_in_image(pf.render(scene), scene.markers) == scene.connected


@pytest.mark.parametrize("contour_length", [2, 3, pf.MAX_CONTOUR_LENGTH])
def test_a_contour_length_sets_both_target_curves_and_keeps_the_labels_true(contour_length):
    options = small("pathfinder", level="easy", contour_length=contour_length, distractors=0)
    for index in range(6):
        scene = pf.scene_of(options, PF_HW, "val", index)
        assert [(scene.curve_of == curve).sum() for curve in np.unique(scene.curve_of)] == [contour_length] * 2
        assert scene.connected == (index % 2 == 1)
        assert joined_in_image(pf.render(scene), scene.markers) == scene.connected


def test_the_longest_contour_length_finds_room_on_the_smallest_image_among_distractors():
    options = small("pathfinder", level="hard", contour_length=pf.MAX_CONTOUR_LENGTH)
    for index in range(8):
        scene = pf.scene_of(options, (pf.MIN_SIDE, pf.MIN_SIDE), "train", index)
        assert (scene.curve_of == 0).sum() == (scene.curve_of == 1).sum() == pf.MAX_CONTOUR_LENGTH
        assert scene.connected == (index % 2 == 1)


def test_harder_levels_draw_longer_paths():
    lengths = [pf.LEVELS[name].contour_length for name in ("easy", "intermediate", "hard")]
    assert lengths == [6, 9, 14]
    for level in ("easy", "hard"):
        scene = pf.scene_of(small("pathfinder", level=level), PF_HW, "test", 1)
        assert (scene.curve_of == 0).sum() == pf.LEVELS[level].contour_length


# -- cluttered digits: the label is the digit placed -------------------------------------------------
def test_the_placed_digit_is_the_label_and_its_core_is_untouched():
    options = small("cluttered-digits")
    images, labels, _ = cd.source_digits(options.digit_size)
    arrays = draw("cluttered-digits", options, "test")
    margin, size = options.clutter_size // 2, options.digit_size
    for canvas, label, (top, left, side, source) in zip(arrays["images"], arrays["labels"], arrays["placement"]):
        assert labels[source] == label and side == size
        digit = images[source]
        box = canvas[top:top + size, left:left + size]
        assert (box >= digit).all(), "clutter may add ink around the digit but never hides it"
        assert np.array_equal(box[margin:size - margin, margin:size - margin], digit[margin:size - margin, margin:size - margin])
        outside = canvas.copy()
        outside[top:top + size, left:left + size] = 0
        assert outside.any(), "a canvas has clutter"


def test_the_digit_core_matches_no_other_source_digit():
    """The core check can fail: the core of a digit of another class differs."""
    options = small("cluttered-digits")
    images, labels, _ = cd.source_digits(options.digit_size)
    canvas, label, where = cd.draw(options, CD_HW, "train", 3)
    other = int(np.flatnonzero(labels != label)[0])
    m, s = options.clutter_size // 2, options.digit_size
    core = canvas[where.top + m:where.top + s - m, where.left + m:where.left + s - m]
    assert not np.array_equal(core, images[other][m:s - m, m:s - m])


# Canvases drawn before digit_size_max and placements existed, as SHA-256 (first 32 hex digits) over the
# images, labels and (top, left, source digit) of samples 0, 1, 7, 123 and 3999: the defaults draw them still.
CANVASES_BEFORE_THE_VARIANT_OPTIONS = [
    ({}, (128, 128), "train", "5bfadec5411b90deee6720de14951392"),
    (dict(train_size=4000, val_size=1000, test_size=1000, clutter_size=8), (128, 128), "train",
     "a0090b108ae654374e83544d4726218c"),  # configs/cluttered-digits-curriculum.yaml
    (dict(train_size=4000, val_size=1000, test_size=1000, clutter_size=8), (128, 128), "test",
     "d81f8b4b511f5ff45ee977f82e55faac"),
    (dict(seed=3, digit_size=20, clutter_size=10, clutter_count=5), (64, 96), "val",
     "6540f8c9bf4e27fdac4eccf64d9fb850"),
]


@pytest.mark.parametrize("values, hw, split, expected", CANVASES_BEFORE_THE_VARIANT_OPTIONS)
def test_the_variant_options_left_at_zero_draw_the_canvases_drawn_before_they_existed(values, hw, split, expected):
    options = cd.ClutteredDigitsOptions(**values)
    assert (options.digit_size_max, options.placements) == (0, 0)
    arrays = cd.generate(options, hw, split, np.array([0, 1, 7, 123, 3999]))
    where = arrays["placement"]
    assert (where[:, 2] == options.digit_size).all()
    digest = hashlib.sha256()
    for array in (arrays["images"], arrays["labels"], where[:, 0], where[:, 1], where[:, 3]):
        digest.update(np.ascontiguousarray(array).tobytes())
    assert digest.hexdigest()[:32] == expected


def test_digit_size_max_draws_each_canvas_s_side_and_keeps_its_core_untouched():
    options = small("cluttered-digits", digit_size=12, digit_size_max=20, clutter_size=8, train_size=60)
    arrays = draw("cluttered-digits", options)
    sides = arrays["placement"][:, 2]
    assert sides.min() >= 12 and sides.max() <= 20 and len(np.unique(sides)) >= 5
    _, labels, _ = cd.source_digits(12)
    margin = options.clutter_size // 2
    for canvas, label, (top, left, side, source) in zip(arrays["images"], arrays["labels"], arrays["placement"]):
        digit = cd.source_digits(int(side))[0][source]
        box = canvas[top:top + side, left:left + side]
        assert labels[source] == label and (box >= digit).all()
        core = np.s_[margin:side - margin, margin:side - margin]
        assert np.array_equal(box[core], digit[core])


def test_clutter_is_cut_from_digits_of_the_canvas_s_own_side(monkeypatch):
    """Every digit of side s made a flat square of value s: a canvas then shows its digit's side and nothing else."""
    real = cd.source_digits

    def flat_digits(digit_size):
        images, labels, pools = real(digit_size)
        return np.full_like(images, digit_size), labels, pools

    monkeypatch.setattr(cd, "source_digits", flat_digits)
    options = small("cluttered-digits", digit_size=12, digit_size_max=20, clutter_size=8)
    for index in range(20):
        canvas, _, where = cd.draw(options, CD_HW, "train", index)
        assert set(np.unique(canvas)) == {0, where.size}, index


def test_placements_show_each_training_digit_on_that_many_canvases_and_leave_val_and_test_alone():
    options = small("cluttered-digits", train_size=60, placements=3)
    arrays = draw("cluttered-digits", options)
    _, labels, pools = cd.source_digits(options.digit_size)
    sources, counts = np.unique(arrays["placement"][:, 3], return_counts=True)
    assert len(sources) == 60 // 3 and (counts == 3).all()
    assert np.isin(sources, pools["train"]).all()
    assert np.array_equal(labels[arrays["placement"][:, 3]], arrays["labels"])
    assert np.array_equal(np.bincount(labels[sources], minlength=10), np.full(10, 2))  # balanced over the classes
    for source in sources:  # the same digit at places of its own
        corners = arrays["placement"][arrays["placement"][:, 3] == source][:, :2]
        assert len({tuple(corner) for corner in corners}) == 3
    unplaced = small("cluttered-digits", train_size=60)
    assert len(np.unique(draw("cluttered-digits", unplaced)["placement"][:, 3])) > 20
    for split in ("val", "test"):
        placed_images = draw("cluttered-digits", options, split)["images"]
        assert placed_images.tobytes() == draw("cluttered-digits", unplaced, split)["images"].tobytes()
    other_seed = draw("cluttered-digits", small("cluttered-digits", train_size=60, placements=3, seed=1))
    assert set(np.unique(other_seed["placement"][:, 3])) != set(sources)


def test_placements_round_up_per_class_when_the_split_is_no_multiple_of_ten_placements():
    assert [cd.canvases_of_class(25, label) for label in range(10)] == [3] * 5 + [2] * 5
    options = small("cluttered-digits", train_size=25, placements=2)
    assert [len(digits) for digits in cd.training_sources(options)] == [2] * 5 + [1] * 5


# -- normalisation statistics ----------------------------------------------------------------------
# (task, options, side, mean, std) as the code before drawing on demand computed them, over its whole training split:
# splits within the statistics' budget (every published table's: at most 10,000 images at 128 px, 1,000 at 256 px)
# keep them, bit for bit.
STATISTICS_BEFORE = [
    ("cluttered-digits", dict(train_size=300), 64, 0.15358882569955065, 0.28077281595808196),
    ("pathfinder", dict(train_size=100, level="easy"), 128, 0.02094085813036152, 0.11936855110939998),
    ("cluttered-digits", {}, 128, 0.09864813414330574, 0.2383215148890945),
    ("cluttered-digits", CURRICULUM, 64, 0.1063285701976103, 0.24133248037911956),
    ("cluttered-digits", CURRICULUM, 128, 0.049430075970818006, 0.17409078197487166),
    ("cluttered-digits", TUNE_FEW, 128, 0.11889059077244178, 0.2577844180076489),
    ("cluttered-digits", dict(train_size=1000, val_size=200, test_size=200), 256, 0.08492383309158623, 0.2243406454966258),
    pytest.param("pathfinder", {}, 128, 0.02584325355679381, 0.1313009251164727, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("task, values, side, mean, std", STATISTICS_BEFORE)
def test_the_statistics_of_a_split_within_the_budget_are_those_of_the_whole_split_as_before(task, values, side, mean, std,
                                                                                          tmp_path):
    generated = load_generated(task, values, (side, side), tmp_path)
    assert (generated.mean, generated.std) == ((mean,) * 3, (std,) * 3)


def test_the_statistics_count_a_fixed_number_of_pixels_from_the_first_images():
    assert statistics.statistics_size(10_000, (128, 128)) == 10_000
    assert statistics.statistics_size(10_000, (256, 256)) == 2_500
    assert statistics.statistics_size(10_000, (1024, 1024)) == 156
    assert statistics.statistics_size(10_000, (2048, 2048)) == 39
    assert statistics.statistics_size(100, (1024, 1024)) == 100
    assert statistics.statistics_size(10, (8192, 8192)) == 2
    assert statistics.statistics_size(10, (16384, 16384)) == 1


def test_the_statistics_are_those_of_the_first_images_whatever_the_processes(monkeypatch):
    monkeypatch.setattr(statistics, "STATISTICS_PIXELS", 7 * CD_HW[0] * CD_HW[1])
    monkeypatch.setattr(statistics, "CHUNK_PIXELS", 2 * CD_HW[0] * CD_HW[1])  # four chunks over two processes
    task, options = TASKS["cluttered-digits"], small("cluttered-digits")
    first = draw("cluttered-digits", options)["images"][:7]
    expected = np.bincount(first.ravel(), minlength=256)
    for workers in (1, 2):
        assert np.array_equal(statistics.count_levels(task, options, CD_HW, "train", 7, workers), expected)
    levels = np.arange(256) / 255
    mean, std = statistics.grey_mean_std(expected)
    assert mean == pytest.approx((first / 255).mean(), rel=1e-12) and std == pytest.approx((first / 255).std(), rel=1e-9)
    assert np.isclose(expected @ levels / expected.sum(), mean)


def test_the_statistics_are_remembered_and_computed_again_when_not_whole(tmp_path, monkeypatch):
    task, options = TASKS["cluttered-digits"], small("cluttered-digits")
    computed = statistics.split_statistics(task, options, CD_HW, "train", tmp_path)
    path = statistics.statistics_path(tmp_path, statistics.describe(task, options, CD_HW, "train", 20))
    assert path.is_file() and not list(path.parent.glob("*.partial"))

    def no_drawing(*args, **kwargs):
        raise AssertionError("drew images whose statistics are remembered")

    with monkeypatch.context() as patch:
        patch.setattr(statistics, "count_levels", no_drawing)
        assert statistics.split_statistics(task, options, CD_HW, "train", tmp_path) == computed

    whole = path.read_bytes()
    stored = json.loads(whole)
    moved = list(stored["counts"])
    moved[0], moved[255] = moved[0] - 1, moved[255] + 1  # the same number of pixels, another histogram
    other = statistics.describe(task, dataclasses.replace(options, seed=1), CD_HW, "train", 20)
    damaged_files = [
        whole[: len(whole) // 2], b"", b"[]", b'{"counts": "none"}',
        json.dumps({**stored, "counts": moved}).encode(),  # as many pixels: the checksum catches it
        json.dumps({**stored, "described": other}).encode(),
    ]
    for damaged in damaged_files:
        path.write_bytes(damaged)
        assert statistics.split_statistics(task, options, CD_HW, "train", tmp_path) == computed
        assert path.read_bytes() == whole
    assert not list(path.parent.glob("*.partial"))


def test_statistics_that_cannot_be_written_are_computed_all_the_same(tmp_path):
    task, options = TASKS["cluttered-digits"], small("cluttered-digits")
    root = tmp_path / "a file"
    root.write_text("")
    expected = statistics.split_statistics(task, options, CD_HW, "train", tmp_path / "writable")
    assert statistics.split_statistics(task, options, CD_HW, "train", root) == expected


def test_the_statistics_path_covers_every_option_the_size_the_split_the_count_and_the_version():
    task, options = TASKS["pathfinder"], small("pathfinder")

    def path(task=task, options=options, hw=PF_HW, split="train", samples=20):
        return statistics.statistics_path("root", statistics.describe(task, options, hw, split, samples))

    others = [
        path(options=dataclasses.replace(options, seed=1)), path(options=dataclasses.replace(options, level="easy")),
        path(options=dataclasses.replace(options, train_size=21)), path(hw=(128, 256)), path(split="val"),
        path(samples=19), path(task=dataclasses.replace(task, version=task.version + 1)),
    ]
    assert len({path(), *others}) == len(others) + 1
    task, options = TASKS["cluttered-digits"], small("cluttered-digits")
    keys = {path(task, dataclasses.replace(options, **{field.name: 40}), CD_HW) for field in dataclasses.fields(options)}
    assert len({path(task, options, CD_HW), *keys}) == len(dataclasses.fields(options)) + 1


def test_computing_the_statistics_shows_a_progress_bar_with_its_count_when_asked_and_long(tmp_path, capsys, monkeypatch):
    sizes = dict(train_size=30, val_size=10, test_size=10)
    load_generated("cluttered-digits", sizes, CD_HW, tmp_path / "quiet", progress=True)
    assert capsys.readouterr().err == ""  # shorter than the bar's delay: nothing printed
    monkeypatch.setattr(progress, "DELAY_S", 0.0)
    load_generated("cluttered-digits", sizes, CD_HW, tmp_path / "unasked")
    assert capsys.readouterr().err == ""
    load_generated("cluttered-digits", sizes, CD_HW, tmp_path, progress=True)
    bar = capsys.readouterr().err.rsplit("\r", 1)[-1]
    assert bar.startswith("cluttered-digits train: normalisation statistics: 100%") and "30/30 [" in bar


# -- memory ---------------------------------------------------------------------------------------
MEMORY_PROBE = """
import resource, sys
from torch.utils.data import DataLoader
from visattn.train.config import make_config
from visattn.train.data import TransformedDataset, build_transform, load_splits

def kib(field):
    return int(open("/proc/self/status").read().split(field + ":")[1].split()[0])

config = make_config({"dataset": "cluttered-digits", "img_size": 1024, "patch_size": 16, "data_dir": sys.argv[1]})
before = kib("VmRSS")
splits = load_splits(config)
train = TransformedDataset(splits.train, build_transform(config, splits, training=True), seed=0)
for batch, _ in zip(DataLoader(train, batch_size=int(sys.argv[2])), range(int(sys.argv[3]))):
    pass
print(len(splits.train), before, kib("VmHWM"), resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
"""


def test_building_and_iterating_the_default_split_at_1024_px_holds_a_few_images_not_the_split(tmp_path):
    batch, batches, side = 4, 3, 1024
    result = subprocess.run(
        [sys.executable, "-c", MEMORY_PROBE, str(tmp_path), str(batch), str(batches)], cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    size, before_kib, peak_kib, child_peak_kib = (int(word) for word in result.stdout.split())
    assert size == 10_000
    split_bytes = size * side * side  # the uint8 canvases of the whole split: what drawing it whole held
    float_image = 3 * side * side * 4  # one image as the transform leaves it
    # Per image of a batch: the batch the loop holds, the batch being stacked and its images before stacking, and
    # what the allocator keeps of them (4); a fixed working set: the transform's steps on one image (grey, RGB,
    # crop, tensor, normalised), the statistics' chunk and the allocator's slack (16). Measured on Linux: 10, 25.6
    # and 39 images' worth at batch 1, 4 and 8.
    bound = (4 * batch + 16) * float_image
    assert bound < split_bytes / 20
    assert (peak_kib - before_kib) * 1024 < bound, f"{(peak_kib - before_kib) / 1024:.0f} MiB"
    assert child_peak_kib * 1024 < before_kib * 1024 + bound  # a statistics process: the parent's pages and a chunk
# -- selection by the training config ------------------------------------------------------------
def test_load_splits_serves_a_generated_dataset(tmp_path):
    config = make_config({
        "dataset": "pathfinder", "data_dir": str(tmp_path), "img_size": 128, "patch_size": 4,
        "dataset_kwargs": {"level": "easy", "train_size": 8, "val_size": 4, "test_size": 6},
    })
    splits = load_splits(config)
    assert (len(splits.train), len(splits.eval), splits.num_classes) == (8, 6, 2)
    image, label = splits.train[1]
    assert image.mode == "RGB" and image.size == (128, 128) and label == 1
    assert 0 < splits.mean[0] < 0.2 and splits.std[0] > 0
    assert [path.name.startswith("statistics-") for path in (tmp_path / "generated" / "pathfinder").iterdir()] == [True]


def test_a_canvas_size_draws_the_images_of_that_img_size_and_the_transform_resizes_them(tmp_path):
    sizes = {"train_size": 10, "val_size": 10, "test_size": 10, "digit_size": 16, "clutter_size": 8}
    values = {"dataset": "cluttered-digits", "data_dir": str(tmp_path), "patch_size": 4, "augment": False}
    full = make_config({**values, "img_size": 64, "dataset_kwargs": sizes})
    reduced = make_config({**values, "img_size": 32, "dataset_kwargs": {**sizes, "canvas_size": 64}})
    full_splits, reduced_splits = load_splits(full), load_splits(reduced)
    for split in ("train", "val", "eval"):
        full_split, reduced_split = getattr(full_splits, split), getattr(reduced_splits, split)
        assert all(np.array_equal(full_split.sample(i)["images"], reduced_split.sample(i)["images"]) for i in range(10))
    assert (full_splits.mean, full_splits.std) == (reduced_splits.mean, reduced_splits.std)
    assert len(list((tmp_path / "generated" / "cluttered-digits").iterdir())) == 1  # one statistics file for both
    image, _ = reduced_splits.train[3]
    expected = image.resize((32, 32), Image.Resampling.BICUBIC)
    expected = (np.asarray(expected, dtype=np.float32)[..., 0] / 255 - reduced_splits.mean[0]) / reduced_splits.std[0]
    for training in (False, True):  # augment off, as in the cluttered-digits recipes
        seen = build_transform(reduced, reduced_splits, training=training)(image)
        assert seen.shape == (3, 32, 32)
        np.testing.assert_allclose(seen[0].numpy(), expected, atol=1e-5)


@pytest.mark.parametrize(
    "values, message",
    [
        ({"dataset": "pathfinder", "img_size": 128, "dataset_kwargs": {"level": "medium"}},
         "^dataset_kwargs: pathfinder level 'medium' is not one of easy, intermediate, hard"),
        ({"dataset": "pathfinder", "img_size": 128, "dataset_kwargs": {"levels": "easy"}},
         "^dataset_kwargs: .* no option 'levels'; its options: seed, train_size"),
        ({"dataset": "pathfinder", "img_size": 128, "dataset_kwargs": {"train_size": 0}}, "train_size: must be >= 1"),
        ({"dataset": "pathfinder", "img_size": 128, "dataset_kwargs": {"seed": "one"}}, "option 'seed': expected int, got 'one'"),
        ({"dataset": "pathfinder", "img_size": 128, "dataset_kwargs": {"distractors": "few"}},
         "option 'distractors': expected int or none, got 'few'"),
        ({"dataset": "pathfinder", "img_size": 128, "dataset_kwargs": {"distractors": True}},
         "option 'distractors': expected int or none, got True"),
        ({"dataset": "pathfinder", "img_size": 128, "dataset_kwargs": {"contour_length": 1}},
         "^dataset_kwargs: pathfinder option contour_length: must be in \\[2, 16\\] paddles, or null for the level's, got 1"),
        ({"dataset": "pathfinder", "img_size": 64, "dataset_kwargs": {"contour_length": 17}},
         "^dataset_kwargs: pathfinder option contour_length: must be in \\[2, 16\\] paddles, or null for the level's, got 17"),
        ({"dataset": "pathfinder", "img_size": 128, "dataset_kwargs": {"distractors": -1}},
         "^dataset_kwargs: pathfinder option distractors: must be >= 0, or null for the level's, got -1"),
        ({"dataset": "pathfinder", "img_size": 32}, "^img_size: .* at least 64 px .*configs/pathfinder.yaml"),
        ({"dataset": "cluttered-digits", "img_size": 32}, "^img_size: a 32x32 canvas leaves no room"),
        ({"dataset": "cluttered-digits", "img_size": 128, "dataset_kwargs": {"clutter_size": 40}},
         "clutter_size: must be in \\[1, digit_size 32\\]"),
        ({"dataset": "cluttered-digits", "img_size": 128, "dataset_kwargs": {"digit_size_max": 20}},
         "^dataset_kwargs: cluttered-digits option digit_size_max: must be 0 \\(every digit digit_size px\\) or "
         ">= digit_size 32, got 20$"),
        ({"dataset": "cluttered-digits", "img_size": 64, "dataset_kwargs": {"digit_size_max": 56}},
         "^img_size: a 64x64 canvas leaves no room for 14 px clutter around a 56 px digit"),
        ({"dataset": "cluttered-digits", "img_size": 128, "dataset_kwargs": {"placements": -1}},
         "^dataset_kwargs: cluttered-digits option placements: must be >= 0 \\(0: a digit drawn for each canvas\\), "
         "got -1$"),
        ({"dataset": "cluttered-digits", "img_size": 128, "dataset_kwargs": {"placements": 2}},
         "^dataset_kwargs: cluttered-digits option placements: 2 canvases per digit over train_size 10000 need 500 "
         "training digits of class 0, the training pool holds 107; raise placements or lower train_size$"),
        ({"dataset": "cluttered-digits", "img_size": 64, "dataset_kwargs": {"canvas_size": -1}},
         "^dataset_kwargs: cluttered-digits option canvas_size: must be >= 0 \\(0: the img_size\\), got -1$"),
        ({"dataset": "cluttered-digits", "img_size": 128, "dataset_kwargs": {"canvas_size": 40}},
         "^dataset_kwargs: canvas_size 40: a 40x40 canvas leaves no room for 14 px clutter around a 32 px digit"),
        ({"dataset": "cluttered-digits", "img_size": [64, 128], "dataset_kwargs": {"canvas_size": 128}},
         "^img_size: dataset_kwargs canvas_size draws square images, which a 64x128 img_size would crop; use a "
         "square img_size or canvas_size 0$"),
        ({"dataset": "digits", "dataset_kwargs": {"level": "easy"}}, "dataset 'digits' takes no options"),
    ],
)
def test_bad_dataset_options_are_config_errors_naming_the_option(values, message):
    with pytest.raises(ConfigError, match=message):
        make_config(values)


def test_the_recipes_run_at_a_grid_of_at_least_1024_tokens():
    for name, dataset in (("cluttered-digits", "cluttered-digits"), ("pathfinder", "pathfinder")):
        values, _, _ = parse_args(["--config", str(REPO / "configs" / f"{name}.yaml")])
        config = make_config(values)
        assert config.dataset == dataset
        rows, cols = (side // config.patch_size for side in config.image_hw)
        assert rows >= 32 and cols >= 32


def test_train_py_runs_on_a_generated_dataset(tmp_path):
    command = [
        sys.executable, str(REPO / "train.py"), "--config", str(REPO / "configs" / "pathfinder.yaml"),
        "--data-dir", str(tmp_path / "data"), "--run-dir", str(tmp_path / "run"), "--attn", "linear",
        "--dataset-kwargs", "level=easy", "train_size=16", "val_size=8", "test_size=8",
        "--embed-dim", "12", "--depth", "1", "--num-heads", "1", "--batch-size", "8", "--epochs", "1",
        "--warmup-epochs", "0",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "run" / SUMMARY_FILE).is_file()


# -- what the README's GPU run says before its first step ------------------------------------------
def quick_start(**values) -> tuple[object, object, DataSplits]:
    """The README's GPU quick start (cluttered digits at 1024 px, ViT-S/16, linear, batch 32, 4 epochs, 8 workers):
    its config, its model, and splits of its sizes (no images needed for what is counted)."""
    config = make_config({"dataset": "cluttered-digits", "img_size": 1024, "model": "vit_small_patch16_224",
                          "attn": "linear", "batch_size": 32, "epochs": 4, "num_workers": 8, **values})
    resolve_attention(config)
    splits = DataSplits(train=range(10_000), val=range(2_000), eval=range(2_000), num_classes=10, mean=(0.1,) * 3,
                        std=(0.2,) * 3)
    return config, build_model(config, num_classes=10), splits


def test_the_overview_counts_the_images_tokens_flops_and_memory_of_the_quick_start(monkeypatch):
    monkeypatch.setattr(overview, "loader_workers", lambda asked: asked)  # as on the H200's 16 cores
    config, model, splits = quick_start()
    n, c, hidden, grid = 4097, 384, 1536, 4096
    case = overview.block_cases(config, model)[0][1]
    block = 6 * n * c * c + 2 * n * c * c + 4 * n * c * hidden + get_attention("linear").mixing_flops(case)
    patch_projection = 2 * grid * (3 * 16 * 16) * c
    # three forward passes, but no gradient into the image: the patch projection's backward is one product
    step_flops = 32 * (3 * (patch_projection + 12 * block + 2 * c * 10) - patch_projection)
    cost = overview.step_cost(config, model, torch.device("cpu"))
    assert cost.flops == step_flops
    in_flight = 2 * 8 + 1  # two batches per worker and the step's
    assert overview.cost_lines(config, splits, model, 1, 10_000 // 32, torch.device("cpu"), cost) == [
        "cost: 39,936 images trained, 8,000 validation and 2,000 test images evaluated; 4,097 tokens per image, "
        f"131,104 per step; {significant(step_flops / 1e12)} TFLOPs per step (forward and backward, an estimate from "
        "the cost models)",
        f"memory per process: a step about {significant(cost.memory_bytes / 2**30)} GiB on cpu (an estimate: weights, "
        "gradients, AdamW's moments, the activations kept for the backward); the training loader up to "
        f"{significant(in_flight * 32 * 3 * 1024 * 1024 * 4 / 2**30)} GiB (17 batches of 32 images of 3x1024x1024 in "
        "fp32: 8 workers x 2 in flight and the step's)",
    ]


def test_a_loader_holding_more_than_half_the_machine_s_memory_is_warned_of(monkeypatch):
    monkeypatch.setattr(overview, "loader_workers", lambda asked: asked)
    monkeypatch.setattr(overview, "machine_memory_bytes", lambda: 16 * 2**30)
    assert overview.loader_warning(quick_start()[0]) == []  # 17 batches of 32 at 1024 px: 6.38 GiB
    at_2048 = make_config({"dataset": "cluttered-digits", "img_size": 2048, "batch_size": 32, "num_workers": 8})
    assert overview.loader_warning(at_2048) == [
        f"warning: the training loader may hold {significant(17 * 32 * 3 * 2048 * 2048 * 4 / 2**30)} GiB of batches "
        "per process, more than half this machine's 16.0 GiB of memory: lower --num-workers or --batch-size"
    ]


@pytest.mark.parametrize("precision, device", [("no", "cpu"), ("bf16", "cuda")])
def test_the_step_cost_is_the_benchmark_s_estimate(precision, device):
    config, model, _ = quick_start(mixed_precision=precision)
    cost = overview.step_cost(config, model, torch.device(device))
    shape, options = ViTShape.from_model(model), overview.block_cases(config, model)[0][1].options
    assert cost.flops == 32 * train_flops(shape, (1024, 1024), "linear", options)
    assert cost.memory_bytes == estimate_memory(
        shape, (1024, 1024), "linear", options, batch_size=32, training=True, act_bytes=4 if precision == "no" else 2,
        param_count=sum(p.numel() for p in model.parameters()), device=device,
    )


def test_a_gpu_recipe_on_the_cpu_is_warned_of_with_the_time_a_step_takes_there(monkeypatch):
    rates = []

    def measured(dtype, dim):
        rates.append((dtype, dim))
        return 1e11

    monkeypatch.setattr(overview, "matmul_flops_per_s", measured)
    monkeypatch.setattr(overview, "machine_memory_bytes", lambda: 16 * 2**30)
    config, model, _ = quick_start(mixed_precision="bf16")
    cost = overview.step_cost(config, model, torch.device("cpu"))
    seconds = cost.flops / 1e11
    assert overview.cpu_warning(config, model, 312, cost) == [
        f"warning: a recipe for a GPU on the CPU (bf16 mixed precision; a step of 32 images at 1024x1024; a step "
        f"needing {significant(cost.memory_bytes / 2**30)} GiB, more than this machine's 16.0 GiB): a step takes about "
        f"{significant(seconds)} s here, {significant(seconds * 312 / 3600)} h per epoch (an estimate: "
        f"{significant(cost.flops / 1e12)} TFLOPs at the 100 GFLOP/s this process's bfloat16 matmuls reach, measured "
        "now; the rest of the step comes on top); on a CPU train in fp32 (--mixed-precision no) at a smaller "
        "--img-size or --batch-size"
    ]
    assert rates == [(torch.bfloat16, 384)]
    # the CPU recipe of the same task: fp32, 128 px, a small ViT
    values, _, _ = parse_args(["--config", str(REPO / "configs" / "cluttered-digits.yaml")])
    small_config = make_config(values)
    small_model = build_model(small_config, num_classes=10)
    small_cost = overview.step_cost(small_config, small_model, torch.device("cpu"))
    assert small_cost.flops / 1e11 < overview.CPU_STEP_WARNING_S
    assert overview.cpu_warning(small_config, small_model, 312, small_cost) == []


# -- the markers' distance as a shortcut (scripts/generated_tasks.py shortcut) ---------------------
def test_the_distance_rule_is_the_best_threshold_on_either_side():
    script = load_script("generated_tasks")
    distances = np.array([1.0, 2.0, 3.0, 10.0, 11.0, 12.0])
    assert script.best_distance_rule(distances, np.array([1, 1, 1, 0, 0, 0])) == (3.0, True)
    assert script.best_distance_rule(distances, np.array([0, 0, 0, 1, 1, 1])) == (3.0, False)
    # one joined pair far out: the cut still falls between the groups, at 5 right out of 6
    threshold, joined_below = script.best_distance_rule(distances, np.array([1, 1, 1, 0, 0, 1]))
    assert (threshold, joined_below) == (3.0, True)


def test_the_markers_distance_gives_away_lone_short_curves_but_not_the_hard_level():
    script = load_script("generated_tasks")
    hw = (pf.MIN_SIDE, pf.MIN_SIDE)
    lone, _, _, hard = (pf.PathfinderOptions(**values) for _, values in script.LADDER)
    assert script.distance_rule_accuracy(lone, hw, 60) == 1.0  # joined markers ~6 px apart, apart ones 8 px or more
    assert script.distance_rule_accuracy(hard, hw, 60) < 0.6
