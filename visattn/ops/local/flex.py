"""The local windows on PyTorch's FlexAttention: block-sparse, compiled, the tiled engine's GPU path.

FlexAttention skips every 128 x 128 block of (query, key) pairs that its :class:`BlockMask` marks empty,
runs the blocks it marks full without a mask, and evaluates ``mask_mod`` only in the partial ones. So
the cost is the kept blocks, and the token order decides how many there are: in raster order a block is
128 consecutive patches of a row (or several short rows), whose windows together span many rows and
every block of keys along them; in tile order a block is a compact ``th x tw`` tile of the grid (8 x 16
where the grid is at least 16 wide), and its windows cover a few neighbouring tiles. Kept blocks
(partial + full, all query blocks summed; from the block tables, so measured on the CPU) for ViT-S/16
(one class token):

======================  ============  ===========  ===========  ===========  ===========
grid (image)            window        raster       tile 8x16    tile 16x8    tile 4x32
======================  ============  ===========  ===========  ===========  ===========
64 x 64 (1024 px)       nbhd 7        192 (0)      253 (32)     253 (32)     217 (32)
64 x 64                 nbhd 13       312 (0)      253 (32)     253 (32)     337 (32)
64 x 64                 sparse b8 h3  304 (0)      253 (32)     253 (32)     273 (32)
64 x 64                 longformer 7  222 (0)      285 (32)     285 (32)     249 (32)
128 x 128 (2048 px)     nbhd 7        1274 (0)     1141 (128)   1141 (128)   1069 (128)
128 x 128               nbhd 13       2036 (0)     1141 (128)   1141 (128)   1689 (128)
128 x 128               sparse b8 h3  2118 (0)     1141 (128)   1141 (128)   1369 (128)
128 x 128               longformer 7  1398 (0)     1269 (128)   1269 (128)   1197 (128)
======================  ============  ===========  ===========  ===========  ===========

(in brackets: the full ones, here only the prefix query's row; longformer 7: a 7 x 7 neighbourhood and
one global token the patches see). In raster order a query block needs about ``(k + 1) W / 128`` key
blocks, growing with the window and the grid's width; in tile order 3 x 3 tiles as long as half a
window fits in a tile, whatever the grid. Tile order 8 x 16 keeps the fewest blocks summed over these
cases, and up to 1.9 times fewer than raster order at 2048 px; raster order keeps fewer only for the 7 x 7
windows on the 64-wide grid (192 and 222 against 253 and 285). So the patches always run in tile order: prefix tokens
first, padded to a whole block (one block for up to 128 tokens: otherwise every tile would straddle two
blocks), then the tiles, each one block, in raster order of tiles; grid sides are padded up to whole
tiles. Padding slots repeat a real token, are never seen as keys, and their outputs are dropped. The
permutation is one ``index_select`` of q, k and v and one of the output. FlexAttention itself accepts
lengths that are not multiples of 128 (it masks the tail block), but the tile layout is one by
construction.

The block tables are built from the per-axis windows alone: the mask is a product of a row window and a
column window, so a tile pair is kept when both of its axis pairs are, and full when both are full.
That costs (blocks)^2, not N^2, so it also traces cheaply inside a user's compiled model (where, as
for the engine's other layouts, it is built in the graph instead of cached).

The exact windows above leave every kept block partial (a 7 x 7 window covers no 8 x 16 tile whole), and
FlexAttention evaluates the mask on each score of a partial block. Windows that are runs of whole tiles
(the ``tile_aligned`` options of neighborhood and sparse, :func:`full_block_tile`) are laid out in their
own tile, whole blocks of 128 slots each, so that every block pair is empty or full; their prefix queries,
which see every token, run apart as one SDPA over the same permuted keys (the prefix tokens after the
grid, unpadded), since their padded block would be the one partial block left. Where a grid side is not a
multiple of the tile, the blocks that hold the ragged last tiles are partial.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from visattn.ops.cache import cache_per_inference_mode
from visattn.ops.layout import merge_heads, split_heads
from visattn.ops.local.plans import AxisPlan, AxisTiling

BLOCK = 128  # FlexAttention's default block of queries and of keys
TOKEN_ORDERS = ("raster", "tile")
TILE_WIDTH = 16  # a block's tile is TILE_WIDTH wide and BLOCK // TILE_WIDTH tall (narrower grids: narrower tiles)

_compiled_flex_attention = None


def check_token_order(token_order: str, op: str) -> None:
    """A local op's ``token_order`` must be one of :data:`TOKEN_ORDERS`."""
    if token_order not in TOKEN_ORDERS:
        raise ValueError(f"{op}: token_order must be one of {', '.join(TOKEN_ORDERS)}, got {token_order!r}")


