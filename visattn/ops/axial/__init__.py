"""Axial attention, one path per module: ``functional`` chooses (:func:`axial_attn`,
:func:`packed_axial_attn`), ``hops`` is the two-hop formulation on SDPA, ``cpu_kernels`` the CPU's
fused kernels with a hand-written backward, ``naive`` the twin the tests compare with."""
from visattn.ops.axial.functional import axial_attn, packed_axial_attn
__all__ = ["axial_attn", "packed_axial_attn"]
