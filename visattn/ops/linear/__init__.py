"""Linear attention, one algorithm per module.

``functional`` chooses the path (:func:`linear_attn`); ``blocked`` is the non-causal op walked in
cache-sized token blocks with its own backward (and :func:`packed_linear_attn` on the qkv projection);
``plain`` the same as plain batched matmuls (and recomputed in the backward); ``fused`` the inference path fused with the qkv projection;
``chunk`` the causal op; ``recurrent`` its one-token step; ``naive`` the twins the tests compare with;
``decay`` the non-causal op with a spatial decay over the patch grid, ``naive_decay`` its twin;
``projected`` the linear layer's op from the qkv projection's input to the output projection's input
(:func:`projected_linear_attn`: it chooses between fusing with the projection, the packed projection and
the split heads), ``locality`` the depthwise convolution it adds.
"""
from visattn.ops.linear.blocked import packed_linear_attn
from visattn.ops.linear.decay import decayed_linear_attn
from visattn.ops.linear.feature_maps import FEATURE_MAPS
from visattn.ops.linear.functional import linear_attn
from visattn.ops.linear.fused import fused_qkv_linear_attn
from visattn.ops.linear.projected import projected_linear_attn
from visattn.ops.linear.recurrent import linear_attn_step

__all__ = [
    "FEATURE_MAPS",
    "decayed_linear_attn",
    "fused_qkv_linear_attn",
    "linear_attn",
    "linear_attn_step",
    "packed_linear_attn",
    "projected_linear_attn",
]