def tile_shape(width: int) -> tuple[int, int]:
    """(th, tw): the grid cells of one block, ``th * tw == BLOCK``; ``tw`` at most the grid's width
    rounded up to a power of two, so a narrow grid is not padded to 16 columns."""
    tw = min(TILE_WIDTH, 1 << max(width - 1, 0).bit_length())
    return BLOCK // tw, tw


def full_block_tile(rows: AxisPlan | AxisTiling, cols: AxisPlan | AxisTiling) -> tuple[int, int] | None:
    """The windows' own tile (th, tw) where every window is a run of whole tiles and a tile is a whole number
    of blocks (the tile-aligned options): in that tile order every kept block pair is full, but those a
    ragged last tile pads. Else None. Plans or their tilings (the cost model has only those)."""
    if rows.whole_tiles and cols.whole_tiles and rows.tile * cols.tile % BLOCK == 0:
        return rows.tile, cols.tile
    return None


def _prefix_apart(aligned: bool, num_prefix_tokens: int, prefix_visible: bool) -> bool:
    """Whether the prefix queries run apart from FlexAttention, as one SDPA over all the keys: where the
    windows are whole blocks and the patches do not see the prefix keys, their block (padded, so partial)
    would be the one partial block left."""
    return aligned and num_prefix_tokens > 0 and not prefix_visible


def flex_slots(
    rows: AxisPlan | AxisTiling, cols: AxisPlan | AxisTiling, num_prefix_tokens: int, prefix_visible: bool
) -> int:
    """S, the slots of the tokens in tile order: the prefix tokens padded to whole blocks (or, where they run
    apart, unpadded after the grid), then the grid padded to whole tiles."""
    aligned = full_block_tile(rows, cols)
    th, tw = aligned or tile_shape(cols.length)
    grid_slots = math.ceil(rows.length / th) * th * math.ceil(cols.length / tw) * tw
    if _prefix_apart(aligned is not None, num_prefix_tokens, prefix_visible):
        return grid_slots + num_prefix_tokens
    return math.ceil(num_prefix_tokens / BLOCK) * BLOCK + grid_slots


@dataclass(frozen=True, eq=False)
class FlexLayout:
    """The tokens in tile order and the block mask over them. Slot s of the permuted sequence reads
    token ``slot_token[s]``; token t's output is slot ``token_slot[t]``. FlexAttention runs over the first
    ``attended`` slots; where the prefix queries run apart (the slots after those), they attend to every
    slot, but the padding ones where ``prefix_keys`` says so. Two layouts with the same ``slot_key`` put the
    tokens in the same slots (their windows, and so their block masks, may differ). Cached and compared by
    identity."""

    block_mask: BlockMask
    slot_token: torch.Tensor  # (S,) long, S = flex_slots(...): the prefix slots and the padded grid
    token_slot: torch.Tensor  # (N,) long
    attended: int
    slot_key: tuple[int, int, int, int, int, bool]  # (H, W, P, th, tw, prefix apart): what the slots depend on
    prefix_keys: torch.Tensor | None = None  # (1, 1, 1, S) bool: the real slots, where the grid is padded

    @property
    def num_slots(self) -> int:
        """S: the prefix slots and the padded grid's."""
        return self.slot_token.shape[0]


