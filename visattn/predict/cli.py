"""The ``visattn-predict`` command: the top-k classes of images, with a model trained by ``train.py``.

    visattn-predict runs/digits-axial digit.png more_digits/ --top-k 3
    visattn-predict runs/digits-axial photos/ --json > predictions.json

Prints one line per image (``PATH: CLASS PROBABILITY, ...``), or with ``--json`` one JSON document, on
stdout. A file that cannot be read is one line on stderr (``skipped PATH: REASON``) and the others go on.
Exit status: 0 when at least one image was predicted, 1 when none could be read, 2 for a bad run
directory or argument.
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


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="visattn-predict",
        description="Predict the classes of images with a model trained by train.py: the top-k classes and their "
        "probabilities for each image, with the transform and class names recorded in the run directory.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="run directory written by train.py (holds model.json)")
    parser.add_argument("paths", metavar="IMAGE_OR_FOLDER", nargs="+",
                        help="image files, and folders walked for image files (extensions as torchvision's ImageFolder)")
    parser.add_argument("--top-k", type=_positive_int, default=5, help="classes to print per image")
    parser.add_argument("--batch-size", type=_positive_int, default=DEFAULT_BATCH_SIZE, help="images per forward pass")
    parser.add_argument("--device", default=None,
                        help="cpu, cuda, cuda:1, mps, ... (default: the accelerator where there is one, else cpu)")
    parser.add_argument("--which", choices=sorted(WEIGHTS), default="best", help="which weights of the run")
    parser.add_argument("--json", action="store_true", help="write one JSON document to stdout instead of lines")
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
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            predictor = load_predictor(args.run_dir, args.which, args.device)
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
    for result in iter_predictions(predictor, files, args.top_k, args.batch_size):
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
            data_config=predictor.data_config, predictions=predictions, skipped=skipped,
        )
        print(json.dumps(document, indent=1))
    if not predictions:
        print(f"error: no image could be read among {', '.join(args.paths)}", file=sys.stderr)
        return 1
    return 0
