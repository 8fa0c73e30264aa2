"""What the layers run by the tiled local engine share: cost formulas from their windows per axis, and the
token order they read (raster, or FlexAttention's tile order kept between the layers by the model)."""
from __future__ import annotations

import threading
from abc import abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from visattn.layers.base import GridAttention
from visattn.layers.cost import CostCase, MixingMemory, local_memory, windowed_flops
from visattn.ops.local import AxisPlan, AxisTiling, FlexLayout, flex_layout, planned_local_backend

# The ids of the layers that run on tokens in tile order now, per thread: a model shared by threads (a server's
# concurrent forwards) must not see another thread's order. A thread-local, not a ContextVar, which torch.compile
# does not trace; a set of ids, not of layers, since a compiled graph's guard on a tuple of modules checks only its
# length, so a layer compiled in tile order would take that graph for another layer's.
_tile_ordered = threading.local()


def set_tile_ordered(layers: Sequence[GridAttention]) -> frozenset[int]:
    """Makes ``layers`` read and write tokens in tile order on this thread; returns the ids of the layers that
    did before, to restore with :func:`restore_tile_ordered`."""
    previous = getattr(_tile_ordered, "ids", frozenset())
    _tile_ordered.ids = frozenset(id(layer) for layer in layers)
    return previous


def restore_tile_ordered(previous: frozenset[int]) -> None:
    """Puts back what :func:`set_tile_ordered` returned."""
    _tile_ordered.ids = previous


class LocalWindowAttention(GridAttention):
    """A type whose patches attend within a window that is a product of one window per grid axis (its op
    runs :func:`visattn.ops.local.tiled_local_attn`); prefix tokens attend to all tokens.

    Its input and output are in raster order (x is (B, P + H * W, C)) unless the model's blocks run with
    the tokens in FlexAttention's tile order (:class:`visattn.models.tile_order.TileOrderBlocks`, through
    :func:`set_tile_ordered`): x then holds the same tokens in the slots of :meth:`tile_layout`."""

    @property
    def token_order(self) -> str:
        """``"tile"`` while this thread's model runs its blocks in tile order, else ``"raster"``."""
        return "tile" if id(self) in getattr(_tile_ordered, "ids", frozenset()) else "raster"

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
        needs_grad = torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in self.parameters()))
        path = planned_local_backend(x.device, needs_grad, self.dropout_p, rows, cols, p, False)
        return flex_layout(rows, cols, p, False) if path == "flex" else None

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
