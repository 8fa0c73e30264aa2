"""Time drawing a generated dataset's samples and its training loader, and measure how far pathfinder's paths reach
in patches.

    python scripts/generated_tasks.py time --dataset pathfinder --img-size 1024 --samples 20
    python scripts/generated_tasks.py loader --workers 2 --batches 8 -- --dataset cluttered-digits --img-size 1024 --batch-size 32
    python scripts/generated_tasks.py reach --patch-size 4 --depth 4 --kernel-size 7
    python scripts/generated_tasks.py shortcut --img-size 64

``time`` draws ``--samples`` samples of a split one at a time in this process, as a loader's worker draws them, and
prints the images per second and the CPU time per image (what a core that nothing else uses would take). ``loader`` builds the training loader of a
``train.py`` command (every flag after ``--``), with ``--workers`` worker processes, and times ``--batches`` batches
after the first with no model, as ``train.py --measure-loader`` does: the images per second the input pipeline
alone delivers (drawing, the training transform, collation, the copy out of the workers); with ``--workers 0`` it
runs in this process and also prints the CPU time per image, what one core needs whatever else runs beside it. ``reach``
draws ``--samples`` scenes per pathfinder level and compares the target paths with the receptive
field of a stack of ``--depth`` neighbourhood-attention blocks of window ``--kernel-size``: a token
sees ``depth * (kernel_size // 2)`` patches along each axis. ``shortcut`` measures how much of each
pathfinder rung (the README's ladder: lone two-paddle curves, then the three levels) a model could get
without following a curve: the accuracy of the best threshold on the distance between the two markers,
chosen on the first ``--samples`` training scenes and measured on as many test scenes.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import time

import numpy as np
import torch

from visattn.train.build import build_loaders, measure_loader
from visattn.train.cli import resolve_config
from visattn.train.data import load_splits
from visattn.train.generated_tasks import TASKS, GeneratedDataset, drawn_as, pathfinder, task_options


def time_samples(args: argparse.Namespace) -> None:
    config_hw = (args.img_size, args.img_size)
    options, image_hw = drawn_as(task_options(args.dataset, dict(args.option), config_hw), config_hw)
    dataset = GeneratedDataset(TASKS[args.dataset], options, image_hw, args.split)
    dataset.sample(0)  # the source digits and the first allocations, made once per process
    started, cpu = time.perf_counter(), time.process_time()
    for index in range(1, args.samples + 1):
        dataset.sample(index % len(dataset))
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    print(
        f"{args.dataset} {args.split}: {args.samples} images of {image_hw[0]}x{image_hw[1]} drawn one at a time in one "
        f"process in {seconds:.2f} s, {args.samples / seconds:.1f} images/s; {1000 * cpu / args.samples:.1f} CPU-ms per "
        f"image ({args.samples / cpu:.1f} images/s per busy core)"
    )


def time_loader(args: argparse.Namespace) -> None:
    config, _, _ = resolve_config(args.train_args)
    config = dataclasses.replace(config, num_workers=args.workers)
    splits = load_splits(config, progress=True)
    train_loader, _, _ = build_loaders(config, splits, num_processes=1)
    cpu = time.process_time()
    speed = measure_loader(train_loader, args.batches, torch.device("cpu"))
    cpu = time.process_time() - cpu
    # with no worker the whole pipeline runs here: its CPU time per image is what one core needs per image
    in_process = f"; {1000 * cpu / (speed.images + config.batch_size):.1f} CPU-ms per image" if not train_loader.num_workers else ""
    print(
        f"{config.dataset} at {config.image_hw[0]}x{config.image_hw[1]}, batch {config.batch_size}, "
        f"{train_loader.num_workers} worker(s) (asked {args.workers}, {os.cpu_count()} CPUs, load average "
        f"{os.getloadavg()[0]:.1f}): {speed.images} images in {speed.batches} batches in {speed.seconds:.2f} s, "
        f"{speed.images_per_s:.1f} images/s{in_process}"
    )


def reach(args: argparse.Namespace) -> None:
    image_hw = (args.img_size, args.img_size)
    field = args.depth * (args.kernel_size // 2)
    print(
        f"{args.depth} neighbourhood blocks of window {args.kernel_size}: a token sees {field} patches each way "
        f"({field * args.patch_size} px at patch {args.patch_size}); grid {args.img_size // args.patch_size}"
    )
    print("| level | paddles | path length (patches) | marker distance, median (patches) | markers > field apart | markers > 2 x field apart |")
    print("|---|---:|---:|---:|---:|---:|")
    for level, spec in pathfinder.LEVELS.items():
        options = pathfinder.PathfinderOptions(level=level, seed=args.seed)
        lengths, distances = [], []
        for index in range(args.samples):
            scene = pathfinder.scene_of(options, image_hw, "train", index)
            target = scene.paddles[scene.curve_of == scene.marker_curves[0]]
            strokes = np.linalg.norm(target[:, 1] - target[:, 0], axis=1).sum()
            gaps = np.linalg.norm(target[1:, 0] - target[:-1, 1], axis=1).sum()
            lengths.append((strokes + gaps) / args.patch_size)
            patches = np.floor(scene.markers / args.patch_size)
            distances.append(np.abs(patches[0] - patches[1]).max())  # Chebyshev: a square window's reach
        distances = np.array(distances)
        print(
            f"| {level} | {spec.contour_length} | {np.mean(lengths):.1f} | {np.median(distances):.0f} | "
            f"{np.mean(distances > field):.0%} | {np.mean(distances > 2 * field):.0%} |"
        )


LADDER = (
    ("two-paddle curves, no distractors", {"level": "easy", "contour_length": 2, "distractors": 0}),
    ("easy", {"level": "easy"}),
    ("intermediate", {"level": "intermediate"}),
    ("hard", {"level": "hard"}),
)


def marker_distances(options: pathfinder.PathfinderOptions, image_hw: tuple[int, int], split: str,
                     count: int) -> tuple[np.ndarray, np.ndarray]:
    """(count,) distances in px between the two markers of the first ``count`` scenes of ``split``, and their labels."""
    scenes = [pathfinder.scene_of(options, image_hw, split, index) for index in range(count)]
    distances = np.array([np.linalg.norm(scene.markers[0] - scene.markers[1]) for scene in scenes])
    return distances, np.array([scene.connected for scene in scenes])


def best_distance_rule(distances: np.ndarray, labels: np.ndarray) -> tuple[float, bool]:
    """The threshold on ``distances`` (n,) that best tells ``labels`` (n,) apart, and whether the joined
    pairs (label 1) lie at or below it: (threshold, joined_below)."""
    cuts = np.unique(distances)
    below = distances[None, :] <= cuts[:, None]  # (cuts, n)
    accuracy_below = (below == labels[None, :].astype(bool)).mean(axis=1)
    best = int(np.argmax(np.maximum(accuracy_below, 1 - accuracy_below)))
    return float(cuts[best]), bool(accuracy_below[best] >= 0.5)


def distance_rule_accuracy(options: pathfinder.PathfinderOptions, image_hw: tuple[int, int], count: int) -> float:
    """Test accuracy of the distance rule chosen on the training split: what the markers' distance alone tells."""
    threshold, joined_below = best_distance_rule(*marker_distances(options, image_hw, "train", count))
    distances, labels = marker_distances(options, image_hw, "test", count)
    predicted_joined = (distances <= threshold) == joined_below
    return float((predicted_joined == labels.astype(bool)).mean())


