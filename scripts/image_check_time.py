"""Time the check train.py runs on an ImageFolder's files before training (visattn.train.datasets.image_files),
on a folder of photo-like JPEGs.

    python scripts/image_check_time.py /tmp/jpegs                 # 2,000 JPEGs, written once
    python scripts/image_check_time.py /tmp/jpegs --count 5000 --threads 1,2,4

The JPEGs are crops of scikit-learn's two sample photographs (shipped in its wheel), resized to 350-500 x
300-400 pixels (ImageNet's typical size) and saved at quality 90, one folder per class (10 classes). Printed:
a full decode of every file (as training reads it) for reference; the check in draft mode with nothing
remembered, for each thread count; and the check again, everything remembered. The files are in the page
cache (just written or read); a cold disk adds its read time.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image
from sklearn.datasets import load_sample_images

from visattn.predict import read_image
from visattn.train.datasets.image_files import check_image_files


def write_jpegs(root: Path, count: int) -> list[str]:
    photos = [Image.fromarray(pixels) for pixels in load_sample_images().images]
    rng = np.random.default_rng(0)
    paths = []
    for index in range(count):
        path = root / f"class{index % 10}" / f"{index:06d}.jpg"
        paths.append(str(path))
        if path.exists():
            continue
        photo = photos[index % len(photos)]
        width, height = photo.size
        crop_w, crop_h = int(rng.integers(200, width)), int(rng.integers(200, height))
        left, top = int(rng.integers(0, width - crop_w + 1)), int(rng.integers(0, height - crop_h + 1))
        size = (int(rng.integers(350, 501)), int(rng.integers(300, 401)))
        path.parent.mkdir(parents=True, exist_ok=True)
        photo.crop((left, top, left + crop_w, top + crop_h)).resize(size, Image.BICUBIC).save(path, quality=90)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="where the JPEGs are (written there if missing)")
    parser.add_argument("--count", type=int, default=2000, help="number of JPEGs")
    parser.add_argument("--threads", default="1,2", help="thread counts of the check, comma-separated")
    args = parser.parse_args(argv)
    paths = write_jpegs(args.folder, args.count)
    megabytes = sum(os.path.getsize(path) for path in paths) / 1e6
    print(f"{len(paths)} JPEGs, {megabytes:.0f} MB ({1000 * megabytes / len(paths):.0f} kB each on average), "
          f"{os.cpu_count()} CPUs")

    started = time.perf_counter()
    for path in paths:
        read_image(path)
    seconds = time.perf_counter() - started
    print(f"full decode, as training reads:  {seconds:6.2f} s  {1000 * seconds / len(paths):.2f} ms per image")
    with tempfile.TemporaryDirectory() as cache:
        os.environ["XDG_CACHE_HOME"] = cache
        for threads in [int(word) for word in args.threads.split(",")]:
            for entry in Path(cache).rglob("*.json"):
                entry.unlink()  # nothing remembered
            check = check_image_files(paths, args.folder, threads)
            assert check.decoded == len(paths) and not check.unreadable
            print(f"check, {threads} thread(s), nothing remembered: {check.seconds:6.2f} s  "
                  f"{1000 * check.seconds / len(paths):.2f} ms per image")
        check = check_image_files(paths, args.folder, 1)
        assert check.decoded == 0
        print(f"check again, all remembered:     {check.seconds:6.2f} s  {1000 * check.seconds / len(paths):.3f} ms per image")
    return 0


if __name__ == "__main__":
    sys.exit(main())
