"""Moved to :mod:`visattn.train.config` (the command line to :mod:`visattn.train.cli`); this alias is
kept for one release."""
from visattn._moved import warn_moved
from visattn.train.cli import RunOptions, build_parser, parse_args
from visattn.train.config import (
    DATASETS,
    MIXED_PRECISION,
    SCHEDULERS,
    ConfigError,
    TrainConfig,
    changed_keys,
    check_keys,
    config_yaml,
    make_config,
    read_yaml,
)

warn_moved(__name__, "visattn.train.config")

__all__ = [
    "DATASETS",
    "MIXED_PRECISION",
    "SCHEDULERS",
    "ConfigError",
    "RunOptions",
    "TrainConfig",
    "build_parser",
    "changed_keys",
    "check_keys",
    "config_yaml",
    "make_config",
    "parse_args",
    "read_yaml",
]
