"""What the layers run by the tiled local engine share: cost formulas from their windows per axis."""
from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping
from typing import Any

from visattn.layers.base import GridAttention
from visattn.layers.cost import CostCase, MixingMemory, local_memory, windowed_flops
from visattn.ops.local import AxisTiling


class LocalWindowAttention(GridAttention):
    """A type whose patches attend within a window that is a product of one window per grid axis (its op
    runs :func:`visattn.ops.local.tiled_local_attn`); prefix tokens attend to all tokens."""

    @staticmethod
    @abstractmethod
    def window_tilings(grid: tuple[int, int], options: Mapping[str, Any]) -> tuple[AxisTiling, AxisTiling]:
        """The tiling of the rows and of the columns of ``grid`` with the type ``options``."""

    @classmethod
    def mixing_flops(cls, case: CostCase) -> int:
        return windowed_flops(case, *cls.window_tilings(case.layout.grid, case.options))

    @classmethod
    def mixing_memory(cls, case: CostCase) -> MixingMemory:
        """The Triton kernels' tensors (or FlexAttention's) where the engine takes them (CUDA), else the
        tiles' (:func:`local_memory`)."""
        rows, cols = cls.window_tilings(case.layout.grid, case.options)
        return local_memory(case, rows, cols, case.layout.num_prefix_tokens, False)
