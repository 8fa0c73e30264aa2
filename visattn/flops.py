"""Moved to :mod:`visattn.bench.flops`; the per-type formulas are now methods of the layer classes
(``mixing_flops``, ``mixing_memory``, ``qkv_flops``), so ``COST_MODELS`` and ``cost_model`` are gone.
This alias is kept for one release."""
from visattn._moved import warn_moved
from visattn.bench.flops import (
    ViTShape,
    attention_options,
    estimate_memory,
    mixing_flops,
    patch_embed_flops,
    train_flops,
    vit_flops,
)
from visattn.bench.sweep import EXPLICIT_SOFTMAX
from visattn.layers.cost import MixingMemory, TokenLayout

warn_moved(__name__, "visattn.bench.flops")

__all__ = [
    "EXPLICIT_SOFTMAX",
    "MixingMemory",
    "TokenLayout",
    "ViTShape",
    "attention_options",
    "estimate_memory",
    "mixing_flops",
    "patch_embed_flops",
    "train_flops",
    "vit_flops",
]
