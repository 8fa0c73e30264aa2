"""Training visattn ViTs with accelerate (the ``visattn[train]`` extra); ``train.py`` puts the pieces together.

    config.py       TrainConfig: the fields of a recipe, their checks, YAML recipes
    fieldtypes.py   values checked against the fields' type annotations
    cli.py          one flag per field; defaults <- --config <- flags (<- the saved config on --resume)
    augment.py      timm augmentation policies checked before a run starts
    datasets/       the registry of --dataset names: how each is read, its splits, default size, fetch command
    data.py         the dataset of a config, transforms, seeded augmentation
    generated_tasks/  the generated tasks cluttered-digits and pathfinder, each sample drawn from a seed when read
    progress.py     the progress bar of a preparation before training (main process, once it runs 2 s)
    build.py        accelerator, data, model, optimizer, scheduler, loaders, mixup from a config
    prepare.py      a run's steps before its first update: build, claim the run directory, prepare, resume
    loop.py         one epoch, evaluation, metrics, weights and checkpoints, the run's summary
    transfer.py     the attention-transfer stage of a run, before its fine-tune epochs
    run_dir.py       the run directory: its checks, the run lock, files written whole
    checkpoint.py   crash-safe, verified checkpoints and the trained weights
    run_log.py      per-epoch metrics, plot, summary, peak memory

The names here are what code outside training (``visattn.experiments``) uses: a run's config as train.py
resolves it, its data as evaluation transforms it, and the files a run directory holds.
"""
from visattn.train.attention import resolve_attention
from visattn.train.build import default_cpu_threads
from visattn.train.cli import build_parser, resolve_config
from visattn.train.config import ConfigError, TrainConfig, make_config, read_yaml
from visattn.train.data import eval_data_config, load_splits, without_images
from visattn.train.datasets import DataError
from visattn.train.run_log import METRICS_FILE, SUMMARY_FILE, TRANSFER_METRICS_FILE
from visattn.train.run_dir import CONFIG_FILE, list_checkpoints

__all__ = [
    "CONFIG_FILE",
    "METRICS_FILE",
    "SUMMARY_FILE",
    "TRANSFER_METRICS_FILE",
    "ConfigError",
    "DataError",
    "TrainConfig",
    "build_parser",
    "default_cpu_threads",
    "eval_data_config",
    "list_checkpoints",
    "load_splits",
    "make_config",
    "read_yaml",
    "resolve_attention",
    "resolve_config",
    "without_images",
]
