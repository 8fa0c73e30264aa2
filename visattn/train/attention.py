"""The attention a run builds: ``attn="auto"`` resolved to a type, and ``attn_kwargs`` narrowed to the
options of the types in use (:func:`visattn.layers.options.options_per_type`), before the model is built.

A recipe may carry options for a type that the command line replaces (``--config
configs/hires_imagefolder.yaml --attn linear``): options keyed by type (``neighborhood: {kernel_size: 7}``)
are passed over silently, flat options that no type in use accepts are dropped with a notice.
``attn="timm"`` (timm's own Attention) takes no options: every flat one is dropped with a notice.
"""
from __future__ import annotations

import torch

from visattn.layers.options import options_per_type
from visattn.models import TIMM_ATTENTION
from visattn.models.auto import select_attention
from visattn.train.config import ConfigError, TrainConfig


def names_per_block(config: TrainConfig) -> list[str]:
    """The attention type of each block; ``attn="auto"`` chosen as the model will choose it, at the run's
    batch size per process, for the device the run trains on (accelerate takes the GPU where there is one)."""
    if config.attn == "auto":
        patch = (config.patch_size, config.patch_size)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        try:
            return [select_attention(config.model, config.image_hw, patch, config.batch_size, device)] * config.depth
        except ValueError as error:
            raise ConfigError(f"attn: auto cannot choose for {config.model!r}: {error}") from None
    return [config.attn] * config.depth if isinstance(config.attn, str) else list(config.attn)


def resolve_attention(config: TrainConfig) -> list[str]:
    """Set ``config.attn`` to the types the model is built with and ``config.attn_kwargs`` to their options
    (flat for one type, under each type's name for a list: what :func:`visattn.convert` takes). Returns
    one-line notices of the options dropped. Resolving a resolved config changes nothing."""
    names = names_per_block(config)
    timm_kept = config.attn == TIMM_ATTENTION  # timm's Attention takes no options: every flat one is dropped
    try:
        per_type, unused = options_per_type([] if timm_kept else names, config.attn_kwargs)
    except ValueError as error:
        raise ConfigError(f"attn_kwargs: {error}") from None
    if timm_kept:
        config.attn_kwargs = {}
        return [f"attn_kwargs: {key} dropped: {TIMM_ATTENTION} (timm's own Attention) takes no options" for key in unused]
    if isinstance(config.attn, list):
        config.attn, config.attn_kwargs = names, {name: options for name, options in per_type.items() if options}
    else:
        config.attn, config.attn_kwargs = names[0], per_type[names[0]]
    in_use = ", ".join(per_type)
    return [f"attn_kwargs: {key} dropped: not an option of {in_use}" for key in unused]
