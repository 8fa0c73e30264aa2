"""timm integration: the registered visattn ViTs, :func:`convert` for existing timm ViTs, ``attn="auto"``, and
:func:`transfer_attention` (attention transfer from a trained softmax ViT) and low-rank adapters for the fine-tune after it
(:func:`add_lora`)."""
from visattn.models.auto import select_attention
from visattn.models.convert import TIMM_ATTENTION, PatchGridHook, convert
from visattn.models.create import LoadReport, create_model, load_weights, model_shape
from visattn.models.lora import add_lora, merged_state_dict
from visattn.models.shapes import MODEL_SHAPES
from visattn.models.transfer import AttentionTransfer, TransferResult, transfer_attention
from visattn.models.vit import visattn_vit_base_patch16, visattn_vit_small_patch16, visattn_vit_tiny_patch16

__all__ = [
    "AttentionTransfer",
    "LoadReport",
    "MODEL_SHAPES",
    "PatchGridHook",
    "TIMM_ATTENTION",
    "TransferResult",
    "add_lora",
    "convert",
    "create_model",
    "load_weights",
    "merged_state_dict",
    "model_shape",
    "select_attention",
    "transfer_attention",
    "visattn_vit_base_patch16",
    "visattn_vit_small_patch16",
    "visattn_vit_tiny_patch16",
]
