"""visattn: efficient 2D-aware attention (linear, sparse, axial) for timm vision transformers."""
from visattn.layers import ATTENTION_LAYERS, GridAttention, get_attention, list_attentions
from visattn.models import convert  # importing visattn.models registers the visattn_vit_* models with timm

__version__ = "0.1.0"

__all__ = ["ATTENTION_LAYERS", "GridAttention", "convert", "get_attention", "list_attentions"]
