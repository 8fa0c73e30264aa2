"""Every ``--dataset`` name, in one registry of :class:`DatasetSpec` (how its splits are read, its default
image size, its official splits, how to fetch it).

    spec.py      DatasetSpec, DataSplits, DataError, the fixed stratified cut of a missing split
    local.py     what needs no download: the embedded digits, any ImageFolder
    image_files.py  reading an ImageFolder's files, checking every file a run reads before it starts
    public.py    public datasets through their torchvision classes (CIFAR, STL-10, Flowers-102, Pets, ...)
    generated_tasks.py  the generated tasks (cluttered-digits, pathfinder), drawn from a seed
"""
from visattn.train.datasets import generated_tasks, local, public
from visattn.train.datasets.spec import SPLIT_SEED, VAL_FRACTION, DataError, DataSource, DatasetSpec, DataSplits

DATASET_SPECS: dict[str, DatasetSpec] = {spec.name: spec for spec in (*local.SPECS, *public.SPECS, *generated_tasks.SPECS)}

__all__ = [
    "DATASET_SPECS", "SPLIT_SEED", "VAL_FRACTION", "DataError", "DataSource", "DatasetSpec", "DataSplits",
]
