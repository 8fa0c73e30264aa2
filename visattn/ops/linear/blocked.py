"""Non-causal linear attention in O(N d^2), walked block by block of tokens so that each block's feature
map and products stay in cache; the backward pass recomputes the feature maps, so a training step
stores only q, k, v and the (d, d + 1) state. With a rope table the numerator's features are turned
block by block as well (:func:`visattn.ops.linear_attn`), and the backward turns their gradients back.

A block is a run of whole images, or a run of tokens of one image when an image alone exceeds the
cache budget: either way its tokens are consecutive rows of the (B * N, C) token matrix, and its work
buffers (b, heads, n, d) are laid out so that images and heads fold into one batch dimension of the
matrix products. Blocks are sized from the shapes, not one token count for any batch (ViT-S, 6 heads of
64): at 64 images of 197 tokens a block holds 3 whole images, at 16 images of 1,025 tokens half an image,
at one image of 16,385 tokens 656 tokens.

:func:`packed_linear_attn` runs the same on the qkv projection itself, so its gradient comes back in
one piece. Every sum over tokens is taken in fp32, also under fp16/bf16 autocast, and the normalizer
is clamped away from zero.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from visattn.ops.backends import needs_autograd
from visattn.ops.checks import check_packed_qkv, check_qkv
from visattn.ops.layout import split_heads, split_qkv, token_major_empty
from visattn.ops.linear.feature_maps import FeatureMap, get_feature_map
from visattn.ops.pieces import image_runs
from visattn.ops.rope import apply_rope, check_rope_table, inverse_rope

# Values per fp32 work buffer of a block on the CPU (1 MiB): the block's feature maps and products stay
# in a core's cache, so every input is read from memory once per pass. Other devices take one block.
BLOCK_ELEMENTS = 1 << 18
# Fewest tokens in a block that splits an image: thinner matrix products run far below speed.
MIN_BLOCK_TOKENS = 16


@dataclass(frozen=True)
class Block:
    """Images ``images`` and, of each, tokens ``tokens``: rows ``rows`` of the (B * N, C) token matrix."""

    images: slice
    tokens: slice
    rows: slice

    @property
    def size(self) -> tuple[int, int]:
        """(images, tokens)."""
        return self.images.stop - self.images.start, self.tokens.stop - self.tokens.start


def token_blocks(batch: int, n: int, values_per_token: int, device: torch.device) -> list[Block]:
    """The blocks of B images of N tokens with ``values_per_token`` values per work buffer: as many whole
    images as fit in :data:`BLOCK_ELEMENTS`, else runs of tokens of one image; a single block off the CPU."""
    if device.type != "cpu":
        return [Block(slice(0, batch), slice(0, n), slice(0, batch * n))]
    runs = image_runs(batch, n, values_per_token, BLOCK_ELEMENTS, minimum=MIN_BLOCK_TOKENS)
    # a run's tokens are consecutive rows: whole images, or a run of one image's tokens
    return [
        Block(images, tokens, slice(images.start * n + tokens.start, (images.stop - 1) * n + tokens.stop))
        for images, tokens in runs
    ]


class TokenBlocks:
    """The blocks of a (B, heads, N, .) computation and their fp32 work buffers, reused from block to block."""

    def __init__(self, batch: int, heads: int, n: int, width: int, device: torch.device) -> None:
        """``width``: the widest work buffer per head and token (e.g. d + 1)."""
        self.heads, self.device = heads, device
        self.blocks = token_blocks(batch, n, heads * width, device)
        self._largest = max(b * m for b, m in (block.size for block in self.blocks))
        self._storage: dict[str, torch.Tensor] = {}

    def __iter__(self) -> Iterator[Block]:
        return iter(self.blocks)

    def buffer(self, name: str, block: Block, width: int) -> torch.Tensor:
        """The work buffer ``name`` for ``block``: (b, heads, n, width) fp32, contiguous."""
        flat = self._storage.get(name)
        if flat is None or flat.numel() < self._largest * self.heads * width:
            flat = self._storage[name] = torch.empty(
                self._largest * self.heads * width, dtype=torch.float32, device=self.device
            )
        b, n = block.size
        return flat[: b * self.heads * n * width].view(b, self.heads, n, width)

    def feature_map(self, phi: FeatureMap, x: torch.Tensor, block: Block) -> torch.Tensor:
        """phi(x) of the block's (b, heads, n, d) slice ``x`` (any strides, any float dtype), in the
        ``"phi"`` buffer."""
        d = x.shape[-1]
        return phi.fast_into(x, self.buffer("phi", block, d), self.buffer("scratch", block, d))

    def with_ones(self, v: torch.Tensor, block: Block) -> torch.Tensor:
        """[v, 1] (b, heads, n, e + 1) in the ``"ext"`` buffer: the ones column sums the normalizer beside
        the values in the same product."""
        e = v.shape[-1]
        ext = self.buffer("ext", block, e + 1)
        ext[..., :e] = v
        ext[..., e] = 1.0
        return ext


def block_rope(rope: torch.Tensor, block: Block) -> torch.Tensor:
    """The rows of a (N, 2 d) or (heads, N, 2 d) rope table for the block's tokens."""
    return rope[..., block.tokens, :]


