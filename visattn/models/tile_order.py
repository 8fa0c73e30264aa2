"""The tokens in FlexAttention's tile order once for all blocks, instead of a permutation in every layer.

A local layer on FlexAttention (:mod:`visattn.ops.local.flex`) permutes q, k and v into tile order and its
output back: four gathers of (B, N, C) per layer. Every other part of a block (norms, MLP, residuals,
layer scale, drop path) treats each token alike, so where every block's attention takes that path with
the same slots, :class:`TileOrderBlocks` permutes the tokens once before the first block and once after
the last, and the layers read and write tile order. It is the same function.

Only where the layout has no padding slot (S = N: the grid a whole number of tiles, the prefix tokens run
apart or absent, as the tile-aligned options lay them out on such grids): a padding slot would carry the
norms, projections and MLP of every block, and keep their activations, for no token.

:func:`visattn.convert` puts the model's blocks in a :class:`TileOrderBlocks` when a converted layer is
local (``neighborhood`` or ``sparse``). Each forward decides anew: the tokens stay in raster order on the
CPU, with dropout, with rope, where the windows of the blocks put the tokens in different slots, where the
layout pads, where a backend other than ``flex`` is forced, and with ``keep_tile_order = False``. Paths that
call the blocks one by one (timm's ``forward_intermediates``, gradient checkpointing through
``checkpoint_seq``) run them in raster order, each layer permuting for itself. The order is set per thread,
so threads sharing a model at one image size each run their own (the grid the layers are told is the model's,
not a thread's).
"""
from __future__ import annotations

import logging

import torch
import torch.nn as nn

from visattn.layers.local import LocalWindowAttention, restore_tile_ordered, set_tile_ordered
from visattn.ops.local import FlexLayout

_log = logging.getLogger(__name__)
_logged: set[tuple[int, int, int, int, int, bool]] = set()


def shared_tile_layout(layers: list[nn.Module | None], x: torch.Tensor) -> FlexLayout | None:
    """The layout whose slots every layer's op would permute ``x`` (B, N, C) into, where all of them are
    local layers on FlexAttention with the same slots (:attr:`visattn.ops.local.FlexLayout.slot_key`) and
    the layout has no padding slot (S = N); else None."""
    if not layers or not all(isinstance(layer, LocalWindowAttention) for layer in layers):
        return None
    layouts = [layer.tile_layout(x) for layer in layers]
    if any(layout is None for layout in layouts) or len({layout.slot_key for layout in layouts}) > 1:
        return None
    return layouts[0] if layouts[0].num_slots == x.shape[1] else None


class TileOrderBlocks(nn.Sequential):
    """timm's ``model.blocks`` (the same blocks, the same state-dict keys), run with the tokens in tile order
    where every attention layer would otherwise permute them itself (module docstring)."""

    keep_tile_order: bool = True  # False: every layer permutes for itself (to compare the two)

    def __getitem__(self, index):
        item = super().__getitem__(index)
        if isinstance(item, TileOrderBlocks):  # a slice (timm's pruning, forward_intermediates) keeps the setting
            item.keep_tile_order = self.keep_tile_order
        return item

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, N, C) in raster order -> (B, N, C) in raster order."""
        layers = [getattr(block, "attn", None) for block in self]
        layout = shared_tile_layout(layers, x) if self.keep_tile_order else None
        if layout is None:
            return super().forward(x)
        if not torch.compiler.is_compiling() and layout.slot_key not in _logged:
            _logged.add(layout.slot_key)
            _log.debug("blocks: tokens in tile order %s for all %d blocks", layout.slot_key, len(layers))
        previous = set_tile_ordered(layers)
        try:
            x = super().forward(x.index_select(1, layout.slot_token))
        finally:
            restore_tile_ordered(previous)
        return x.index_select(1, layout.token_slot)


def keep_tokens_in_tile_order(model: nn.Module) -> None:
    """Puts ``model.blocks`` (an ``nn.Sequential``) in a :class:`TileOrderBlocks` where a block's attention is
    local, and takes them out of it where none is; the blocks themselves are kept, so parameters, optimizer
    state and state-dict keys stay valid."""
    blocks = model.blocks
    if not isinstance(blocks, nn.Sequential):
        return
    local = any(isinstance(getattr(block, "attn", None), LocalWindowAttention) for block in blocks)
    if local and type(blocks) is nn.Sequential:
        model.blocks = TileOrderBlocks(*blocks)
    elif not local and isinstance(blocks, TileOrderBlocks):
        model.blocks = nn.Sequential(*blocks)
