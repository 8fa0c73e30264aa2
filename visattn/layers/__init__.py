"""nn.Module attention layers, one per type, all honouring timm's attention contract; and the patch
embeddings a visattn ViT can start with."""
from visattn.layers.base import GridAttention
from visattn.layers.patch_embed import STEMS, ConvPatchEmbed, get_stem
from visattn.layers.registry import ATTENTION_LAYERS, attention_options, get_attention, list_attentions

__all__ = [
    "ATTENTION_LAYERS", "STEMS", "ConvPatchEmbed", "GridAttention", "attention_options", "get_attention", "get_stem",
    "list_attentions",
]
