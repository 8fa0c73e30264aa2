"""Functional attention ops: pure functions on tensors, each with a naive ``*_reference`` twin."""
from visattn.ops.linear import linear, linear_reference, linear_step
from visattn.ops.softmax import softmax, softmax_reference

__all__ = ["linear", "linear_reference", "linear_step", "softmax", "softmax_reference"]
