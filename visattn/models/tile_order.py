"""The tokens in FlexAttention's tile order once for all blocks, instead of a permutation in every layer.

A local layer on FlexAttention (:mod:`visattn.ops.local.flex`) permutes q, k and v into tile order and its
output back: four gathers of (B, N, C) per layer. Every other part of a block (norms, MLP, residuals,
layer scale, drop path) treats each token alike, so where every block's attention takes that path with
the same slots, :class:`TileOrderBlocks` permutes the tokens once before the first block and once after
the last, and the layers read and write tile order (``token_order="tile"``). The result is the same
function: a padding slot (where a grid side is not a whole number of tiles) repeats a real token, is
never a key, and is dropped at the end.

:func:`visattn.convert` puts the model's blocks in a :class:`TileOrderBlocks` when a converted layer is
local (``neighborhood`` or ``sparse``). Each forward decides anew: the tokens stay in raster order on the
CPU, with dropout, with rope, where the types or windows of the blocks put the tokens in different slots,
where a backend other than ``flex`` is forced, and with ``keep_tile_order = False``. Paths that call the
blocks one by one (timm's ``forward_intermediates``, gradient checkpointing through ``checkpoint_seq``)
run them in raster order, each layer permuting for itself.
"""
from __future__ import annotations

import logging

import torch
import torch.nn as nn

from visattn.layers.local import LocalWindowAttention
from visattn.ops.local import FlexLayout

_log = logging.getLogger(__name__)
_logged: set[tuple[int, ...]] = set()


def shared_tile_layout(layers: list[nn.Module], x: torch.Tensor) -> FlexLayout | None:
    """The layout whose slots every layer's op would permute ``x`` (B, P + H * W, C) into, where all of them
    are local layers on FlexAttention with the same slots (:attr:`visattn.ops.local.FlexLayout.order`);
    else None."""
    if not layers or not all(isinstance(layer, LocalWindowAttention) for layer in layers):
        return None
    layouts = [layer.tile_layout(x) for layer in layers]
    if any(layout is None for layout in layouts) or len({layout.order for layout in layouts}) > 1:
        return None
    return layouts[0]


class TileOrderBlocks(nn.Sequential):
    """timm's ``model.blocks`` (the same blocks, the same state-dict keys), run with the tokens in tile order
    where every attention layer would otherwise permute them itself (module docstring)."""

    keep_tile_order: bool = True  # False: every layer permutes for itself (to compare the two)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, N, C) in raster order -> (B, N, C) in raster order."""
        layers = [block.attn for block in self]
        layout = shared_tile_layout(layers, x) if self.keep_tile_order else None
        if layout is None:
            return super().forward(x)
        if not torch.compiler.is_compiling() and layout.order not in _logged:
            _logged.add(layout.order)
            _log.debug("blocks: tokens in tile order %s for all %d blocks", layout.order, len(layers))
        for layer in layers:
            layer.token_order = "tile"
        try:
            x = super().forward(x.index_select(1, layout.slot_token))  # (B, S, C)
        finally:
            for layer in layers:
                layer.token_order = "raster"
        return x.index_select(1, layout.token_slot)


def keep_tokens_in_tile_order(model: nn.Module) -> None:
    """Puts ``model.blocks`` (an ``nn.Sequential``) in a :class:`TileOrderBlocks` where a block's attention is
    local; the blocks themselves are kept, so parameters, optimizer state and state-dict keys stay valid."""
    blocks = model.blocks
    if isinstance(blocks, TileOrderBlocks) or type(blocks) is not nn.Sequential:
        return
    if any(isinstance(block.attn, LocalWindowAttention) for block in blocks):
        model.blocks = TileOrderBlocks(*blocks)
