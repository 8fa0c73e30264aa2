"""The shapes of the registered visattn ViTs (timm's ViT-Ti/S/B) and the patch grid of an image size."""
from __future__ import annotations

MODEL_SHAPES: dict[str, dict[str, int]] = {
    "visattn_vit_tiny_patch16": dict(patch_size=16, embed_dim=192, depth=12, num_heads=3),
    "visattn_vit_small_patch16": dict(patch_size=16, embed_dim=384, depth=12, num_heads=6),
    "visattn_vit_base_patch16": dict(patch_size=16, embed_dim=768, depth=12, num_heads=12),
}


def patch_grid(img_size: tuple[int, int], patch_size: tuple[int, int]) -> tuple[int, int]:
    """The patch grid (H, W) that a ViT's patch embedding makes of an image of ``img_size`` (height, width)
    pixels: timm's ``PatchEmbed`` without padding drops the pixels that do not fill a patch."""
    return int(img_size[0]) // int(patch_size[0]), int(img_size[1]) // int(patch_size[1])
