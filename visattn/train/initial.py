"""Where a run's first weights come from: a local file or run (``--initial-checkpoint``), or timm's
pretrained weights (``--pretrained``).

Both end as a state dict that :func:`visattn.models.load_weights` loads into the converted model, so
either may come from another image size (position embeddings resampled), another class count (a new
head) or another attention type (its own parameters left out, the new type's initialised by its layer).

Files are read without unpickling arbitrary objects: safetensors, or ``torch.load(weights_only=True)``
through timm's ``load_state_dict`` (which takes the EMA weights of a timm training checkpoint when it has
them). ``--pretrained`` looks in the Hugging Face cache first and downloads only when the hub answers
within seconds; otherwise it stops at once with one line saying how to give the file instead.
"""
from __future__ import annotations

import pickle
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch
import torch.nn as nn
from huggingface_hub import constants as hf_constants
from huggingface_hub import try_to_load_from_cache
from safetensors import SafetensorError
from timm.models import get_pretrained_cfg, load_state_dict, load_state_dict_from_hf

from visattn.models import MODEL_SHAPES, load_weights, merged_state_dict
from visattn.predict import BEST_WEIGHTS
from visattn.train.run_dir import is_run_dir
from visattn.train.config import ConfigError, TrainConfig

SUFFIXES = (".safetensors", ".pth", ".pt", ".bin", ".pth.tar")
# timm's hub weights, in the order timm's load_state_dict_from_hf prefers them.
HUB_FILES = ("model.safetensors", "pytorch_model.bin")
HUB_PROBE_SECONDS = 3.0


@dataclass
class InitialWeights:
    """A run's first weights, read before anything else is built so that a bad file or an unreachable
    hub stops the run at once."""

    state_dict: dict[str, torch.Tensor]
    source: str  # the file (or hub repository) they came from
    key: str  # the config key that asked for them


def read_initial_weights(config: TrainConfig) -> InitialWeights | None:
    """The weights ``config`` starts from (``initial_checkpoint`` or ``pretrained``), None for fresh ones.

    ConfigError (one line) for a file that cannot be read, and for pretrained weights that are neither
    cached nor downloadable.
    """
    if config.initial_checkpoint is not None:
        return InitialWeights(*read_initial_checkpoint(config.initial_checkpoint), key="initial_checkpoint")
    if config.pretrained:
        return InitialWeights(*read_pretrained(config.model, config.model_kwargs), key="pretrained")
    return None


def load_initial_weights(model: nn.Module, initial: InitialWeights) -> list[str]:
    """Load ``initial`` into ``model``; lines saying where the weights came from and what was adapted.
    ConfigError (one line naming the keys and shapes) when they do not fit."""
    try:
        report = load_weights(model, initial.state_dict)
    except ValueError as error:
        raise ConfigError(f"{initial.key}: {initial.source}: {error}") from None
    return [f"initial weights: {initial.source}", *report.lines()]


def read_initial_checkpoint(path: str) -> tuple[dict[str, torch.Tensor], str]:
    """(state dict, the file it came from) of a state-dict file or a visattn run directory's best weights."""
    given = Path(path)
    if given.is_dir():
        if not is_run_dir(given):
            raise ConfigError(f"initial_checkpoint: {given} is a directory but not a visattn run (no config.yaml)")
        file = given / BEST_WEIGHTS
        if not file.is_file():
            raise ConfigError(f"initial_checkpoint: run {given} has no {BEST_WEIGHTS} yet (no finished epoch)")
    elif given.is_file():
        if not given.name.endswith(SUFFIXES):
            raise ConfigError(
                f"initial_checkpoint: {given} is not a weights file; accepted: a run directory or {', '.join(SUFFIXES)}"
            )
        file = given
    else:
        raise ConfigError(f"initial_checkpoint: {given} does not exist")
    return read_state_dict(file, "initial_checkpoint"), str(file)


def read_state_dict(file: Path, what: str) -> dict[str, torch.Tensor]:
    """The state dict in ``file``, low-rank adapters merged into their weights (a checkpoint of a run with
    adapters holds them apart)."""
    try:
        state_dict = merged_state_dict(load_state_dict(str(file), weights_only=True))
    except pickle.UnpicklingError:
        raise ConfigError(
            f"{what}: {file} holds pickled objects besides tensors, which torch.load(weights_only=True) refuses; "
            "save model.state_dict() with torch.save or safetensors"
        ) from None
    except (SafetensorError, RuntimeError, OSError, EOFError) as error:
        raise ConfigError(f"{what}: cannot read {file}: {str(error).splitlines()[0] if str(error) else type(error).__name__}") from None
    if not isinstance(state_dict, dict) or not all(isinstance(value, torch.Tensor) for value in state_dict.values()):
        raise ConfigError(f"{what}: {file} is not a state dict (a mapping of names to tensors)")
    return state_dict


def read_pretrained(model_name: str, model_kwargs: dict[str, Any]) -> tuple[dict[str, torch.Tensor], str]:
    """(state dict, where it came from) of timm's pretrained weights of ``model_name``: a
    ``pretrained_cfg_overlay`` file, the Hugging Face cache, or the hub when it can be reached."""
    provide = (
        "give the file with --initial-checkpoint PATH (or --model-kwargs 'pretrained_cfg_overlay={file: PATH}')"
    )
    overlay = model_kwargs.get("pretrained_cfg_overlay") or {}
    if overlay.get("file"):
        return read_state_dict(Path(overlay["file"]), "pretrained_cfg_overlay"), str(overlay["file"])
    if model_name in MODEL_SHAPES:
        raise ConfigError(f"pretrained: no weights are published for {model_name}; start from a run with --initial-checkpoint RUN_DIR")
    cfg = get_pretrained_cfg(model_name)
    if cfg is None or not (cfg.hf_hub_id or cfg.url):
        raise ConfigError(f"pretrained: timm has no pretrained weights for {model_name}; {provide}")
    if cfg.hf_hub_id:
        repo_id, *revision = cfg.hf_hub_id.split("@")
        names = (cfg.hf_hub_filename,) if cfg.hf_hub_filename else HUB_FILES
        for name in names:
            cached = try_to_load_from_cache(repo_id, name, revision=revision[0] if revision else None)
            if isinstance(cached, str):
                return read_state_dict(Path(cached), "pretrained"), cached
        where, host = f"{repo_id} on the Hugging Face hub", urlparse(hf_constants.ENDPOINT)
    else:
        where, host = cfg.url, urlparse(cfg.url)
    if not _reachable(host.hostname or "", host.port or (443 if host.scheme == "https" else 80)):
        raise ConfigError(
            f"pretrained: the weights of {model_name} ({where}) are not cached and {host.hostname} cannot be "
            f"reached; {provide}"
        )
    if cfg.hf_hub_id:
        name = cfg.hf_hub_filename or HUB_FILES[-1]
        return load_state_dict_from_hf(cfg.hf_hub_id, name, weights_only=True), cfg.hf_hub_id
    if cfg.custom_load:
        raise ConfigError(f"pretrained: timm reads {cfg.url} with a loader of its own; {provide}")
    return torch.hub.load_state_dict_from_url(cfg.url, map_location="cpu", weights_only=True), cfg.url


def _reachable(host: str, port: int) -> bool:
    """Whether a TCP connection to ``host`` opens within HUB_PROBE_SECONDS (the hub's client would retry
    for a minute before giving up)."""
    try:
        socket.create_connection((host, port), timeout=HUB_PROBE_SECONDS).close()
    except OSError:
        return False
    return True
