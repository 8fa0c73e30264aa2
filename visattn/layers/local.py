"""What the layers run by the tiled local engine share: cost formulas from their windows per axis."""
from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping
from typing import Any

import torch

from visattn.layers.base import GridAttention
from visattn.layers.cost import MixingMemory, TokenLayout, local_memory, tiled_memory, windowed_flops
from visattn.ops.local import AxisTiling


class LocalWindowAttention(GridAttention):
    """A type whose patches attend within a window that is a product of one window per grid axis (its op
    runs :func:`visattn.ops.local.tiled_local_attn`); prefix tokens attend to all tokens."""

    @staticmethod
    @abstractmethod
    def window_tilings(grid: tuple[int, int], options: Mapping[str, Any]) -> tuple[AxisTiling, AxisTiling]:
        """The tiling of the rows and of the columns of ``grid`` with the type ``options``."""

    @classmethod
    def mixing_flops(cls, layout: TokenLayout, num_heads: int, head_dim: int, options: Mapping[str, Any]) -> int:
        return windowed_flops(layout, num_heads * head_dim, *cls.window_tilings(layout.grid, options))

    @classmethod
    def mixing_memory(
        cls, layout: TokenLayout, num_heads: int, head_dim: int, options: Mapping[str, Any], act_bytes: int
    ) -> MixingMemory:
        return tiled_memory(layout, num_heads, head_dim, *cls.window_tilings(layout.grid, options), 0, act_bytes)

    @classmethod
    def mixing_memory_on(
        cls,
        device: torch.device,
        layout: TokenLayout,
        num_heads: int,
        head_dim: int,
        options: Mapping[str, Any],
        act_bytes: int,
    ) -> MixingMemory:
        """FlexAttention's tensors where the engine takes it (CUDA), else the tiles' (:func:`local_memory`)."""
        rows, cols = cls.window_tilings(layout.grid, options)
        return local_memory(layout, num_heads, head_dim, rows, cols, layout.num_prefix_tokens, False, act_bytes, device)
