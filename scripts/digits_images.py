"""Write the digits that training evaluates on as PNG files, one folder per class, to try
``visattn-predict`` on images the model has not trained on.

    python scripts/digits_images.py digits_png             # the 360 evaluation digits: digits_png/<digit>/<index>.png
    python scripts/digits_images.py digits_png --count 20

The images are the 8x8 grey-level scans as training reads them (visattn.train.data.load_digits_splits,
the default 20% evaluation split), saved losslessly; the layout is also an ImageFolder for
``train.py --dataset imagefolder``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from visattn.train.config import TrainConfig
from visattn.train.datasets.local import load_digits_splits


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder to write <digit>/<index>.png into")
    parser.add_argument("--count", type=int, default=None, help="only the first COUNT evaluation digits")
    args = parser.parse_args(argv)
    evaluation = load_digits_splits(TrainConfig().eval_fraction).eval
    count = len(evaluation) if args.count is None else min(args.count, len(evaluation))
    for index in range(count):
        image, label = evaluation[index]
        folder = args.out / str(label)
        folder.mkdir(parents=True, exist_ok=True)
        image.save(folder / f"{index:03d}.png")
    print(f"wrote {count} digits to {args.out}/<digit>/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
