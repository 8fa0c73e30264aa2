"""Functional attention ops: pure functions on tensors, each ``<type>_attn`` with a ``naive_<type>_attn``
twin (explicit N x N scores with a mask, or explicit sums). Where an op has several paths, the
choice is made in :mod:`visattn.ops.backends` and can be forced with the op's ``backend=`` argument
(or with :func:`~visattn.ops.backends.force_backend` for every call inside a block)."""
from visattn.ops.axial import axial_attn, naive_axial_attn, packed_axial_attn
from visattn.ops.backends import BACKENDS, force_backend
from visattn.ops.linear import (
    decayed_linear_attn,
    fused_qkv_linear_attn,
    linear_attn,
    linear_attn_step,
    naive_decayed_linear_attn,
    naive_linear_attn,
    packed_linear_attn,
)
from visattn.ops.linformer import linformer_attn, naive_linformer_attn, project_keys_values, resample_projection
from visattn.ops.longformer import longformer_attn, naive_longformer_attn
from visattn.ops.neighborhood import naive_neighborhood_attn, neighborhood_attn
from visattn.ops.softmax import naive_softmax_attn, softmax_attn
from visattn.ops.sparse import naive_sparse_attn, sparse_attn

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
    "naive_axial_attn",
    "naive_decayed_linear_attn",
    "naive_linear_attn",
    "naive_linformer_attn",
    "naive_longformer_attn",
    "naive_neighborhood_attn",
    "naive_softmax_attn",
    "naive_sparse_attn",
    "neighborhood_attn",
    "packed_axial_attn",
    "packed_linear_attn",
    "project_keys_values",
    "resample_projection",
    "softmax_attn",
    "sparse_attn",
]