def kv_state(
    keys_values: Callable[[Block], tuple[torch.Tensor, torch.Tensor]], blocks: TokenBlocks, phi: FeatureMap, batch: int,
    rope: torch.Tensor | None = None,
) -> torch.Tensor:
    """The state ``[S, z] = phi(k)^T [v, 1]`` (B, h, d, e + 1), fp32: S = phi(k)^T v and z = phi(k)^T 1 side
    by side, from the key and value blocks (b, h, n, d) that ``keys_values(block)`` gives. With a fp32
    ``rope`` table, S = (R phi(k))^T v and z stays unturned."""
    state = None
    for block in blocks:
        k_blk, v_blk = keys_values(block)
        e = v_blk.shape[-1]
        if state is None:
            state = torch.zeros(batch, blocks.heads, k_blk.shape[-1], e + 1, dtype=torch.float32, device=k_blk.device)
        phi_k = blocks.feature_map(phi, k_blk, block)
        v_ext = blocks.with_ones(v_blk, block)
        if rope is None:
            state[block.images] += phi_k.transpose(-2, -1) @ v_ext
        else:
            turned_k = apply_rope(phi_k, block_rope(rope, block))
            state[block.images, ..., :e] += turned_k.transpose(-2, -1) @ v_ext[..., :e]
            state[block.images, ..., e] += phi_k.sum(dim=-2)
    return state


