"""Axial attention layer (Ho et al. 2019): row, then column softmax attention over the patch grid."""
from __future__ import annotations

import torch
import torch.nn as nn

from visattn.layers.base import GridAttention
from visattn.layers.cost import CostCase, MixingMemory
from visattn.ops.axial import axial_attn, packed_axial_attn
from visattn.ops.axial.triton import triton_fits
from visattn.ops.backends import choose_axial_backend, planned_backend


class AxialAttention(GridAttention):
    """Row attention then column attention with one set of q, k, v (timm's single ``qkv``), so every
    output sees the whole grid in two hops; prefix tokens are keys of every row and column and attend
    to all tokens. O(N (H + W) d) per head. See :func:`visattn.ops.axial_attn`.

    With ``rope``, q and k are turned once, before both hops, and each axis gets its own rotation: in the
    row hop a query and its keys share the row, so the row angles cancel and a score depends on the column
    offset only; in the column hop, on the row offset only. With ``rope="axial"`` a hop's position lives in
    the half of the channels that turns with its axis (the other half is position-free there); with
    ``"mixed"`` every pair turns with the hop's axis at its learned frequency along that axis.
    """

    name = "axial"
    supports_attn_drop = True

    def project_and_mix(self, x, grid, attn_mask, is_causal) -> torch.Tensor:
        """Without q/k norms and rope the op runs on the qkv projection itself
        (:func:`visattn.ops.packed_axial_attn`), whose gradient then comes back in one piece on the
        ``"cpu_kernels"`` and ``"triton"`` paths; the Triton kernels read q, k, v from it in place."""
        plain_qk = isinstance(self.q_norm, nn.Identity) and isinstance(self.k_norm, nn.Identity)
        if not plain_qk or self.rope is not None:
            return super().project_and_mix(x, grid, attn_mask, is_causal)
        return packed_axial_attn(self.qkv(x), self.num_heads, grid, self.num_prefix_tokens, self.dropout_p)

    def mix(self, q, k, v, grid, attn_mask, is_causal) -> torch.Tensor:
        return axial_attn(q, k, v, grid, num_prefix_tokens=self.num_prefix_tokens, dropout_p=self.dropout_p)

    @classmethod
    def mixing_flops(cls, case: CostCase) -> int:
        """``4 C (M (2P + H + W) + P N)``: rows, M queries x (P + W) keys; columns, x (P + H); prefix
        queries, P x N."""
        layout = case.layout
        (rows, cols), p, m = layout.grid, layout.num_prefix_tokens, layout.num_patches
        return 4 * case.dim * (m * (2 * p + rows + cols) + p * layout.num_tokens)

    @classmethod
    def mixing_memory(cls, case: CostCase) -> MixingMemory:
        """Inference: the row hop's output and the op's output. Training on the path
        :func:`visattn.ops.backends.choose_axial_backend` picks on the case's device (or the one forced
        with :func:`~visattn.ops.backends.force_backend`): on the CPU's, q, k, v, which
        :func:`visattn.ops.axial_attn` keeps on every path (left out: the column hop's contiguous copies
        in inference on SDPA, and the row hop's output and log-sum-exps the CPU path keeps for the
        backward); on CUDA's Triton kernels, :func:`triton_train_memory`; on SDPA (other devices, or
        CUDA where the kernels do not fit), autograd through it (:func:`sdpa_train_memory`)."""
        n, c, act_bytes = case.layout.num_tokens, case.dim, case.act_bytes
        fits = triton_fits(case.layout.grid, case.layout.num_prefix_tokens, case.head_dim)
        path = planned_backend("axial", lambda: choose_axial_backend(case.device, 0.0, True, triton_fits=fits))
        if path == "sdpa":
            train = sdpa_train_memory(case)
        elif path == "triton":
            train = triton_train_memory(case)
        else:
            train = 3 * n * c * act_bytes
        return MixingMemory(infer=2 * n * c * act_bytes, train=train)


def triton_train_memory(case: CostCase) -> int:
    """Bytes per image that the Triton kernels (the ``"triton"`` path) keep for the backward: the qkv
    projection (q, k and v are views of it), the row hop's output (the column hop's values, N tokens with
    v's prefix tokens) and the fp32 log-sum-exps of the row hop, the column hop and the prefix queries,
    per head. The op's own output, which the backward reads too, is the projection's input, counted
    with the block."""
    layout = case.layout
    m, p = layout.num_patches, layout.num_prefix_tokens
    return 4 * layout.num_tokens * case.dim * case.act_bytes + 4 * case.num_heads * (2 * m + p)


def sdpa_train_memory(case: CostCase) -> int:
    """Bytes per image that autograd keeps through :func:`visattn.ops.axial.hops.rows_then_columns` (the
    ``"sdpa"`` path), where every SDPA keeps its q, k, v, its output and an fp32 log-sum-exp per query and
    head: the qkv projection (the prefix queries' keys and values are views of it, or without prefix
    tokens the row hop's), the copies that each hop makes of its sequences, and the hops' outputs. The
    op's own output is the projection's input, counted with the block."""
    layout = case.layout
    (h, w), p, m = layout.grid, layout.num_prefix_tokens, layout.num_patches
    qkv = 3 * layout.num_tokens
    # rows: with prefix tokens, q's rows are a copy (a view at batch 1, counted as a copy) and k's and
    # v's rows are copies with the prefix keys in front; without, all three are views of the projection
    row_copies = m + 2 * h * (p + w) if p else 0
    # columns: q's columns, and k's and the row hop's output with the prefix in front, always copies
    column_copies = m + 2 * w * (p + h)
    outputs = 2 * m + p  # the row hop's (the column values), the column hop's, the prefix queries'
    elements = qkv + row_copies + column_copies + outputs
    return elements * case.dim * case.act_bytes + 4 * case.num_heads * (2 * m + p)
