"""The one mapping from attention name to layer class. Models, train.py, the benchmark and the tests
all read it; adding an attention type is one new module in visattn/layers plus one line here."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from visattn.layers.axial import AxialAttention
from visattn.layers.base import GridAttention
from visattn.layers.floor import FloorAttention
from visattn.layers.linear import LinearAttention
from visattn.layers.linformer import LinformerAttention
from visattn.layers.longformer import LongformerAttention
from visattn.layers.neighborhood import NeighborhoodAttention
from visattn.layers.softmax import SoftmaxAttention
from visattn.layers.sparse import SparseAttention

ATTENTION_LAYERS: dict[str, type[GridAttention]] = {
    "softmax": SoftmaxAttention,
    "linear": LinearAttention,
    "floor": FloorAttention,
    "axial": AxialAttention,
    "linformer": LinformerAttention,
    "neighborhood": NeighborhoodAttention,
    "sparse": SparseAttention,
    "longformer": LongformerAttention,
}


def list_attentions() -> list[str]:
    """Names accepted wherever an attention type is asked for (``attn=...``)."""
    return list(ATTENTION_LAYERS)


def get_attention(name: str) -> type[GridAttention]:
    """The layer class registered under ``name``; ValueError listing the valid names otherwise."""
    if not isinstance(name, str) or name not in ATTENTION_LAYERS:
        raise ValueError(f"unknown attention {name!r}; valid: {', '.join(ATTENTION_LAYERS)}")
    return ATTENTION_LAYERS[name]


def attention_options(attn: str, attn_kwargs: Mapping[str, Any], grid: tuple[int, int]) -> dict[str, Any]:
    """The type options a layer is built with: its constructor defaults, ``ref_grid`` set to the model's
    grid (as :func:`visattn.convert` does), then ``attn_kwargs``; what its cost formulas take."""
    options = get_attention(attn).type_options()
    if "ref_grid" in options:
        options["ref_grid"] = tuple(grid)
    return options | dict(attn_kwargs)
