"""Linear attention, one algorithm per module.

``functional`` chooses the path (:func:`linear_attn`); ``blocked`` is the non-causal op walked in
cache-sized token blocks with its own backward (and :func:`packed_linear_attn` on the qkv projection);
``plain`` the same as plain batched matmuls (and recomputed in the backward); ``fused`` the inference path fused with the qkv projection;
``chunk`` the causal op; ``recurrent`` its one-token step; ``naive`` the twin the tests compare with;
``decay`` the non-causal op with a spatial decay over the patch grid, ``naive_decay`` its twin.
"""
from visattn.ops.linear.blocked import blocked_linear_attn, packed_linear_attn
from visattn.ops.linear.chunk import chunk_linear_attn
from visattn.ops.linear.decay import decayed_linear_attn
from visattn.ops.linear.feature_maps import FEATURE_MAPS, FeatureMap, get_feature_map
from visattn.ops.linear.functional import linear_attn
from visattn.ops.linear.fused import fused_qkv_linear_attn
from visattn.ops.linear.naive import naive_linear_attn
from visattn.ops.linear.naive_decay import manhattan_decay, naive_decayed_linear_attn
from visattn.ops.linear.plain import checkpointed_plain_linear_attn, plain_linear_attn
from visattn.ops.linear.recurrent import linear_attn_step

__all__ = [
    "FEATURE_MAPS",
    "FeatureMap",
    "blocked_linear_attn",
    "checkpointed_plain_linear_attn",
    "chunk_linear_attn",
    "decayed_linear_attn",
    "fused_qkv_linear_attn",
    "get_feature_map",
    "linear_attn",
    "linear_attn_step",
    "manhattan_decay",
    "naive_decayed_linear_attn",
    "naive_linear_attn",
    "packed_linear_attn",
    "plain_linear_attn",
]
