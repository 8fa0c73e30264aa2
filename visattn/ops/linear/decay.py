"""Linear attention with a spatial decay: the Manhattan decay of RMT (Fan et al. 2024) on linear attention.

For the patch tokens i, j of an H x W grid, key j is weighted for query i by D_ij = gamma_h ** (|row_i -
row_j| + |col_i - col_j|), one rate gamma_h per head::

    out_i = sum_j D_ij phi(q_i).phi(k_j) v_j / sum_j D_ij phi(q_i).phi(k_j)

Prefix (class/register) tokens take no decay: D_ij = 1 when i or j is a prefix token. With a rope table,
the numerator's phi(q_i).phi(k_j) is that of the rotated features, R phi(q_i).R phi(k_j), as in
:func:`visattn.ops.linear_attn`; the normalizer keeps the unrotated ones.

Exact, linear in the number of tokens, and without a d x d state per token. The decay is separable,
D = Gamma_H (x) Gamma_W with Gamma_L[i, j] = gamma ** |i - j|, and along an axis cut into tiles of t
positions, the decay between positions of different tiles factors through the tile edges: for j in an
earlier tile J than i's tile I (s_I the first position of I),
``gamma ** (i - j) = gamma ** (i - s_I) * gamma ** (t (I - J - 1)) * gamma ** (s_J + t - j)``, and the mirror
for later tiles. The grid is cut into th x tw tiles; for the queries of one row of tiles ("tile-row"):

- keys of the same tile: the explicit (th tw) x (th tw) scores times the decay;
- keys of the same tile-row, other tiles: for each grid row, each tile's keys and values summed into
  d x (e + 1) with their decay to the tile's edges, carried across the tiles, mixed across the tile-row's
  rows with Gamma_th, and read by each query with its decay from its own tile's edges;
- keys of other tile-rows: a state per grid column, (W, d, e + 1), carried from tile-row to tile-row
  (a sweep down the grid, then one up), filtered along the row with Gamma_W (the same tile
  decomposition in 1D), and read by the queries of the column.

Work: O(N d (th tw + d)); memory beyond q, k, v and the output: a few (W, d, e + 1) states per head, a
few heads at a time (:data:`STATE_ELEMENTS`). The backward pass runs the same product three more times
(each gradient of q, k, v is one, the decay being symmetric) and once in forward mode for gamma, so
training stores q, k, v and nothing of size N d^2 either.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from einops import rearrange

from visattn.ops.backends import choose_decayed_linear_backend, select_backend
from visattn.ops.checks import check_grid, check_positive_int, check_qkv
from visattn.ops.layout import split_prefix
from visattn.ops.linear.feature_maps import get_feature_map
from visattn.ops.linear.plain import divide_by_last_column, with_ones_column
from visattn.ops.pieces import items_per_piece, pieces
from visattn.ops.rope import apply_rope, check_rope_table

# Values of one (W, d, e + 1) column state, summed over the heads (and images) taken at once: this bounds
# the working memory. Small on a CPU, where a state that stays in cache runs fastest (a 64 x 64 grid ran
# faster one head at a time than six at once); large on other devices, where each step's kernel launches
# cost more than its memory.
STATE_ELEMENTS = {"cpu": 1 << 18}
STATE_ELEMENTS_ELSEWHERE = 1 << 24
# Side of the tiles whose scores are explicit: 16 was the fastest of 8, 12, 16 and 32 on 32 x 32 and
# 64 x 64 grids (a CPU, d = 64); grids up to 16 x 16 are then a single tile.
TILE_SIZE = 16

_OP = "decayed_linear_attn"


@dataclass(frozen=True)
class AxisDecay:
    """The decay along one grid axis cut into ``n`` tiles of ``t`` positions, for G groups (head, image):
    inside a tile, from a key to its tile's edges, from a query's tile's edges to the query, and from
    tile to tile."""

    local: torch.Tensor  # (G, t, t): gamma ** |i - j| within a tile
    to_next: torch.Tensor  # (G, t): key at j to the first position of the next tile, gamma ** (t - j)
    to_prev: torch.Tensor  # (G, t): key at j to the last position of the previous tile, gamma ** (j + 1)
    from_start: torch.Tensor  # (G, t): the tile's first position to the query at i, gamma ** i
    from_end: torch.Tensor  # (G, t): the tile's last position to the query at i, gamma ** (t - 1 - i)
    step: torch.Tensor  # (G,): across one whole tile, gamma ** t
    from_earlier: torch.Tensor  # (G, n, n): [I, J] = gamma ** (t (I - J - 1)) for J < I, else 0
    from_later: torch.Tensor  # (G, n, n): its transpose, tiles J > I

    @property
    def to_edges(self) -> torch.Tensor:
        """(G, 2, t): ``to_next`` and ``to_prev``."""
        return torch.stack([self.to_next, self.to_prev], dim=1)

    @property
    def from_edges(self) -> torch.Tensor:
        """(G, t, 2): ``from_start`` and ``from_end``."""
        return torch.stack([self.from_start, self.from_end], dim=2)

    def __getitem__(self, groups: slice) -> "AxisDecay":
        """The decay of some of the groups."""
        return AxisDecay(*(getattr(self, f.name)[groups] for f in fields(self)))

    @classmethod
    def build(cls, gamma: torch.Tensor, t: int, n: int) -> "AxisDecay":
        g = gamma[:, None]
        pos = torch.arange(t, device=gamma.device, dtype=gamma.dtype)
        tiles = torch.arange(n, device=gamma.device)
        gap = tiles[:, None] - tiles[None, :] - 1  # (n, n): whole tiles between J and I
        from_earlier = (gamma[:, None, None] ** (t * gap.clamp_min(0)).to(gamma.dtype)) * (gap >= 0)
        return cls(
            local=gamma[:, None, None] ** (pos[:, None] - pos[None, :]).abs(),
            to_next=g ** (t - pos),
            to_prev=g ** (pos + 1),
            from_start=g ** pos,
            from_end=g ** (t - 1 - pos),
            step=gamma**t,
            from_earlier=from_earlier,
            from_later=from_earlier.transpose(1, 2),
        )


def _same_tile_row(
    a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, rows: AxisDecay, cols: AxisDecay, tile_decay: torch.Tensor
) -> torch.Tensor:
    """The part of ``sum_j D_ij (a_i . b_j) c_j`` from the keys j of the query's own tile-row.

    a, b: (G, nJ, th, tw, p); c: (G, nJ, th, tw, m), the tile-row tile by tile; tile_decay: (G, th tw, th tw)
    -> (G, nJ, th, tw, m).
    """
    groups, n_tiles, th, tw, m = c.shape
    p = a.shape[-1]
    scores = (a.flatten(2, 3) @ b.flatten(2, 3).transpose(-2, -1)) * tile_decay[:, None]  # (G, nJ, T, T)
    out = (scores @ c.flatten(2, 3)).view(groups, n_tiles, th, tw, m)
    if n_tiles == 1:
        return out
    # one d x m sum per grid row of each tile, decayed to an edge of the tile, carried to the other tiles
    # of the tile-row, mixed across the tile-row's grid rows, and read with the decay from the query's edge
    b_rows = b.reshape(-1, tw, p).transpose(-2, -1)  # (G nJ th, p, tw)
    for to_edge, across, from_edge in (
        (cols.to_next, cols.from_earlier, cols.from_start),
        (cols.to_prev, cols.from_later, cols.from_end),
    ):
        sums = b_rows @ (c * to_edge[:, None, None, :, None]).view(-1, tw, m)  # (G nJ th, p, m)
        carried = (across @ sums.view(groups, n_tiles, -1)).view(groups, n_tiles, th, p * m)
        if th > 1:
            carried = rows.local[:, None] @ carried
        queries = (a * from_edge[:, None, None, :, None]).view(-1, tw, p)
        out = torch.baddbmm(out.view(-1, tw, m), queries, carried.view(-1, p, m))
    return out.view(groups, n_tiles, th, tw, m)


def _along_row(state: torch.Tensor, cols: AxisDecay) -> torch.Tensor:
    """``Gamma_W`` applied along the grid columns of a column state: (G, nJ, tw, p m) -> the same shape."""
    groups, n_tiles, tw, pm = state.shape
    out = state if tw == 1 else cols.local[:, None] @ state
    if n_tiles == 1:
        return out
    edges = cols.to_edges[:, None] @ state  # (G, nJ, 2, p m): each tile's columns decayed to its two edges
    moved = torch.stack([cols.from_earlier @ edges[:, :, 0], cols.from_later @ edges[:, :, 1]], dim=2)
    from_edges = cols.from_edges[:, None].expand(groups, n_tiles, tw, 2).reshape(-1, tw, 2)
    return torch.baddbmm(out.view(-1, tw, pm), from_edges, moved.view(-1, 2, pm)).view(groups, n_tiles, tw, pm)


def _column_major(t: torch.Tensor) -> torch.Tensor:
    """A tile-row (G, nJ, th, tw, x) as (G nJ tw, th, x): the grid rows of each column contiguous."""
    return t.transpose(2, 3).reshape(-1, t.shape[2], t.shape[-1])


def _other_tile_rows(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, rows: AxisDecay, cols: AxisDecay, downward: bool):
    """Yields (tile-row i, its part of ``sum_j D_ij (a_i . b_j) c_j`` from the keys of the tile-rows above
    it (``downward``) or below it), for each tile-row that has some, in the order of the sweep.

    a, b: (G, nI, nJ, th, tw, p); c: (G, nI, nJ, th, tw, m). The state carried from tile-row to tile-row
    is, per grid column, the keys and values of the tile-rows passed, decayed to the next tile-row's edge:
    (G, nJ, tw, p m).
    """
    groups, n_rows, n_tiles, th, tw, m = c.shape
    p = a.shape[-1]
    order = range(n_rows) if downward else range(n_rows - 1, -1, -1)
    to_edge, from_edge = (rows.to_next, rows.from_start) if downward else (rows.to_prev, rows.from_end)
    state = None
    for position, i in enumerate(order):
        if state is not None:
            filtered = _along_row(state, cols).view(-1, p, m)  # (G nJ tw, p, m)
            queries = _column_major(a[:, i] * from_edge[:, None, :, None, None])
            yield i, (queries @ filtered).view(groups, n_tiles, tw, th, m).transpose(2, 3)
        if position + 1 < n_rows:
            weighted = c[:, i] * to_edge[:, None, :, None, None]
            summary = (_column_major(b[:, i]).transpose(-2, -1) @ _column_major(weighted)).view(groups, n_tiles, tw, p * m)
            state = summary if state is None else summary.addcmul_(state, rows.step[:, None, None, None])


def _tiled_product(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, rows: AxisDecay, cols: AxisDecay) -> torch.Tensor:
    """:func:`decayed_product` for the G groups given at once, with the decay along their rows and columns."""
    _, height, width, _ = a.shape
    th, tw = rows.local.shape[-1], cols.local.shape[-1]
    n_rows, n_cols = rows.from_earlier.shape[-1], cols.from_earlier.shape[-1]
    # tile by tile, each tile's tokens contiguous; zero queries and keys on the padding add nothing
    a, b, c = (
        rearrange(F.pad(t, (0, 0, 0, n_cols * tw - width, 0, n_rows * th - height)), "g (I r) (J c) x -> g I J r c x", r=th, c=tw).contiguous()
        for t in (a, b, c)
    )
    tile_decay = rearrange(rows.local[:, :, None, :, None] * cols.local[:, None, :, None, :], "g r c s u -> g (r c) (s u)")
    out = [_same_tile_row(a[:, i], b[:, i], c[:, i], rows, cols, tile_decay) for i in range(n_rows)]
    for downward in (True, False):
        for i, part in _other_tile_rows(a, b, c, rows, cols, downward):
            out[i] = out[i] + part
    out = rearrange(torch.stack(out, dim=1), "g I J r c m -> g (I r) (J c) m")
    return out[:, :height, :width]


def decayed_product(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, gamma: torch.Tensor, tile_size: int = TILE_SIZE) -> torch.Tensor:
    """``sum_j D_ij (a_i . b_j) c_j`` over an H x W grid, D the Manhattan decay.

    Args:
        a, b: (G, H, W, p); c: (G, H, W, m); gamma: (G,), the rate of each group.
        tile_size: side of the tiles (at most H, W) whose scores are explicit.
    Returns:
        (G, H, W, m), computed a few groups at a time so that a column state stays within
        :data:`STATE_ELEMENTS` values.
    """
    groups, height, width, p = a.shape
    th, tw = min(tile_size, height), min(tile_size, width)
    rows, cols = AxisDecay.build(gamma, th, -(-height // th)), AxisDecay.build(gamma, tw, -(-width // tw))
    per_group = -(-width // tw) * tw * p * c.shape[-1]
    step = items_per_piece(STATE_ELEMENTS.get(a.device.type, STATE_ELEMENTS_ELSEWHERE), per_group)
    return torch.cat([_tiled_product(a[g], b[g], c[g], rows[g], cols[g]) for g in pieces(groups, step)])


class _DecayedProduct(torch.autograd.Function):
    """:func:`decayed_product`; saves only its inputs. With y = P(a, b, c) and the decay symmetric, each
    gradient is itself such a product: da = P(dy, c, b), db = P(c, dy, a), dc = P(b, a, dy); and
    dgamma = sum_i a_i . dP(dy, c, b)_i / dgamma, the forward-mode derivative of the first."""

    @staticmethod
    def forward(ctx, a, b, c, gamma, tile_size: int):
        ctx.save_for_backward(a, b, c, gamma)
        ctx.tile_size = tile_size
        return decayed_product(a, b, c, gamma, tile_size)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        a, b, c, gamma = ctx.saved_tensors
        tile = ctx.tile_size
        need_a, need_b, need_c, need_gamma, _ = ctx.needs_input_grad
        grad_a = grad_b = grad_c = grad_gamma = None
        if need_gamma:
            with warnings.catch_warnings():
                # forward-mode AD loads its decompositions with torch.jit.script on first use, which warns
                # that torch.jit.script is deprecated: PyTorch's own business, nothing a caller can act on
                warnings.filterwarnings("ignore", message=".*torch.jit.script.* is deprecated", category=FutureWarning)
                grad_a, tangent = torch.func.jvp(
                    lambda g: decayed_product(grad, c, b, g, tile), (gamma,), (torch.ones_like(gamma),)
                )
            grad_gamma = torch.linalg.vecdot(tangent.flatten(1), a.flatten(1))  # groups are independent
        elif need_a:
            grad_a = decayed_product(grad, c, b, gamma, tile)
        if need_b:
            grad_b = decayed_product(c, grad, a, gamma, tile)
        if need_c:
            grad_c = decayed_product(b, a, grad, gamma, tile)
        return grad_a, grad_b, grad_c, grad_gamma, None


def _check_gamma(gamma: torch.Tensor, q: torch.Tensor) -> None:
    heads = q.shape[1]
    if not isinstance(gamma, torch.Tensor) or not gamma.is_floating_point() or gamma.shape != (heads,):
        got = f"shape {tuple(gamma.shape)} {gamma.dtype}" if isinstance(gamma, torch.Tensor) else repr(gamma)
        raise ValueError(f"{_OP}: gamma must be a floating-point tensor of shape (heads,) = ({heads},), got {got}")
    if gamma.device != q.device:
        raise ValueError(f"{_OP}: gamma must be on q's device {q.device}, got {gamma.device}")
    if not torch.compiler.is_compiling() and not bool(((gamma >= 0) & (gamma <= 1)).all()):
        raise ValueError(f"{_OP}: gamma must lie in [0, 1], got {gamma.tolist()}")


def decayed_linear_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gamma: torch.Tensor,
    grid: tuple[int, int],
    num_prefix_tokens: int = 0,
    feature_map: str = "elu",
    eps: float = 1e-6,
    tile_size: int = TILE_SIZE,
    backend: str | None = None,
    rope: torch.Tensor | None = None,
) -> torch.Tensor:
    """Linear attention whose patch keys decay with their Manhattan distance to the query on the grid.

    Args:
        q, k, v: (B, heads, N, d), N = num_prefix_tokens + H * W, the patches in raster order.
        gamma: (heads,) decay rate of each head, in [0, 1]: the weight of a key at grid distance n is
            gamma ** n; 1 is plain linear attention, 0 lets each patch see only itself (and the prefix).
        grid: (H, W).
        num_prefix_tokens: class/register tokens before the patches; they neither decay nor are decayed.
        feature_map: ``"elu"`` (elu + 1) or ``"relu"``.
        eps: lower bound of the normalizer.
        tile_size: side of the grid tiles whose scores are computed explicitly; the result does not
            depend on it (up to rounding).
        backend: how the gradients are computed: ``"rerun"`` (the backward runs the tiled product again and
            keeps only its inputs) or ``"autograd"`` (autograd through the tiled product: about twice as fast,
            but on a grid of several tiles it keeps each tile-row's intermediate states, about as much as a
            d x d state per token and head); None: chosen by :func:`visattn.ops.backends.choose_decayed_linear_backend`.
        rope: a rotation table, (N, 2 d) or (heads, N, 2 d) (:mod:`visattn.ops.rope`): the features are
            turned in the numerator only; the normalizer, a second tiled product of width 1, keeps them
            unturned, so it stays positive.
    Returns:
        (B, heads, N, d) in v's dtype; computed in fp32 (fp64 for fp64 inputs), also under autocast.
    """
    check_qkv(q, k, v, _OP)
    height, width = check_grid(grid, q.shape[2], num_prefix_tokens, _OP)
    check_positive_int(tile_size, "tile_size", _OP)
    _check_gamma(gamma, q)
    if rope is not None:
        check_rope_table(q, rope, _OP)
    phi = get_feature_map(feature_map)
    single_tile = height <= tile_size and width <= tile_size
    name = select_backend("decayed_linear", backend, lambda: choose_decayed_linear_backend(single_tile))
    product = _DecayedProduct.apply if name == "rerun" else decayed_product

    def sums(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, gammas: torch.Tensor) -> torch.Tensor:
        return _decayed_sums(a, b, c, gammas, height, num_prefix_tokens, tile_size, product)

    return _decayed_attention(q, k, v, gamma, phi, eps, rope, sums)


def _decayed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gamma: torch.Tensor,
    phi: Callable[[torch.Tensor], torch.Tensor],
    eps: float,
    rope: torch.Tensor | None,
    sums: Callable[..., torch.Tensor],
) -> torch.Tensor:
    """The numerator and the normalizer as decayed sums over the grid (``sums(a, b, c, gammas)``: ``sum_j
    D_ij (a_i . b_j) c_j``), in fp32 (fp64 for fp64 inputs) with autocast off, and their quotient in v's
    dtype: one product of width d + 1 without rope; with it, the turned features' product on v and the
    unturned ones' of width 1."""
    dtype = torch.promote_types(v.dtype, torch.float32)
    with torch.autocast(device_type=q.device.type, enabled=False):
        qf, kf, vf = phi(q.to(dtype)), phi(k.to(dtype)), v.to(dtype)
        gammas = gamma.to(dtype).repeat(q.shape[0])  # (B heads,): the rate of each (image, head)
        if rope is None:
            num_den = sums(qf, kf, with_ones_column(vf), gammas)
        else:
            rope = rope.to(dtype)
            numerator = sums(apply_rope(qf, rope), apply_rope(kf, rope), vf, gammas)
            num_den = torch.cat([numerator, sums(qf, kf, vf.new_ones(*vf.shape[:-1], 1), gammas)], dim=-1)
        out = divide_by_last_column(num_den, eps)
    return out.to(v.dtype)


def _decayed_sums(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    gammas: torch.Tensor,
    height: int,
    num_prefix_tokens: int,
    tile_size: int,
    product: Callable[..., torch.Tensor],
) -> torch.Tensor:
    """``sum_j D_ij (a_i . b_j) c_j`` for all N tokens, the prefix tokens undecayed: a, b (B, heads, N, p),
    c (B, heads, N, m) -> (B, heads, N, m); ``product`` computes the patch part."""
    (a_pre, a_grid), (b_pre, b_grid), (c_pre, c_grid) = (split_prefix(t, num_prefix_tokens) for t in (a, b, c))
    as_groups = [rearrange(t, "b h (y x) e -> (b h) y x e", y=height) for t in (a_grid, b_grid, c_grid)]
    sums = rearrange(product(*as_groups, gammas, tile_size), "(b h) y x e -> b h (y x) e", b=a.shape[0])
    if not num_prefix_tokens:
        return sums
    prefix_state = b_pre.transpose(-2, -1) @ c_pre  # (B, heads, p, m): the prefix keys, undecayed
    all_state = prefix_state + b_grid.transpose(-2, -1) @ c_grid
    return torch.cat([a_pre @ all_state, sums + a_grid @ prefix_state], dim=2)
