"""``train.py``'s command line: one flag per TrainConfig field, generated from the dataclass.

Every field is a flag (``embed_dim`` -> ``--embed-dim``), its help the field's ``help`` metadata.
Booleans are ``--augment``/``--no-augment``; lists are comma-separated (``--attn axial,softmax,axial,softmax``,
``--img-size 32,48``); mappings (``attn_kwargs``, ``model_kwargs``, ``opt_kwargs``) take ``key=value``
words or a mapping, read by :func:`visattn.layers.options.parse_key_values`
(``--attn-kwargs kernel_size=5 dilation=2``). A flag's text is checked against the field's type here,
and the values against the rest of the config by :class:`~visattn.train.config.TrainConfig`.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from visattn.layers import list_attentions
from visattn.layers.options import parse_key_values
from visattn.models import TIMM_ATTENTION
from visattn.train.attention import resolve_attention
from visattn.train.run_dir import CONFIG_FILE, is_run_dir
from visattn.train.run_log import SUMMARY_FILE
from visattn.train.config import (
    FIELD_TYPES, MIXED_PRECISION, ConfigError, TrainConfig, changed_keys, check_keys, make_config, read_yaml,
    run_dir_of,
)
from visattn.train.fieldtypes import accepts, accepts_scalar, alternatives, type_name


@dataclass(frozen=True)
class RunOptions:
    """What to do with the run directory and the data; not part of the recipe."""

    config_file: str | None = None
    resume: bool = False
    resume_from: str | None = None
    overwrite: bool = False
    download: bool = False
    measure_loader: int = 0
    precision_note: str = ""  # the start-up line: which mixed precision applies and why


# What ``accelerate launch`` exports to the script: its --mixed_precision, or its config file's, else "no".
LAUNCHER_PRECISION = "ACCELERATE_MIXED_PRECISION"


def flag(key: str) -> str:
    """The command-line flag of config key ``key``."""
    return "--" + key.replace("_", "-")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Train a visattn ViT with accelerate (python train.py ... or accelerate launch train.py ...).",
        argument_default=argparse.SUPPRESS,
    )
    run = parser.add_argument_group("run")
    run.add_argument("--config", dest="config_file", metavar="FILE", help="YAML recipe (configs/*.yaml); flags override it")
    run.add_argument("--resume", action="store_true", help="continue the run in --run-dir from its last checkpoint")
    run.add_argument("--resume-from", metavar="CHECKPOINT",
                     help="like --resume, from this checkpoint of --run-dir (a path or a name such as step_00000008)")
    run.add_argument("--overwrite", action="store_true", help="replace the previous run in --run-dir")
    run.add_argument("--download", action="store_true", help="download the dataset if it is not in --data-dir")
    run.add_argument("--measure-loader", metavar="BATCHES",
                     help="before training, time this many training batches pulled from the loader alone (no model) "
                          "and print its images/s, to compare with the steps' images/s")
    recipe = parser.add_argument_group("recipe (every key of TrainConfig)")
    for f in dataclasses.fields(TrainConfig):
        annotation = FIELD_TYPES[f.name]
        help_text = f.metadata.get("help", "")
        if f.name == "attn":
            help_text += (
                f": {', '.join(list_attentions())}, auto (chosen from the model and image size), or {TIMM_ATTENTION} "
                "(timm's own Attention kept: the stock timm ViT of the same shape, the reference)"
            )
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        help_text += f" (default: {_as_flag_text(default)})"
        if annotation is bool:
            recipe.add_argument(flag(f.name), dest=f.name, action=argparse.BooleanOptionalAction, help=help_text)
        elif typing.get_origin(annotation) is dict:
            recipe.add_argument(flag(f.name), dest=f.name, nargs="*", metavar="KEY=VALUE", help=help_text)
        else:
            recipe.add_argument(flag(f.name), dest=f.name, metavar=f.name.upper(), help=help_text)
    return parser


def _as_flag_text(value: Any) -> str:
    """A default as one would type it on the command line."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return ",".join(map(str, value)) or "empty"
    if isinstance(value, dict):
        return " ".join(f"{key}={item}" for key, item in value.items()) or "empty"
    return str(value).replace("%", "%%")  # argparse formats help with %


def parse_args(argv: list[str] | None = None) -> tuple[dict[str, Any], dict[str, Any], RunOptions]:
    """(values from --config, values from flags, run options), each key and type checked.

    The two value mappings stay apart because ``--resume`` lays them over the run's saved config
    rather than over the defaults.
    """
    namespace = vars(build_parser().parse_args(argv))
    resume_from = namespace.pop("resume_from", None)
    options = RunOptions(
        config_file=namespace.pop("config_file", None),
        resume=namespace.pop("resume", False) or resume_from is not None,
        resume_from=resume_from,
        overwrite=namespace.pop("overwrite", False),
        download=namespace.pop("download", False),
        measure_loader=_parse_count("--measure-loader", namespace.pop("measure_loader", "0")),
    )
    if options.resume and options.overwrite:
        resume = "--resume-from" if options.resume_from is not None else "--resume"
        raise ConfigError(f"{resume} and --overwrite exclude each other: continue the run, or replace it")
    from_file = read_yaml(options.config_file) if options.config_file else {}
    from_flags = check_keys({key: _parse_flag(key, raw) for key, raw in namespace.items()})
    return from_file, from_flags, options


