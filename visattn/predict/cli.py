"""The ``visattn-predict`` command: the top-k classes of images, with a model trained by ``train.py``.

    visattn-predict runs/digits-axial digit.png more_digits/ --top-k 3
    visattn-predict runs/digits-axial photos/ --json > predictions.json
    visattn-predict runs/digits-axial large.png --tile 16 --tile-overlap 8    # tiled, the image at its own size

Prints one line per image (``PATH: CLASS PROBABILITY, ...``), or with ``--json`` one JSON document, on
stdout. A file that cannot be read is one line on stderr (``skipped PATH: REASON``) and the others go on.
Exit status: 0 when at least one image was predicted, 1 when none could be read, 2 for a bad run
directory or argument.

``--tile`` predicts each image at its own size, not resized: cut into tiles of that many pixels, each run
through the model, their tokens merged on the image's patch grid and classified by the model's head, as
:class:`visattn.tiled.TiledViT` does (:mod:`visattn.predict.tiling`). The model is loaded with
``dynamic_img_size=True`` so that it takes any tile that is a multiple of its patch size.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from typing import Any

from visattn.predict.images import find_images
from visattn.predict.predictor import DEFAULT_BATCH_SIZE, Prediction, iter_predictions, load_predictor
from visattn.predict.run_dir import WEIGHTS
from visattn.predict.tiling import Tiling
from visattn.tiled import MERGES

DEFAULT_OVERLAP = "0"


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def parse_pixels(text: str, flag: str) -> tuple[int, int]:
    """'224' -> (224, 224); '512x1024' -> (512, 1024); ValueError naming ``flag`` and the accepted forms."""
    parts = text.lower().split("x")
    if len(parts) not in (1, 2) or not all(part.strip().isdigit() for part in parts):
        raise ValueError(f"{flag} must be N or HxW in pixels (non-negative integers), got {text!r}")
    height, width = (int(part) for part in parts * (2 // len(parts)))
    return height, width


def tiling_from_args(args: argparse.Namespace) -> Tiling | None:
    """The :class:`Tiling` of ``--tile``, ``--tile-overlap`` and ``--tile-merge``, or None without ``--tile``;
    ValueError for a malformed value or an overlap or merge without a tile."""
    if args.tile is None:
        stray = [flag for flag, value, default in (("--tile-overlap", args.tile_overlap, DEFAULT_OVERLAP),
                                                   ("--tile-merge", args.tile_merge, MERGES[0])) if value != default]
        if stray:
            raise ValueError(f"{' and '.join(stray)} need --tile N or HxW (tiled prediction)")
        return None
    if args.tile_merge not in MERGES:
        raise ValueError(f"--tile-merge must be one of {', '.join(MERGES)}, got {args.tile_merge!r}")
    return Tiling(parse_pixels(args.tile, "--tile"), parse_pixels(args.tile_overlap, "--tile-overlap"), args.tile_merge)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="visattn-predict",
        description="Predict the classes of images with a model trained by train.py: the top-k classes and their "
        "probabilities for each image, with the transform and class names recorded in the run directory.",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="run directory written by train.py (holds model.json)")
    parser.add_argument("paths", metavar="IMAGE_OR_FOLDER", nargs="+",
                        help="image files, and folders walked for image files (extensions as torchvision's ImageFolder)")
    parser.add_argument("--top-k", type=_positive_int, default=5,
                        help="classes to print per image (default: %(default)s)")
    parser.add_argument("--batch-size", type=_positive_int, default=DEFAULT_BATCH_SIZE,
                        help="images per forward pass, tiles with --tile (default: %(default)s)")
    parser.add_argument("--device", default=None,
                        help="cpu, cuda, cuda:1, mps, ... (default: the accelerator where there is one, else cpu)")
    parser.add_argument("--which", choices=sorted(WEIGHTS), default="best",
                        help="which weights of the run: the best epoch's or the last (default: %(default)s)")
    parser.add_argument("--json", action="store_true",
                        help="write one JSON document to stdout instead of lines, with the keys run_dir, weights "
                        "(best or last), device, data_config (the transform: input_size, interpolation, mean, std, "
                        "crop_pct, crop_mode), tiling (null, or tile, overlap and merge), predictions (a list of path "
                        "and top_k, a list of class_name and probability) and skipped (a list of path and reason)")
    parser.add_argument("--tile", metavar="N|HxW", default=None,
                        help="predict each image at its own size, in tiles of this many pixels (a multiple of the "
                        "model's patch size), merged as visattn.tiled.TiledViT does; without it, each image is "
                        "resized to the size the model was trained at (default)")
    parser.add_argument("--tile-overlap", metavar="N|HxW", default=DEFAULT_OVERLAP,
                        help="least overlap of neighbouring tiles in pixels, a multiple of the patch size smaller than "
                        "the tile (default: %(default)s)")
    parser.add_argument("--tile-merge", metavar="|".join(MERGES), default=MERGES[0],
                        help="crop: each token from the tile where it is most central (default); blend: the "
                        "centrality-weighted mean of the tiles covering it")
    return parser


def _as_line(result: Prediction) -> str:
    return f"{result.path}: " + ", ".join(f"{name} {probability:.3f}" for name, probability in result.top_k)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except BrokenPipeError:  # the reader went away (| head): stop quietly, as other command-line tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _run(args: argparse.Namespace) -> int:
    try:
        tiling = tiling_from_args(args)
        overrides = dict(dynamic_img_size=True) if tiling is not None else {}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            predictor = load_predictor(args.run_dir, args.which, args.device, **overrides)
        if tiling is not None:  # a tile or overlap the model's patch cannot take: one line now, not per image
            tiling.wrap(predictor.model, args.batch_size)
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for warning in caught:
        print(f"warning: {warning.message}", file=sys.stderr)

    files, problems = find_images(args.paths)
    skipped = [dict(path=path, reason=reason) for path, reason in problems]
    for problem in skipped:
        print(f"skipped {problem['path']}: {problem['reason']}", file=sys.stderr)
    predictions: list[dict[str, Any]] = []
    for result in iter_predictions(predictor, files, args.top_k, args.batch_size, tiling):
        if result.error is not None:
            skipped.append(dict(path=result.path, reason=result.error))
            print(f"skipped {result.path}: {result.error}", file=sys.stderr, flush=True)
            continue
        predictions.append(dict(
            path=result.path,
            top_k=[dict(class_name=name, probability=probability) for name, probability in result.top_k],
        ))
        if not args.json:
            print(_as_line(result), flush=True)
    if args.json:
        document = dict(
            run_dir=args.run_dir, weights=args.which, device=str(predictor.device),
            data_config=predictor.data_config,
            tiling=None if tiling is None else dict(tile=list(tiling.tile), overlap=list(tiling.overlap), merge=tiling.merge),
            predictions=predictions, skipped=skipped,
        )
        print(json.dumps(document, indent=1))
    if not predictions:
        print(f"error: no image could be read among {', '.join(args.paths)}", file=sys.stderr)
        return 1
    return 0
