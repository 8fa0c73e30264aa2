"""The generated tasks (:mod:`visattn.train.generated_tasks`) as ``--dataset`` names: each sample drawn from its
seed when it is read, at the config's image size (or at ``canvas_size``); nothing to download, and only the
normalisation statistics remembered under the data directory."""
from __future__ import annotations

from visattn.train.datasets.spec import DataSource, DatasetSpec, DataSplits
from visattn.train.generated_tasks import TASKS, load_generated

# The side the recipes draw at: 128 px, a 32 x 32 grid at patch 4.
DEFAULT_IMG_SIZE = 128


def load_generated_splits(name: str, source: DataSource) -> DataSplits:
    """Train, val and test of task ``name`` as drawn for ``source`` (its options and image size)."""
    image_hw = source.image_hw or (DEFAULT_IMG_SIZE, DEFAULT_IMG_SIZE)
    generated = load_generated(name, source.options, image_hw, source.root, source.progress)
    return DataSplits(
        train=generated.train, eval=generated.test, val=generated.val, num_classes=generated.num_classes,
        mean=generated.mean, std=generated.std,
    )


SPECS: tuple[DatasetSpec, ...] = tuple(
    DatasetSpec(
        name=name, title=name, reader="visattn.train.generated_tasks",
        default_img_size=DEFAULT_IMG_SIZE, official_splits="train / val / test, drawn from a seed (dataset_kwargs)",
        load=lambda source, name=name: load_generated_splits(name, source),
    )
    for name in TASKS
)
