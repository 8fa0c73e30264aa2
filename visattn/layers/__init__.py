"""nn.Module attention layers, one per type, all honouring timm's attention contract."""
from visattn.layers.base import GridAttention
from visattn.layers.registry import ATTENTION_LAYERS, attention_options, get_attention, list_attentions

__all__ = ["ATTENTION_LAYERS", "GridAttention", "attention_options", "get_attention", "list_attentions"]
