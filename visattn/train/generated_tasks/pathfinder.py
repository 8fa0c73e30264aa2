"""Pathfinder (Linsley et al. 2018, "Learning long-range spatial dependencies with horizontal gated
recurrent units"; the Pathfinder task of the Long Range Arena): are the two markers joined by one curve?

Each image holds two circular markers and several dashed curves. A curve is a chain of short straight
strokes ("paddles") separated by gaps; each paddle turns from the previous one by an angle drawn with
density proportional to cos^2(continuity * angle), so the turn never exceeds 90 / continuity degrees.
Two target curves start ``seed_distance`` apart; in a positive image the markers sit on both ends of
one of them, in a negative image on the start of one and the end of the other. Shorter distractor
curves fill the rest of the canvas. No stroke's edge comes closer to a stroke of another curve (or of the
same curve, beyond its neighbours) than ``clearance``, nor to a target curve's end marker, so the
only way from one marker to the other is along a curve: the label is decided by the generator's own
paddle graph (:attr:`Scene.connected`) and the rendered image agrees with it once the dash gaps are
bridged (the tests flood-fill every generated image).

The geometry follows the published generator's settings for LRA's 128 px images (paddle length 5,
thickness 1.5, gap 2 or 3 drawn per image, marker radius 3, seed distance 20, continuity 1.8,
contrast 0.9), scaled by ``min(H, W) / 128`` for other sizes; the levels are LRA's three contour lengths
(6, 9, 14 paddles), with distractors of ``contour_length // 3`` paddles, ``35 // that`` of them. The
clearance (7 px between the edges of strokes, 8.5 px between their centre lines) is this module's own:
it keeps other curves farther from a curve than the curve's own dash gaps, so that a gap can be told
from a junction. The options ``contour_length`` and ``distractors`` change a level's target curves and
its number of distractors, for a curriculum from short, lone curves (``contour_length=2 distractors=0``)
to the level itself; the target curves are drawn first, so a sample's are the same with any number of
distractors.

Classes are balanced: odd sample indices are the connected ones. Pure NumPy and Pillow, no torch;
sample ``index`` of ``split`` is fixed by ``(seed, split, index)`` alone.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
from PIL import Image, ImageDraw

from visattn.train.generated_tasks.common import SplitSizes, Task, sample_rng

REFERENCE_SIDE = 128  # the published generator's settings below are for 128 px images


@dataclass(frozen=True)
class Level:
    """A difficulty: paddles per target curve, per distractor curve, and the number of distractors."""

    contour_length: int
    distractor_length: int
    num_distractors: int


LEVELS = {
    "easy": Level(contour_length=6, distractor_length=2, num_distractors=17),
    "intermediate": Level(contour_length=9, distractor_length=3, num_distractors=11),
    "hard": Level(contour_length=14, distractor_length=4, num_distractors=8),
}


@dataclass(frozen=True)
class Geometry:
    """Lengths in pixels at ``REFERENCE_SIDE``; :meth:`scaled` gives them for another image size."""

    paddle_length: float = 5.0
    paddle_thickness: float = 1.5
    paddle_gaps: tuple[float, ...] = (2.0, 3.0)
    marker_radius: float = 3.0
    seed_distance: float = 20.0
    clearance: float = 7.0
    padding: float = 1.0
    continuity: float = 1.8
    contrast: float = 0.9

    def scaled(self, height: int, width: int) -> Geometry:
        s = min(height, width) / REFERENCE_SIDE
        return Geometry(
            paddle_length=self.paddle_length * s, paddle_thickness=self.paddle_thickness * s,
            paddle_gaps=tuple(gap * s for gap in self.paddle_gaps), marker_radius=self.marker_radius * s,
            seed_distance=self.seed_distance * s, clearance=self.clearance * s, padding=self.padding * s,
            continuity=self.continuity, contrast=self.contrast,
        )


GEOMETRY = Geometry()
# Turns tried for each next paddle (evenly spaced over the allowed range), placements per distractor,
# starts of the second target per first one, target pairs before giving up.
_TURN_CANDIDATES = 25
_DISTRACTOR_TRIES = 5
_SECOND_TARGET_TRIES = 4
_TARGET_TRIES = 500


@dataclass(frozen=True)
class Scene:
    """One image before rendering. Points are (x, y) pixel coordinates.

    paddles: (P, 2, 2) start and end of every stroke; curve_of: (P,) the curve each belongs to (0 and 1
    are the targets); markers: (2, 2) marker centres; marker_curves: the curve whose end each marker sits on.
    """

    paddles: np.ndarray
    curve_of: np.ndarray
    markers: np.ndarray
    marker_curves: tuple[int, int]
    height: int
    width: int
    geometry: Geometry

    @property
    def connected(self) -> bool:
        """Whether one curve joins the markers: the label, read from the paddle graph."""
        return self.marker_curves[0] == self.marker_curves[1]


_EMPTY = np.iinfo(np.int32).max  # above every paddle index: claims keep the smallest (first) one
_WALL = -1  # below every paddle index: never free


class _Claims:
    """Which paddle first came near each pixel: the clearance test for new strokes, one array lookup per point.

    A committed paddle claims every pixel whose centre lies within ``2 * stroke reach + clearance + slack``
    of it (``marker radius + stroke reach + clearance + slack`` around a marked end), slack being half a
    pixel diagonal (rounding a point to its pixel) plus half the spacing of the points checked along a
    paddle. A point whose pixel is unclaimed is therefore at least the clearance away from every claiming
    stroke and marker. A marker centre is clear when every pixel of a disk of ``marker radius - stroke
    reach`` (plus slack) around it is: then any stroke is at least ``marker radius + stroke reach +
    clearance`` from its centre. A curve's last few paddles are exempt from the test for its next one
    (their claims reach its start however the curve turns). Pixels too near the border to hold a stroke
    are walls, and the raster has a margin of walls wide enough that a paddle started inside it never
    indexes outside.

    Points are complex numbers ``x + 1j * y`` in the raster's frame: the image's pixel (row r, column c)
    is the raster's (r + pad, c + pad).
    """

    def __init__(self, height: int, width: int, g: Geometry, point_spacing: float) -> None:
        stroke, marker = g.paddle_thickness / 2, g.marker_radius
        disk = math.ceil(marker - stroke + 1.5)
        self.pad = math.ceil(g.paddle_length + max(g.paddle_gaps) + disk + 2)
        self.offset = complex(self.pad, self.pad)
        shape = (height + 2 * self.pad, width + 2 * self.pad)
        self.xs = np.arange(shape[1], dtype=float)
        self.ys = np.arange(shape[0], dtype=float)
        self.raster = np.full(shape, _WALL, dtype=np.int32)
        low = g.padding + stroke + 0.5
        self.raster[
            math.ceil(self.pad + low):math.floor(self.pad + height - 1 - low) + 1,
            math.ceil(self.pad + low):math.floor(self.pad + width - 1 - low) + 1,
        ] = _EMPTY
        slack = math.sqrt(0.5) + point_spacing / 2
        # squared claim radii around a paddle and around a marked end
        self.by_stroke = (2 * stroke + g.clearance + slack) ** 2
        self.by_marker = (marker + stroke + g.clearance + slack) ** 2
        self.stroke_reach = math.sqrt(self.by_stroke) + 1  # half the side of the window a claim may touch
        self.marker_reach = math.sqrt(max(self.by_stroke, self.by_marker)) + 1
        # a curve's own previous paddles whose ends lie, along the curve, within a claim of a new paddle's start
        step = g.paddle_length + min(g.paddle_gaps)
        self.exempt_neighbours = max(1, math.ceil((math.sqrt(self.by_stroke) - min(g.paddle_gaps)) / step))
        dy, dx = np.mgrid[-disk:disk + 1, -disk:disk + 1]
        # rounding both the centre and a point of the disk moves each by up to half a pixel diagonal
        inside = dx**2 + dy**2 <= (marker - stroke + math.sqrt(2)) ** 2
        self.disk_x, self.disk_y = dx[inside], dy[inside]  # (D,) pixel offsets of the marker test

    def inside(self, point: complex) -> bool:
        """Whether ``point`` lies in the canvas (so that paddles from it index inside the raster)."""
        height, width = self.raster.shape
        return self.pad <= point.real < width - self.pad and self.pad <= point.imag < height - self.pad

    def free(self, points: np.ndarray, marker_at: int | None, allowed_from: int) -> np.ndarray:
        """(K,) whether the paddles ``points`` (K, S) are clear of every paddle before ``allowed_from``;
        ``marker_at`` is the index along S of a point that carries a marker."""
        x = np.rint(points.real).astype(np.intp)
        y = np.rint(points.imag).astype(np.intp)
        free = (self.raster[y, x] >= allowed_from).all(axis=1)
        if marker_at is not None:
            disk = self.raster[y[:, marker_at, None] + self.disk_y, x[:, marker_at, None] + self.disk_x]
            free &= (disk >= allowed_from).all(axis=1)
        return free

    def claim(self, start: complex, end: complex, markers: list[complex], paddle: int) -> None:
        """Claim the neighbourhood of paddle ``start``-``end`` (and of the markers at its ends) for ``paddle``."""
        reach = self.marker_reach if markers else self.stroke_reach
        x0 = max(math.floor(min(start.real, end.real) - reach), 0)
        x1 = math.ceil(max(start.real, end.real) + reach) + 1
        y0 = max(math.floor(min(start.imag, end.imag) - reach), 0)
        y1 = math.ceil(max(start.imag, end.imag) + reach) + 1
        dx, dy = self.xs[None, x0:x1] - start.real, self.ys[y0:y1, None] - start.imag
        along = end - start
        t = np.clip((dx * along.real + dy * along.imag) * (1.0 / abs(along) ** 2), 0.0, 1.0)
        near = (dx - t * along.real) ** 2 + (dy - t * along.imag) ** 2 < self.by_stroke
        for centre in markers:
            near |= (self.xs[None, x0:x1] - centre.real) ** 2 + (self.ys[y0:y1, None] - centre.imag) ** 2 < self.by_marker
        window = self.raster[y0:y1, x0:x1]
        np.minimum(window, paddle, out=window, where=near)

    def release(self, first_paddle: int) -> None:
        """Forget the claims of ``first_paddle`` and every later one: they only ever claimed empty pixels."""
        self.raster[self.raster >= first_paddle] = _EMPTY


class _SceneBuilder:
    def __init__(self, height: int, width: int, geometry: Geometry, level: Level, rng: np.random.Generator) -> None:
        self.height, self.width, self.g, self.level, self.rng = height, width, geometry, level, rng
        self.gap = float(rng.choice(geometry.paddle_gaps))
        self.paddles: list[tuple[complex, complex]] = []
        self.curve_of: list[int] = []
        samples = max(2, math.ceil(geometry.paddle_length) + 1)
        self.along = np.linspace(0.0, geometry.paddle_length, samples)
        self.claims = _Claims(height, width, geometry, point_spacing=geometry.paddle_length / (samples - 1))
        half_turn = math.pi / (2 * geometry.continuity)
        # the end points are excluded: their weight cos^2(pi / 2) is zero
        turns = np.linspace(-half_turn, half_turn, _TURN_CANDIDATES + 2)[1:-1]
        self.turns = np.exp(1j * turns)
        self.turn_weights = np.cos(geometry.continuity * turns) ** 2

    def _commit(self, start: complex, end: complex, markers: list[complex], curve: int) -> None:
        self.claims.claim(start, end, markers, len(self.paddles))
        self.paddles.append((start, end))
        self.curve_of.append(curve)

    def _undo_to(self, num_paddles: int) -> None:
        self.claims.release(num_paddles)
        del self.paddles[num_paddles:], self.curve_of[num_paddles:]

    # -- curves -----------------------------------------------------------------------------------
    def _grow(self, start: complex, length: int, curve: int, marked_ends: bool) -> bool:
        """Add a curve of ``length`` paddles from ``start`` (raster frame) in a random direction; False (and
        nothing added) when it gets stuck.

        With ``marked_ends`` both ends keep a marker's clearance, marked or not, so that nothing tells the
        marked ends of a target pair from the unmarked ones."""
        unit = complex(np.exp(1j * self.rng.uniform(-math.pi, math.pi)))
        if not self.claims.inside(start):
            return False
        first_paddle = len(self.paddles)
        points = (start + unit * self.along)[None]
        if not self.claims.free(points, 0 if marked_ends else None, first_paddle)[0]:
            return False
        end = complex(points[0, -1])
        markers = [start] if marked_ends else []
        self._commit(start, end, markers, curve)
        for step in range(1, length):
            marker_at = -1 if marked_ends and step == length - 1 else None
            units = unit * self.turns
            points = (end + self.gap * units)[:, None] + units[:, None] * self.along
            allowed_from = max(first_paddle, len(self.paddles) - self.claims.exempt_neighbours)
            weights = np.cumsum(self.turn_weights * self.claims.free(points, marker_at, allowed_from))
            if weights[-1] == 0:
                self._undo_to(first_paddle)
                return False
            # a turn drawn with probability ~ cos^2(continuity * turn) among the turns that fit
            chosen = min(int(np.searchsorted(weights, self.rng.random() * weights[-1], side="right")),
                         _TURN_CANDIDATES - 1)
            unit = complex(units[chosen])
            start, end = complex(points[chosen, 0]), complex(points[chosen, -1])
            self._commit(start, end, [end] if marker_at is not None else [], curve)
        return True

    def _uniform_point(self, border: float) -> complex:
        x = self.rng.uniform(border, self.width - 1 - border)
        y = self.rng.uniform(border, self.height - 1 - border)
        return complex(x, y) + self.claims.offset

    def targets(self) -> bool:
        """Two target curves whose starts are ``seed_distance`` apart, the first away from the borders."""
        border = 2 * self.g.seed_distance
        if self.width <= 2 * border or self.height <= 2 * border:
            border = min(self.width, self.height) / 4
        start = self._uniform_point(border)
        if not self._grow(start, self.level.contour_length, curve=0, marked_ends=True):
            return False
        for _ in range(_SECOND_TARGET_TRIES):
            second = start + self.g.seed_distance * complex(np.exp(1j * self.rng.uniform(-math.pi, math.pi)))
            if self._grow(second, self.level.contour_length, curve=1, marked_ends=True):
                return True
        self._undo_to(0)
        return False

    def distractors(self) -> None:
        for curve in range(2, 2 + self.level.num_distractors):
            for _ in range(_DISTRACTOR_TRIES):
                if self._grow(self._uniform_point(0.0), self.level.distractor_length, curve, marked_ends=False):
                    break

    def target_ends(self, curve: int) -> tuple[complex, complex]:
        mine = [paddle for paddle, owner in zip(self.paddles, self.curve_of) if owner == curve]
        return mine[0][0], mine[-1][1]

    def image_frame(self, points: list[complex]) -> np.ndarray:
        """(..., 2) (x, y) image coordinates of raster-frame points."""
        shifted = np.asarray(points) - self.claims.offset
        return np.stack([shifted.real, shifted.imag], axis=-1)


def make_scene(height: int, width: int, level: Level, connected: bool, rng: np.random.Generator,
               geometry: Geometry = GEOMETRY) -> Scene:
    """A scene of ``level`` whose markers are (or are not) joined, drawn from ``rng``."""
    scaled = geometry.scaled(height, width)
    builder = _SceneBuilder(height, width, scaled, level, rng)
    for _ in range(_TARGET_TRIES):
        if builder.targets():
            break
    else:
        raise ValueError(
            f"pathfinder: no room for two {level.contour_length}-paddle curves on a {height}x{width} canvas; "
            "use a larger image, an easier level or a shorter contour_length"
        )
    builder.distractors()
    origin_curve = int(rng.integers(2))
    end_curve = origin_curve if connected else 1 - origin_curve
    markers = builder.image_frame([builder.target_ends(origin_curve)[0], builder.target_ends(end_curve)[1]])
    return Scene(
        paddles=builder.image_frame(builder.paddles), curve_of=np.array(builder.curve_of), markers=markers,
        marker_curves=(origin_curve, end_curve), height=height, width=width, geometry=scaled,
    )


_ANTIALIAS = 4


def render(scene: Scene) -> np.ndarray:
    """(H, W) uint8 grey image of ``scene``: strokes at ``contrast``, markers at full white, antialiased."""
    g, aa = scene.geometry, _ANTIALIAS
    canvas = Image.new("L", (scene.width * aa, scene.height * aa), 0)
    draw = ImageDraw.Draw(canvas)
    stroke = round(255 * g.contrast)
    width = max(1, round(g.paddle_thickness * aa))

    def scaled(point: np.ndarray) -> tuple[float, float]:  # pixel centres line up at every scale
        return (point[0] + 0.5) * aa - 0.5, (point[1] + 0.5) * aa - 0.5

    for start, end in scene.paddles:
        draw.line([scaled(start), scaled(end)], fill=stroke, width=width)
    radius = g.marker_radius * aa
    for centre in scene.markers:
        x, y = scaled(centre)
        draw.ellipse([x - radius, y - radius, x + radius, y + radius], fill=255)
    return np.asarray(canvas.resize((scene.width, scene.height), Image.Resampling.BOX))


@dataclass(frozen=True)
class PathfinderOptions(SplitSizes):
    """``--dataset pathfinder`` options (``--dataset-kwargs level=easy distractors=0``): the level; the length
    of the two target curves and the largest number of distractor curves (one that finds no room is
    dropped) where they differ from the level's (None: the level's); the split sizes."""

    level: str = "hard"
    contour_length: int | None = None
    distractors: int | None = None

    def chosen_level(self) -> Level:
        """The level named by ``level`` with ``contour_length`` and ``distractors`` put in where given."""
        if self.level not in LEVELS:
            raise ValueError(f"dataset_kwargs: pathfinder level {self.level!r} is not one of {', '.join(LEVELS)}")
        chosen = LEVELS[self.level]
        if self.contour_length is not None:
            chosen = replace(chosen, contour_length=self.contour_length)
        if self.distractors is not None:
            chosen = replace(chosen, num_distractors=self.distractors)
        return chosen


MIN_SIDE = 64  # below this the strokes are thinner than a pixel
MIN_CONTOUR_LENGTH = 2  # a one-paddle curve's markers, 5 px apart, would touch
# a target curve at most as long as the image's side (16 paddles with their gaps): longer ones often find no room
MAX_CONTOUR_LENGTH = int(REFERENCE_SIDE // (GEOMETRY.paddle_length + max(GEOMETRY.paddle_gaps)))


def check_options(options: PathfinderOptions, image_hw: tuple[int, int]) -> None:
    options.chosen_level()  # raises for a level that does not exist
    if min(image_hw) < MIN_SIDE:
        raise ValueError(
            f"img_size: pathfinder images must be at least {MIN_SIDE} px on each side, got {image_hw[0]}x{image_hw[1]} "
            "(the recipe, configs/pathfinder.yaml, draws them at 128)"
        )
    length = options.contour_length
    if length is not None and not MIN_CONTOUR_LENGTH <= length <= MAX_CONTOUR_LENGTH:
        raise ValueError(
            f"dataset_kwargs: pathfinder option contour_length: must be in [{MIN_CONTOUR_LENGTH}, {MAX_CONTOUR_LENGTH}] "
            f"paddles, or null for the level's, got {length}"
        )
    if options.distractors is not None and options.distractors < 0:
        raise ValueError(
            f"dataset_kwargs: pathfinder option distractors: must be >= 0, or null for the level's, got {options.distractors}"
        )


def scene_of(options: PathfinderOptions, image_hw: tuple[int, int], split: str, index: int) -> Scene:
    """The scene of sample ``index`` of ``split``: positive for odd indices."""
    return make_scene(*image_hw, options.chosen_level(), index % 2 == 1, sample_rng(options.seed, split, index))


def generate(options: PathfinderOptions, image_hw: tuple[int, int], split: str, indices: np.ndarray) -> dict[str, np.ndarray]:
    """images (n, H, W) uint8, labels (n,) int64 (1: joined), markers (n, 2, 2) float32 (x, y) centres."""
    images = np.empty((len(indices), *image_hw), dtype=np.uint8)
    labels = np.empty(len(indices), dtype=np.int64)
    markers = np.empty((len(indices), 2, 2), dtype=np.float32)
    for row, index in enumerate(indices.tolist()):
        scene = scene_of(options, image_hw, split, index)
        images[row], labels[row], markers[row] = render(scene), int(scene.connected), scene.markers
    return {"images": images, "labels": labels, "markers": markers}


TASK = Task(name="pathfinder", options=PathfinderOptions, version=1, num_classes=2, generate=generate, check=check_options)
