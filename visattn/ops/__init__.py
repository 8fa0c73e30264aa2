"""Functional attention ops: pure functions on tensors, each with a naive ``*_reference`` twin."""
from visattn.ops.axial import axial, axial_packed, axial_reference
from visattn.ops.linear import linear, linear_from_input, linear_packed, linear_reference, linear_step
from visattn.ops.linformer import linformer, linformer_reference, project_keys_values, resample_projection
from visattn.ops.longformer import longformer, longformer_reference
from visattn.ops.neighborhood import neighborhood, neighborhood_reference
from visattn.ops.softmax import softmax, softmax_reference
from visattn.ops.sparse import sparse, sparse_reference

__all__ = [
    "axial",
    "axial_packed",
    "axial_reference",
    "linear",
    "linear_from_input",
    "linear_packed",
    "linear_reference",
    "linear_step",
    "linformer",
    "linformer_reference",
    "longformer",
    "longformer_reference",
    "neighborhood",
    "neighborhood_reference",
    "project_keys_values",
    "resample_projection",
    "softmax",
    "softmax_reference",
    "sparse",
    "sparse_reference",
]