def numerator_and_normalizer(
    blocks: TokenBlocks, block: Block, phi_q: torch.Tensor, state: torch.Tensor, rope: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``phi(q) [S, z]`` of one block of queries as (num, den, the turned features ``R phi(q)`` or None):
    without rope one product into the block's buffer; with it, the turned features against S and the
    unturned ones against z, so that the normalizer stays positive."""
    e = state.shape[-1] - 1
    if rope is None:
        num_den = torch.matmul(phi_q, state[block.images], out=blocks.buffer("ext", block, e + 1))
        return num_den[..., :e], num_den[..., e:], None
    turned_q = apply_rope(phi_q, block_rope(rope, block))
    return turned_q @ state[block.images, ..., :e], phi_q @ state[block.images, ..., e:], turned_q


def attend(
    queries: Callable[[Block], torch.Tensor],
    state: torch.Tensor,
    blocks: TokenBlocks,
    phi: FeatureMap,
    eps: float,
    out: torch.Tensor,
    rope: torch.Tensor | None = None,
) -> torch.Tensor:
    """Writes ``phi(q) S / max(phi(q) z, eps)`` into ``out`` (B, h, N, e), block by block of ``queries``;
    with a fp32 ``rope`` table, ``(R phi(q)) S / max(phi(q) z, eps)``."""
    for block in blocks:
        phi_q = blocks.feature_map(phi, queries(block), block)
        num, den, _ = numerator_and_normalizer(blocks, block, phi_q, state, rope)
        torch.div(num, den.clamp_min_(eps), out=out[block.images, :, block.tokens])
    return out


def _forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, phi: FeatureMap, eps: float, out: torch.Tensor | None = None,
    rope: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The output (B, h, N, e), written into ``out`` if given, else token-major in memory, and [S, z]."""
    batch, heads, n, e = v.shape
    with torch.autocast(device_type=q.device.type, enabled=False):
        blocks = TokenBlocks(batch, heads, n, max(q.shape[-1], e + 1), q.device)
        state = kv_state(
            lambda blk: (k[blk.images, :, blk.tokens], v[blk.images, :, blk.tokens]), blocks, phi, batch, rope
        )
        out = token_major_empty(batch, heads, n, e, v) if out is None else out
        attend(lambda blk: q[blk.images, :, blk.tokens], state, blocks, phi, eps, out, rope)
    return out, state


def _backward(
    saved: tuple[torch.Tensor, ...],
    grad_out: torch.Tensor,
    phi: FeatureMap,
    eps: float,
    grads: tuple[torch.Tensor, ...],
    rope: torch.Tensor | None = None,
) -> None:
    """Writes dq, dk, dv into ``grads`` (three tensors shaped like q, k, v, any strides).

    With the state [S, z] = phi(k)^T [v, 1], [num, den] = phi(q) [S, z], out = num / max(den, eps) and
    the output gradient g: the gradient of [num, den] is g' = [g, c] / max(den, eps) with
    c = -(g . out) where the clamp passes (0 elsewhere); then dphi(q) = g' [S, z]^T,
    d[S, z] = phi(q)^T g', dphi(k) = [v, 1] d[S, z]^T and dv = phi(k) dS.

    With a rope table R, S = (R phi(k))^T v and num = (R phi(q)) S: the numerator's terms take the turned
    features, and their gradients are turned back, R^T (a rotation's inverse): dphi(q) = R^T (g'_num S^T)
    + g'_den z^T, dS = (R phi(q))^T g'_num, dphi(k) = R^T (v dS^T) + 1 dz^T and dv = (R phi(k)) dS.
    """
    q, k, v, state = saved
    dq, dk, dv = grads
    batch, heads, n, e = v.shape
    inverse = None if rope is None else inverse_rope(rope)
    with torch.autocast(device_type=q.device.type, enabled=False):
        blocks = TokenBlocks(batch, heads, n, max(q.shape[-1], e + 1), q.device)
        grad_state = _query_gradients(blocks, q, state, grad_out, phi, eps, dq, rope, inverse)
        _key_value_gradients(blocks, k, v, grad_state, phi, dk, dv, rope, inverse)


def _query_gradients(
    blocks: TokenBlocks,
    q: torch.Tensor,
    state: torch.Tensor,
    grad_out: torch.Tensor,
    phi: FeatureMap,
    eps: float,
    dq: torch.Tensor,
    rope: torch.Tensor | None,
    inverse: torch.Tensor | None,
) -> torch.Tensor:
    """The first pass of :func:`_backward`, block by block of queries: writes dq and returns d[S, z]
    (B, h, d, e + 1), fp32. ``inverse``: the rope table's inverse turns, or None."""
    e = state.shape[-1] - 1
    d = q.shape[-1]
    grad_state = torch.zeros_like(state)
    for block in blocks:
        images, tokens = block.images, block.tokens
        phi_q = blocks.feature_map(phi, q[images, :, tokens], block)
        num, den, turned_q = numerator_and_normalizer(blocks, block, phi_q, state, rope)
        live = den >= eps
        den.clamp_min_(eps)
        grad_ext = blocks.buffer("grad_ext", block, e + 1)
        torch.div(grad_out[images, :, tokens], den, out=grad_ext[..., :e])
        c = torch.linalg.vecdot(grad_ext[..., :e], num).unsqueeze(-1)  # g . num / den
        torch.div(c, den, out=grad_ext[..., e:]).neg_().mul_(live)
        if rope is None:
            grad_state[images] += phi_q.transpose(-2, -1) @ grad_ext
            grad_phi_q = torch.matmul(
                grad_ext, state[images].transpose(-2, -1), out=blocks.buffer("scratch", block, d)
            )
        else:
            grad_state[images, ..., :e] += turned_q.transpose(-2, -1) @ grad_ext[..., :e]
            grad_state[images, ..., e:] += phi_q.transpose(-2, -1) @ grad_ext[..., e:]
            grad_turned_q = grad_ext[..., :e] @ state[images, ..., :e].transpose(-2, -1)
            grad_phi_q = apply_rope(grad_turned_q, block_rope(inverse, block))
            grad_phi_q += grad_ext[..., e:] @ state[images, ..., e:].transpose(-2, -1)
        torch.mul(grad_phi_q, phi.derivative_(phi_q), out=dq[images, :, tokens])
    return grad_state


def _key_value_gradients(
    blocks: TokenBlocks,
    k: torch.Tensor,
    v: torch.Tensor,
    grad_state: torch.Tensor,
    phi: FeatureMap,
    dk: torch.Tensor,
    dv: torch.Tensor,
    rope: torch.Tensor | None,
    inverse: torch.Tensor | None,
) -> None:
    """The second pass of :func:`_backward`, block by block of keys and values: writes dk and dv from
    d[S, z] (B, h, d, e + 1)."""
    e = v.shape[-1]
    d = k.shape[-1]
    grad_state_t = grad_state.transpose(-2, -1)
    for block in blocks:
        images, tokens = block.images, block.tokens
        phi_k = blocks.feature_map(phi, k[images, :, tokens], block)
        v_ext = blocks.with_ones(v[images, :, tokens], block)
        if rope is None:
            grad_v = torch.matmul(phi_k, grad_state[images, ..., :e], out=blocks.buffer("grad_ext", block, e))
            grad_phi_k = torch.matmul(v_ext, grad_state_t[images], out=blocks.buffer("scratch", block, d))
        else:
            grad_v = apply_rope(phi_k, block_rope(rope, block)) @ grad_state[images, ..., :e]
            grad_phi_k = apply_rope(v_ext[..., :e] @ grad_state_t[images, ..., :e, :], block_rope(inverse, block))
            grad_phi_k += grad_state_t[images, ..., e:, :]  # the normalizer's dz, the same for every key
        dv[images, :, tokens] = grad_v
        torch.mul(grad_phi_k, phi.derivative_(phi_k), out=dk[images, :, tokens])


class _BlockedLinearAttention(torch.autograd.Function):
    """Saves q, k, v and the small state [S, z] (and the rope table, if any); the backward pass recomputes
    the feature maps (and their turns) block by block, so a training step stores no (N, d) tensor of its
    own. The output is laid out token-major, (B, N, h, e) in memory, so merging the heads afterwards is a
    view. The table is a constant: it gets no gradient (a learned table's is taken by the plain path)."""

    @staticmethod
    def forward(ctx, q, k, v, phi: FeatureMap, eps: float, rope: torch.Tensor | None):
        out, state = _forward(q, k, v, phi, eps, rope=rope)
        ctx.save_for_backward(q, k, v, state, rope)
        ctx.phi, ctx.eps = phi, eps
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        *saved, rope = ctx.saved_tensors
        grads = tuple(torch.empty_like(t) for t in saved[:3])
        _backward(tuple(saved), grad_out, ctx.phi, ctx.eps, grads, rope)
        return *grads, None, None, None


class _PackedLinearAttention(torch.autograd.Function):
    """:class:`_BlockedLinearAttention` on the qkv projection (B, N, 3 C) itself, returning (B, N, C)
    with the heads merged, and the values (B, N, C) as a view of the projection. Its gradient comes back
    as one (B, N, 3 C) tensor written block by block (the values' own gradient, if any, added into it),
    so autograd neither stacks dq, dk, dv, copies them into the projection's layout, nor zero-fills a
    projection-sized gradient for a slice of it."""

    @staticmethod
    def forward(ctx, qkv, num_heads: int, phi: FeatureMap, eps: float):
        dim = qkv.shape[2] // 3
        merged = qkv.new_empty(*qkv.shape[:2], dim)  # not a view: callers may add to it in place
        _, state = _forward(*split_qkv(qkv, num_heads), phi, eps, out=split_heads(merged, num_heads))
        ctx.save_for_backward(qkv, state)
        ctx.num_heads, ctx.phi, ctx.eps = num_heads, phi, eps
        return merged, qkv[..., 2 * dim :]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, grad_values):
        qkv, state = ctx.saved_tensors
        grad_qkv = torch.empty_like(qkv, memory_format=torch.contiguous_format)
        saved = (*split_qkv(qkv, ctx.num_heads), state)
        _backward(saved, split_heads(grad_out, ctx.num_heads), ctx.phi, ctx.eps, split_qkv(grad_qkv, ctx.num_heads))
        if grad_values is not None:
            grad_qkv[..., 2 * (qkv.shape[2] // 3) :] += grad_values
        return grad_qkv, None, None, None


def blocked_linear_attn(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, feature_map: str = "elu", eps: float = 1e-6,
    rope: torch.Tensor | None = None,
) -> torch.Tensor:
    """Non-causal linear attention, block by block of tokens.

    Args:
        q, k, v: (B, heads, N, d).
        feature_map: ``"elu"`` (elu + 1) or ``"relu"``.
        eps: lower bound of the normalizer ``phi(q_i) . sum_j phi(k_j)``.
        rope: a rotation table, (N, 2 d) or (heads, N, 2 d) (:mod:`visattn.ops.rope`), that needs no
            gradient: the features of the numerator are turned, as :func:`visattn.ops.linear_attn` says.
    Returns:
        (B, heads, N, d) in v's dtype, computed in fp32; a view of a token-major (B, N, heads, d) tensor.
    """
    check_qkv(q, k, v, "blocked_linear_attn")
    if rope is not None:
        check_rope_table(q, rope, "blocked_linear_attn")
        if needs_autograd(rope):
            raise ValueError(
                "blocked_linear_attn: the rope table needs a gradient (learned frequencies); use the 'plain' path"
            )
        rope = rope.float()
    return _BlockedLinearAttention.apply(q, k, v, get_feature_map(feature_map), eps, rope)


def packed_linear_attn(
    qkv: torch.Tensor, num_heads: int, feature_map: str = "elu", eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`blocked_linear_attn` on a qkv projection: (B, N, 3 C) laid out as timm's (q, k, v, then
    heads of d = C / num_heads) -> the output (B, N, C), heads merged, and the values (B, N, C), a view
    of the projection (for a locality term on them). The same values as splitting the heads and calling
    :func:`blocked_linear_attn`; with autograd the gradient is one (B, N, 3 C) tensor."""
    check_packed_qkv(qkv, num_heads, "packed_linear_attn")
    return _PackedLinearAttention.apply(qkv, num_heads, get_feature_map(feature_map), eps)
