"""Functional attention ops: pure functions on tensors, each ``<type>_attn``. Each op's naive twin
(``naive_<type>_attn``: explicit N x N scores with a mask, or explicit sums), which the tests compare it
against, lives in its op's module (:mod:`visattn.ops.linear.naive`, :mod:`visattn.ops.axial.naive`,
:mod:`visattn.ops.softmax`, ...). Where an op has several paths, the choice is made in
:mod:`visattn.ops.backends` and can be forced with the op's ``backend=`` argument (or with
:func:`~visattn.ops.backends.force_backend` for every call inside a block)."""
from visattn.ops.axial import axial_attn, packed_axial_attn
from visattn.ops.backends import BACKENDS, force_backend
from visattn.ops.linear import (
    decayed_linear_attn,
    fused_qkv_linear_attn,
    linear_attn,
    linear_attn_step,
    packed_linear_attn,
    projected_linear_attn,
)
from visattn.ops.linformer import linformer_attn, project_keys_values, resample_projection
from visattn.ops.longformer import longformer_attn
from visattn.ops.neighborhood import neighborhood_attn
from visattn.ops.softmax import softmax_attn
from visattn.ops.sparse import sparse_attn

__all__ = [
    "BACKENDS",
    "axial_attn",
    "decayed_linear_attn",
    "force_backend",
    "fused_qkv_linear_attn",
    "linear_attn",
    "linear_attn_step",
    "linformer_attn",
    "longformer_attn",
    "neighborhood_attn",
    "packed_axial_attn",
    "packed_linear_attn",
    "project_keys_values",
    "projected_linear_attn",
    "resample_projection",
    "softmax_attn",
    "sparse_attn",
]
