"""Many short softmax attentions (tiles, rows, columns of the grid) run a chunk at a time, for inference.

Each short sequence gathers its queries and keys from the token matrix (B * N, heads * d) by row index.
A chunk of sequences is gathered into buffers small enough to stay in cache, attended with PyTorch's
fused ``scaled_dot_product_attention``, and its outputs are written straight to their tokens in the
output matrix. Nothing of size N x (keys per sequence) is ever allocated, and the buffers are reused from
chunk to chunk. No autograd: callers use it when no gradient is needed and keep a differentiable path
for training.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from visattn.ops.cache import cache_per_inference_mode
from visattn.ops.layout import merge_heads, split_heads
from visattn.ops.pieces import ImageRun, image_runs

# A chunk's gathered keys (and values, and queries) hold about this many values each.
CHUNK_ELEMENTS = 1 << 20


@dataclass(frozen=True, eq=False)
class Sequences:
    """Short attention sequences over the tokens of one image: sequence i's L query slots read tokens
    ``q_index[i]``, its S key slots read tokens ``kv_index[i]``, and its outputs go to tokens ``dest[i]``
    (-1: a padding slot, discarded). Cached and compared by identity."""

    q_index: torch.Tensor  # (num_seqs, L) long
    kv_index: torch.Tensor  # (num_seqs, S) long
    dest: torch.Tensor  # (num_seqs, L) long, -1 for padding slots
    bias: torch.Tensor | None  # (num_seqs, 1, L, S) additive mask (0 or -inf), or None: all keys seen

    @property
    def num_seqs(self) -> int:
        return self.q_index.shape[0]


@dataclass(frozen=True)
class _Chunk:
    """Sequences ``seqs`` of images ``images``; the row indices count from the chunk's first image."""

    images: slice
    seqs: slice
    q_rows: torch.Tensor  # (b * c * L,) rows of the chunk's images' token matrix gathered as queries
    kv_rows: torch.Tensor  # (b * c * S,) rows gathered as keys and values
    kept: torch.Tensor | None  # the chunk's query slots that are written out (None: all of them)
    out_rows: torch.Tensor  # (b * kept slots,) output row of each kept slot


def _chunk_pieces(seqs: Sequences, batch: int, values_per_seq: int, budget: int) -> list[ImageRun]:
    """(images, sequences) of each chunk: whole images, or runs of one image's sequences."""
    return image_runs(batch, seqs.num_seqs, values_per_seq, budget)


@cache_per_inference_mode(maxsize=64)
def _chunks(seqs: Sequences, batch: int, values_per_seq: int, num_tokens: int, budget: int) -> tuple[_Chunk, ...]:
    """The chunks of at most ``budget`` values, as row indices into the (b * N, .) token matrix of each
    chunk's images."""
    chunks = []
    for images, part in _chunk_pieces(seqs, batch, values_per_seq, budget):
        b = images.stop - images.start
        offset = torch.arange(b, device=seqs.q_index.device)[:, None] * num_tokens  # (b, 1)
        dest = seqs.dest[part].flatten()
        kept = dest >= 0
        chunks.append(
            _Chunk(
                images,
                part,
                (offset + seqs.q_index[part].flatten()).flatten(),
                (offset + seqs.kv_index[part].flatten()).flatten(),
                None if bool(kept.all()) else kept.nonzero().flatten(),
                (offset + dest[kept]).flatten(),
            )
        )
    return tuple(chunks)


def attend_in_chunks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seqs: Sequences,
    batch: int,
    heads: int,
    scale: float | None = None,
) -> torch.Tensor:
    """Runs every sequence of ``seqs``.

    Args:
        q, k, v: (B * N, heads * d) token matrices (any row stride), images one after another.
        seqs: the sequences of one image; every image has the same.
        batch: B.
    Returns:
        (B * N, heads * d_v) in the attention's dtype (autocast applies), written at the rows of
        ``seqs.dest``; the other rows are left uninitialised for the caller.
    """
    L, S = seqs.q_index.shape[1], seqs.kv_index.shape[1]
    num_tokens = q.shape[0] // batch
    buffers: dict[tuple[str, int], torch.Tensor] = {}
    out = None

    def gather(t: torch.Tensor, rows: torch.Tensor, name: str, seqs_in_chunk: int) -> torch.Tensor:
        buf = buffers.get((name, rows.shape[0]))
        if buf is None:
            buf = buffers[name, rows.shape[0]] = t.new_empty(rows.shape[0], t.shape[1])
        torch.index_select(t, 0, rows, out=buf)
        return split_heads(buf.view(seqs_in_chunk, -1, t.shape[1]), heads)

    for chunk in _chunks(seqs, batch, S * k.shape[1], num_tokens, CHUNK_ELEMENTS):
        b, c = chunk.images.stop - chunk.images.start, chunk.seqs.stop - chunk.seqs.start
        tokens = slice(chunk.images.start * num_tokens, chunk.images.stop * num_tokens)  # the chunk's images
        bias = None
        if seqs.bias is not None:
            bias = seqs.bias[chunk.seqs]
            bias = (bias if b == 1 else bias.repeat(b, 1, 1, 1)).expand(-1, heads, -1, -1)  # 4D: fused kernel
        attn = F.scaled_dot_product_attention(
            gather(q[tokens], chunk.q_rows, "q", b * c),
            gather(k[tokens], chunk.kv_rows, "k", b * c),
            gather(v[tokens], chunk.kv_rows, "v", b * c),
            attn_mask=bias,
            scale=scale,
        )  # (b * c, heads, L, d_v), token-major in memory
        attn = merge_heads(attn).flatten(0, 1)  # (b * c * L, heads * d_v)
        if chunk.kept is not None:
            attn = attn.view(b, c * L, -1)[:, chunk.kept].flatten(0, 1)
        if out is None:
            out = attn.new_empty(q.shape[0], attn.shape[1])
        out[tokens].index_copy_(0, chunk.out_rows, attn)
    return out