def shortcut(args: argparse.Namespace) -> None:
    image_hw = (args.img_size, args.img_size)
    print(f"{args.img_size} px, the rule chosen on {args.samples} training scenes and tested on {args.samples} test scenes")
    print("| rung | dataset options | marker distance alone, test accuracy |")
    print("|---|---|---:|")
    for name, values in LADDER:
        options = pathfinder.PathfinderOptions(seed=args.seed, **values)
        spelled = " ".join(f"{key}={value}" for key, value in values.items())
        print(f"| {name} | `{spelled}` | {distance_rule_accuracy(options, image_hw, args.samples):.1%} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    timing = commands.add_parser("time", help="draw samples one at a time in one process and report the rate")
    timing.add_argument("--dataset", choices=sorted(TASKS), default="pathfinder")
    timing.add_argument("--split", choices=("train", "val", "test"), default="train")
    timing.add_argument("--img-size", type=int, default=128)
    timing.add_argument("--samples", type=int, default=50, help="samples timed, after a first one that is not")
    timing.add_argument("--option", nargs=2, action="append", default=[], metavar=("KEY", "VALUE"),
                        help="a dataset option, e.g. --option level easy (numbers as integers)")
    loading = commands.add_parser("loader", help="time a train.py command's training loader alone, with no model")
    loading.add_argument("--workers", type=int, default=2, help="loader worker processes (at most the CPUs this process may use)")
    loading.add_argument("--batches", type=int, default=8, help="batches timed, after a first one that is not")
    loading.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then train.py's flags")
    extent = commands.add_parser("reach", help="pathfinder paths against a neighbourhood stack's receptive field")
    extent.add_argument("--img-size", type=int, default=128)
    extent.add_argument("--patch-size", type=int, default=4)
    extent.add_argument("--depth", type=int, default=4)
    extent.add_argument("--kernel-size", type=int, default=7)
    extent.add_argument("--samples", type=int, default=400)
    extent.add_argument("--seed", type=int, default=0)
    rule = commands.add_parser("shortcut", help="how much of each pathfinder rung the markers' distance alone tells")
    rule.add_argument("--img-size", type=int, default=128)
    rule.add_argument("--samples", type=int, default=1000, help="scenes of the train split, and as many of the test split")
    rule.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.option = [(key, int(value) if value.lstrip("-").isdigit() else value) for key, value in getattr(args, "option", [])]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.command == "loader":
        args.train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    {"time": time_samples, "loader": time_loader, "reach": reach, "shortcut": shortcut}[args.command](args)


if __name__ == "__main__":
    main()