def _axis_blocks(plan: AxisPlan, tile: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per pair (query tile, key tile) of one axis: whether some query slot sees some key slot, and
    whether every query slot sees every key slot (padding keys are never seen); and per tile whether
    all its slots are real cells. Shapes (tiles, tiles), (tiles, tiles), (tiles,)."""
    n = math.ceil(plan.length / tile)
    slots = torch.arange(n * tile, device=plan.window_lo.device)
    cells = slots.clamp_max(plan.length - 1)  # padding query slots take the edge cell's window
    real = slots < plan.length
    lo, hi = plan.window_lo[cells, None], plan.window_hi[cells, None]
    sees = (lo <= slots) & (slots < hi) & real  # (n * tile, n * tile): query slot x key slot
    pairs = rearrange(sees, "(qt qs) (kt ks) -> qt kt (qs ks)", qs=tile, ks=tile)
    return pairs.any(-1), pairs.all(-1), real.view(n, tile).all(-1)


def _ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(Qb, KVb) bool -> FlexAttention's (1, 1, Qb) counts and (1, 1, Qb, KVb) indices, kept blocks first."""
    as_int = blocks.to(torch.int32)[None, None]
    order = torch.argsort(as_int, dim=-1, descending=True, stable=True)
    return as_int.sum(-1, dtype=torch.int32), order.to(torch.int32)


def _tile_blocks(rows: AxisPlan, cols: AxisPlan, th: int, tw: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The patch blocks' tables from the two axes: (blocks, blocks) kept and full, and (blocks,) whether a
    block's slots are all real cells. A tile of m blocks (m row strips of it) gives each of its blocks
    the tile's entries: exact where the tiles are whole, kept partial where a ragged tile pads them."""
    row_any, row_all, row_real = _axis_blocks(rows, th)
    col_any, col_all, col_real = _axis_blocks(cols, tw)
    strips = th * tw // BLOCK

    def per_block(table: torch.Tensor) -> torch.Tensor:  # (tiles, tiles) -> (tiles * m, tiles * m)
        return table.repeat_interleave(strips, 0).repeat_interleave(strips, 1)

    tile_any = rearrange(row_any[:, None, :, None] & col_any[None, :, None, :], "qi qj ki kj -> (qi qj) (ki kj)")
    tile_all = rearrange(row_all[:, None, :, None] & col_all[None, :, None, :], "qi qj ki kj -> (qi qj) (ki kj)")
    tile_real = (row_real[:, None] & col_real[None, :]).flatten()
    return per_block(tile_any), per_block(tile_all), tile_real.repeat_interleave(strips)


@cache_per_inference_mode(maxsize=32)
def flex_layout(rows: AxisPlan, cols: AxisPlan, num_prefix_tokens: int, prefix_visible: bool) -> FlexLayout:
    """The tile-order permutation and the block mask of the windows ``rows x cols`` after P prefix
    tokens (seen by the patches if ``prefix_visible``); the prefix queries see every token. Built once
    per (plans, P, prefix_visible), i.e. per grid, windows and device, and per inference mode.

    The tile is :func:`full_block_tile`'s where the windows are whole blocks, else :func:`tile_shape`'s.
    In the whole-block layout every kept block is full on a grid of whole tiles (the prefix rows apart, or
    the prefix tokens whole blocks), so the compiled kernel evaluates ``mask_mod`` nowhere; it stays in
    the mask for the partial blocks of ragged tiles and for FlexAttention's eager form (the CPU's), which
    evaluates it on every score and reads no block table."""
    device = rows.window_lo.device
    H, W, p = rows.length, cols.length, num_prefix_tokens
    aligned = full_block_tile(rows, cols)
    th, tw = aligned or tile_shape(W)
    nth, ntw = math.ceil(H / th), math.ceil(W / tw)
    apart = _prefix_apart(aligned is not None, p, prefix_visible)
    prefix_slots = 0 if apart else math.ceil(p / BLOCK) * BLOCK
    grid_slots = nth * th * ntw * tw

    # the patch slots: tile (i, j) in raster order of tiles, its cells in raster order inside it
    y = rearrange(torch.arange(nth * th, device=device), "(ti r) -> ti 1 r 1", r=th).expand(nth, ntw, th, tw).flatten()
    x = rearrange(torch.arange(ntw * tw, device=device), "(tj c) -> 1 tj 1 c", c=tw).expand(nth, ntw, th, tw).flatten()
    real = (y < H) & (x < W)
    yc, xc = y.clamp_max(H - 1), x.clamp_max(W - 1)
    ty, tx = torch.arange(H, device=device)[:, None], torch.arange(W, device=device)[None, :]
    patch_slot = ((((ty // th) * ntw + tx // tw) * th + ty % th) * tw + tx % tw).flatten()
    prefix = torch.arange(p, device=device)
    if apart:  # the grid's slots, then the prefix tokens: keys of the prefix rows only
        slot_token = torch.cat([p + yc * W + xc, prefix])
        token_slot = torch.cat([grid_slots + prefix, patch_slot])
    else:  # the prefix tokens padded to whole blocks (repeating token 0, never a key), then the grid
        slot_token = torch.cat([prefix, prefix.new_zeros(prefix_slots - p), p + yc * W + xc])
        token_slot = torch.cat([prefix, prefix_slots + patch_slot])

    # the block tables: patch blocks from the two axes; prefix blocks are full where all their slots are real
    tile_any, tile_all, tile_real = _tile_blocks(rows, cols, th, tw)
    blocks = tile_real.shape[0]
    prefix_blocks = prefix_slots // BLOCK
    prefix_real = torch.arange(prefix_blocks, device=device) < p // BLOCK  # a block of 128 prefix tokens
    prefix_any = torch.ones(prefix_blocks, prefix_blocks + blocks, dtype=torch.bool, device=device)
    prefix_all = torch.cat([prefix_real, tile_real]).expand(prefix_blocks, -1)
    patch_any = torch.cat([torch.full((blocks, prefix_blocks), prefix_visible, device=device), tile_any], dim=1)
    patch_all = torch.cat([prefix_real.expand(blocks, -1) & prefix_visible, tile_all], dim=1)
    kept, full = torch.cat([prefix_any, patch_any]), torch.cat([prefix_all, patch_all])
    attended = prefix_slots + grid_slots
    mask_mod = _window_mask(rows, cols, p, prefix_visible, prefix_slots, y, x, real)
    block_mask = BlockMask.from_kv_blocks(
        *_ordered(kept & ~full), *_ordered(full), BLOCK_SIZE=BLOCK, mask_mod=mask_mod, seq_lengths=(attended, attended)
    )
    padded = apart and H * W < grid_slots
    prefix_keys = torch.cat([real, prefix.new_ones(p, dtype=torch.bool)])[None, None, None] if padded else None
    return FlexLayout(block_mask, slot_token, token_slot, attended, (H, W, p, th, tw, apart), prefix_keys)


def _window_mask(rows, cols, num_prefix_tokens, prefix_visible, prefix_slots, y, x, real):
    """FlexAttention's ``mask_mod`` over the attended slots (the prefix slots, then the grid's cells ``y``,
    ``x``, real where ``real``): what it reads per slot is a key's cell (-1: a prefix or padding slot) and
    a query's window."""
    p, H, W = num_prefix_tokens, rows.length, cols.length
    yc, xc = y.clamp_max(H - 1), x.clamp_max(W - 1)
    none = torch.full((prefix_slots,), -1, dtype=torch.long, device=y.device)
    key_y = torch.cat([none, torch.where(real, y, -1)])
    key_x = torch.cat([none, torch.where(real, x, -1)])
    row_lo, row_hi = (torch.cat([none, bound[yc]]) for bound in (rows.window_lo, rows.window_hi))
    col_lo, col_hi = (torch.cat([none, bound[xc]]) for bound in (cols.window_lo, cols.window_hi))

    def mask_mod(b, h, q_idx, kv_idx):
        ky, kx = key_y[kv_idx], key_x[kv_idx]
        prefix_key = kv_idx < p
        in_window = (row_lo[q_idx] <= ky) & (ky < row_hi[q_idx]) & (col_lo[q_idx] <= kx) & (kx < col_hi[q_idx])
        patch_sees = in_window | prefix_key if prefix_visible else in_window
        return torch.where(q_idx < prefix_slots, prefix_key | (ky >= 0), patch_sees)

    return mask_mod


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask, scale: float | None) -> torch.Tensor:
    """FlexAttention compiled on CUDA (its eager form computes every score); the plain function on the
    CPU and inside a caller's compiled graph, which compiles it with the rest."""
    global _compiled_flex_attention
    if q.device.type != "cuda" or torch.compiler.is_compiling():
        return flex_attention(q, k, v, block_mask=block_mask, scale=scale)
    if _compiled_flex_attention is None:
        _compiled_flex_attention = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex_attention(q, k, v, block_mask=block_mask, scale=scale)


def flex_local_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rows: AxisPlan,
    cols: AxisPlan,
    num_prefix_tokens: int = 0,
    prefix_visible: bool = False,
    scale: float | None = None,
    token_order: str = "raster",
) -> torch.Tensor:
    """:func:`visattn.ops.local.engine.tiled_local_attn` on FlexAttention: each patch query attends to its
    window (rows x cols), plus every prefix key if ``prefix_visible``; each prefix query to all N tokens.

    Args:
        q, k, v: ``token_order="raster"``: (B, heads, N, d), N = num_prefix_tokens + H * W, prefix tokens
            first, patches in raster order. ``"tile"``: (B, heads, S, d), the tokens already in the slots
            of :func:`flex_layout` (``x[:, layout.slot_token]``), as a model that keeps them in tile
            order between its layers passes them (:class:`visattn.models.tile_order.TileOrderBlocks`).
        rows, cols: the window plan of each axis.
    Returns:
        ``"raster"``: (B, heads, N, d_v), a view of a token-major (B, N, heads, d_v) tensor; ``"tile"``:
        (B, heads, S, d_v) in the same slots as q (those of padding slots finite, meaningless).
    """
    check_token_order(token_order, "flex_local_attn")
    p = num_prefix_tokens
    layout = flex_layout(rows, cols, p, prefix_visible)
    if token_order == "tile":
        if q.shape[2] != layout.num_slots:
            raise ValueError(
                f"flex_local_attn: in tile order q, k, v hold the layout's {layout.num_slots} slots, "
                f"got {q.shape[2]} tokens"
            )
        return _attend_slots(q, k, v, layout, scale)
    heads = q.shape[1]

    def tile_order(t: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:  # (B, heads, N, d) -> (B, heads, S, d)
        return split_heads(merge_heads(t).index_select(1, slots), heads)

    queries, keys, values = (tile_order(t, layout.slot_token) for t in (q, k, v))
    out = _attend_slots(queries, keys, values, layout, scale)
    return out.transpose(1, 2).index_select(1, layout.token_slot).transpose(1, 2)


def _attend_slots(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: FlexLayout, scale: float | None
) -> torch.Tensor:
    """Attention over the tokens in ``layout``'s slots: (B, heads, S, d) -> (B, heads, S, d_v)."""
    attended = layout.attended
    out = _attend(q[:, :, :attended], k[:, :, :attended], v[:, :, :attended], layout.block_mask, scale)
    if attended == layout.num_slots:
        return out
    # the prefix rows apart (the last P slots): one SDPA over every real slot
    prefix = F.scaled_dot_product_attention(
        q[:, :, attended:].contiguous(), k, v, attn_mask=layout.prefix_keys, scale=scale
    )  # (B, heads, P, d_v)
    return torch.cat([out, prefix], dim=2)