def resolve_config(argv: list[str] | None = None) -> tuple[TrainConfig, RunOptions, list[str]]:
    """(config, run options, changes): defaults <- --config <- flags, where with --resume the run's saved
    config takes the place of the defaults, and ``changes`` lists 'key: old -> new' for each saved
    setting the flags or file change. ``config.run_dir`` is always set."""
    from_file, from_flags, options = parse_args(argv)
    run_dir = run_dir_of({**from_file, **from_flags})
    saved = None
    if options.resume and is_run_dir(run_dir):
        saved = make_config(read_yaml(run_dir / CONFIG_FILE))
        config = make_config(saved.to_dict(), from_file, from_flags)
    else:
        config = make_config(from_file, from_flags)
    config.mixed_precision, note = choose_mixed_precision(
        config.mixed_precision, "mixed_precision" in from_flags, os.environ.get(LAUNCHER_PRECISION)
    )
    changes = [] if saved is None else changed_keys(saved, _as_built(config))
    transfer_changes = [change for change in changes if change.startswith("transfer_")]
    if transfer_changes:
        raise ConfigError(
            f"--resume cannot change the attention-transfer settings, whose progress the checkpoints hold "
            f"({'; '.join(transfer_changes)}); start a new run (another --run-dir) instead"
        )
    adapter_changes = [change for change in changes if change.startswith("lora_")]
    if adapter_changes:
        raise ConfigError(
            f"--resume cannot change the low-rank adapters, which the checkpoints hold ({'; '.join(adapter_changes)}); "
            "start a new run (another --run-dir) instead"
        )
    config.run_dir = str(run_dir)
    return config, dataclasses.replace(options, precision_note=note), changes


def finished_run_line(config: TrainConfig) -> str | None:
    """One line when ``config.run_dir`` holds a finished run (its summary written) of these very settings: what
    a command that repeats a run prints instead of refusing (``make train`` twice); None otherwise."""
    run_dir = Path(config.run_dir)
    summary_file = run_dir / SUMMARY_FILE
    if not (is_run_dir(run_dir) and summary_file.is_file()):
        return None
    if changed_keys(make_config(read_yaml(run_dir / CONFIG_FILE)), _as_built(config)):
        return None
    test_acc = json.loads(summary_file.read_text())["test_acc"]
    return (f"{run_dir} holds this run, finished: test accuracy {100 * test_acc:.2f}%, results in {summary_file} "
            f"(--overwrite trains it again)")


def choose_mixed_precision(configured: str, from_flag: bool, launcher: str | None) -> tuple[str, str]:
    """(mixed precision, the line saying why): train.py's own --mixed-precision wins; else the launcher's
    (``launcher``: its environment variable, None outside ``accelerate launch``) over the config's; else the config's.

    The launcher's "no" leaves the config's: ``accelerate launch`` exports "no" when nothing was chosen too,
    so a bf16 recipe would otherwise train in fp32 under a plain ``accelerate launch``.
    """
    if from_flag:
        return configured, f"mixed precision: {configured} (train.py --mixed-precision, over the launcher's and the recipe's)"
    if launcher is not None and launcher not in MIXED_PRECISION:
        raise ConfigError(f"{LAUNCHER_PRECISION}: {launcher!r} is not one of {', '.join(MIXED_PRECISION)}")
    if launcher not in (None, "no"):
        return launcher, f"mixed precision: {launcher} (accelerate launch --mixed_precision, over the recipe's {configured})"
    if launcher == "no" and configured != "no":
        return configured, (f"mixed precision: {configured} (the recipe's; accelerate launch's 'no', its default, "
                            "leaves it: pass --mixed-precision no to train.py to turn it off)")
    return configured, f"mixed precision: {configured} (the recipe's)"


def _as_built(config: TrainConfig) -> TrainConfig:
    """A copy of ``config`` with the attention resolved as the run resolves it (a saved config is resolved)."""
    resolved = copy.deepcopy(config)
    resolve_attention(resolved)
    return resolved


def _parse_count(name: str, text: str) -> int:
    """A run option's word as a whole number >= 0."""
    try:
        count = int(text)
    except ValueError:
        raise ConfigError(f"{name}: expected int, got {text!r}") from None
    if count < 0:
        raise ConfigError(f"{name}: must be >= 0, got {count}")
    return count


def _parse_flag(key: str, raw: Any) -> Any:
    """A flag's argparse value (a word, the words of a mapping, or a bool) as the field's type."""
    annotation = FIELD_TYPES[key]
    if annotation is bool:
        return raw
    if typing.get_origin(annotation) is dict:
        mapping = {}
        for word in raw:
            try:
                mapping.update(parse_key_values(word))
            except ValueError as error:
                raise ConfigError(f"{flag(key)}: {error}") from None
        return mapping
    list_types = [arg for arg in alternatives(annotation) if typing.get_origin(arg) is list]
    if list_types and ("," in raw or not accepts_scalar(annotation)):
        (item_type,) = typing.get_args(list_types[0])
        return [_parse_scalar(key, item.strip(), item_type) for item in raw.split(",") if item.strip()]
    return _parse_scalar(key, raw, annotation)


def _parse_scalar(key: str, text: str, annotation: Any) -> Any:
    """One command-line word as the scalar type(s) the field accepts."""
    if accepts(annotation, type(None)) and text.lower() in ("none", "null"):
        return None
    if accepts(annotation, str):
        return text
    for kind in (int, float):
        if accepts(annotation, kind):
            try:
                return kind(text)
            except ValueError:
                continue
    raise ConfigError(f"{flag(key)}: expected {type_name(annotation)}, got {text!r}")
