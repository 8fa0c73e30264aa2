"""timm integration: the registered visattn ViTs and :func:`convert` for existing timm ViTs."""
from visattn.models.convert import PatchGridHook, convert
from visattn.models.vit import MODEL_SHAPES

__all__ = ["MODEL_SHAPES", "PatchGridHook", "convert"]
