"""What the layers run by the tiled local engine share: cost formulas from their windows per axis, and the
token order they read (raster, or FlexAttention's tile order kept between the layers by the model)."""
from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping
from typing import Any

import torch

from visattn.layers.base import GridAttention
from visattn.layers.cost import CostCase, MixingMemory, local_memory, windowed_flops
from visattn.ops.backends import needs_autograd
from visattn.ops.local import AxisPlan, AxisTiling, FlexLayout, flex_layout, planned_local_backend


class LocalWindowAttention(GridAttention):
    """A type whose patches attend within a window that is a product of one window per grid axis (its op
    runs :func:`visattn.ops.local.tiled_local_attn`); prefix tokens attend to all tokens.

    ``token_order`` is ``"raster"`` (x is (B, P + H * W, C)) unless the model's blocks run with the tokens
    in FlexAttention's tile order (:class:`visattn.models.tile_order.TileOrderBlocks` sets ``"tile"`` for
    the run: x is then (B, S, C) in the slots of :meth:`tile_layout`)."""

    token_order: str = "raster"

    @abstractmethod
    def window_plans(self, grid: tuple[int, int], device: torch.device) -> tuple[AxisPlan, AxisPlan]:
        """The window plans of the rows and of the columns of ``grid``, as the layer's op builds them."""

    def tile_layout(self, x: torch.Tensor) -> FlexLayout | None:
        """The FlexAttention layout the op would permute ``x`` (B, P + H * W, C) into: where its path for
        this input is ``flex`` (:func:`visattn.ops.local.planned_local_backend`) and no rope table (whose
        rows follow the raster order) turns q and k; else None."""
        if self.rope is not None or self.grid is None:
            return None
        rows, cols = self.window_plans(self.grid, x.device)
        p = self.num_prefix_tokens
        path = planned_local_backend(x.device, needs_autograd(x, self.qkv.weight), self.dropout_p, rows, cols, p, False)
        return flex_layout(rows, cols, p, False) if path == "flex" else None

    def _checked_grid(self, num_tokens: int) -> tuple[int, int] | None:
        if self.token_order == "tile":  # the op checks the tokens against the layout's slots
            return super()._checked_grid(self.num_prefix_tokens + self.grid[0] * self.grid[1])
        return super()._checked_grid(num_tokens)

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
