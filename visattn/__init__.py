"""visattn: efficient 2D-aware attention (linear, sparse, axial) for timm vision transformers."""
from visattn.layers import ATTENTION_LAYERS, GridAttention, get_attention, list_attentions

__version__ = "0.1.0"

__all__ = ["ATTENTION_LAYERS", "GridAttention", "get_attention", "list_attentions"]
