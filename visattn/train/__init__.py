"""Training visattn ViTs with accelerate (the ``visattn[train]`` extra); ``train.py`` puts the pieces together.

    config.py       TrainConfig: the fields of a recipe, their checks, YAML recipes
    fieldtypes.py   values checked against the fields' type annotations
    cli.py          one flag per field; defaults <- --config <- flags (<- the saved config on --resume)
    augment.py      timm augmentation policies checked before a run starts
    datasets/       the registry of --dataset names: how each is read, its splits, default size, fetch command
    data.py         the dataset of a config, transforms, seeded augmentation
    generated/      the generated tasks cluttered-digits and pathfinder, drawn from a seed and cached
    build.py        accelerator, data, model, optimizer, scheduler, loaders, mixup from a config
    loop.py         one epoch, evaluation, metrics, weights and checkpoints, the run's summary
    rundir.py       the run directory: its checks, the run lock, files written whole
    checkpoint.py   crash-safe, verified checkpoints and the trained weights
    run_log.py      per-epoch metrics, plot, summary, peak memory
"""
from visattn.train.config import ConfigError, TrainConfig, make_config

__all__ = ["ConfigError", "TrainConfig", "make_config"]
