"""The tiled engine shared by the 2D local attention ops (:mod:`visattn.ops.neighborhood`,
:mod:`visattn.ops.sparse`, :mod:`visattn.ops.longformer`).

    plans.py    the windows of each grid axis (:class:`AxisPlan`) and their sizes (:class:`AxisTiling`)
    engine.py   :func:`tiled_local_attn`: the path choice, the gathered and the dense paths
    chunked.py  the CPU inference path, tiles a chunk at a time
    flex.py     FlexAttention over the tokens in tile order, block masks cached (CUDA without Triton)
    triton.py   the CUDA path: fused Triton kernels on 2D query tiles, windows computed from positions
                (kernels in triton_kernels.py)
    naive.py    explicit N x N scores with a mask, the naive twin every op is compared with
"""
from visattn.ops.local.engine import LOCAL_PATHS, check_grid_for_order, planned_local_backend, tiled_local_attn
from visattn.ops.local.flex import TOKEN_ORDERS, FlexLayout, flex_layout
from visattn.ops.local.naive import naive_masked_attn, separable_grid_mask, with_prefix_tokens
from visattn.ops.local.plans import (
    ALIGNED_TILE,
    AxisPlan,
    AxisTiling,
    WindowRule,
    blocked_axis,
    blocked_tiling,
    check_aligned_tile,
    check_tile_alignment,
    neighborhood_axis,
    neighborhood_tiling,
    tile_neighborhood_axis,
    tile_neighborhood_tiling,
    tiles_holding,
)

__all__ = [
    "ALIGNED_TILE",
    "LOCAL_PATHS",
    "TOKEN_ORDERS",
    "AxisPlan",
    "AxisTiling",
    "FlexLayout",
    "WindowRule",
    "blocked_axis",
    "blocked_tiling",
    "check_aligned_tile",
    "check_grid_for_order",
    "check_tile_alignment",
    "flex_layout",
    "naive_masked_attn",
    "neighborhood_axis",
    "neighborhood_tiling",
    "planned_local_backend",
    "separable_grid_mask",
    "tile_neighborhood_axis",
    "tile_neighborhood_tiling",
    "tiled_local_attn",
    "tiles_holding",
    "with_prefix_tokens",
]
