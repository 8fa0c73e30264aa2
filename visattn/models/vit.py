"""visattn ViT-Ti/S/B registered with timm: timm's ``VisionTransformer`` with visattn attention.

``import visattn`` registers ``visattn_vit_tiny_patch16``, ``visattn_vit_small_patch16`` and
``visattn_vit_base_patch16``::

    model = timm.create_model("visattn_vit_small_patch16", attn="axial", img_size=1024, num_classes=10)

Every keyword of timm's ``VisionTransformer`` passes through (``img_size`` as int or (H, W),
``patch_size``, ``reg_tokens``, ``class_token``, ``global_pool``, ``dynamic_img_size``,
``drop_path_rate``, ...). ``attn`` is one name of :func:`visattn.list_attentions`, a list with one name
per block, ``"timm"`` (timm's own ``Attention`` kept: the stock model, the reference), or ``"auto"`` (chosen by :func:`visattn.models.auto.select_attention` from the model name, the image
size and ``auto_batch_size``, the images per step the model will run at, default 1); ``attn_kwargs`` holds
the type options, as in :func:`visattn.convert`. ``stem="conv"`` replaces the patch projection by a
convolutional stem of the same patch size (:class:`visattn.layers.patch_embed.ConvPatchEmbed`).

No weights are published: ``pretrained=True`` loads a local file, built with the same ``attn``::

    timm.create_model("visattn_vit_small_patch16", attn="axial", num_classes=10, pretrained=True,
                      pretrained_cfg_overlay=dict(file="model.safetensors", num_classes=10))

The overlay's ``num_classes`` is the file's class count: timm keeps the file's head only when it equals
the model's ``num_classes`` (the cfg says 1000), and otherwise starts a new head.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model
from timm.models.vision_transformer import VisionTransformer, checkpoint_filter_fn

from visattn.layers.patch_embed import check_stem, get_stem
from visattn.models.auto import check_auto_batch_size, select_attention
from visattn.models.convert import TIMM_ATTENTION, convert, keep_timm_attention
from visattn.models.shapes import MODEL_SHAPES



def _cfg(**kwargs: Any) -> dict[str, Any]:
    return {
        "num_classes": 1000,
        "input_size": (3, 224, 224),
        "pool_size": None,
        "crop_pct": 0.9,
        "interpolation": "bicubic",
        "fixed_input_size": True,
        "mean": IMAGENET_DEFAULT_MEAN,
        "std": IMAGENET_DEFAULT_STD,
        "first_conv": "patch_embed.proj",
        "classifier": "head",
        **kwargs,
    }


default_cfgs = generate_default_cfgs({name: _cfg() for name in MODEL_SHAPES})


def _create_visattn_vit(
    variant: str,
    pretrained: bool = False,
    attn: str | Sequence[str] = "linear",
    attn_kwargs: dict[str, Any] | None = None,
    auto_batch_size: int | None = None,
    stem: str = "patch",
    **kwargs: Any,
) -> VisionTransformer:
    """timm's VisionTransformer built through ``build_model_with_cfg`` and converted before any weights load."""
    if "attn_layer" in kwargs:
        raise ValueError(
            f"{variant}: choose the attention with attn= (a name of visattn.list_attentions()), not attn_layer="
        )
    check_auto_batch_size(attn, auto_batch_size)
    check_stem(stem, pretrained, kwargs)
    attn_kwargs = dict(attn_kwargs or {})

    def build(**model_kwargs: Any) -> VisionTransformer:
        model = VisionTransformer(**model_kwargs)
        if attn == TIMM_ATTENTION:
            return keep_timm_attention(model, attn_kwargs)
        names = attn
        if attn == "auto":
            embed = model.patch_embed
            names = select_attention(variant, tuple(embed.img_size), tuple(embed.patch_size), auto_batch_size or 1)
        return convert(model, names, **attn_kwargs)

    out_indices = kwargs.pop("out_indices", 3)
    return build_model_with_cfg(
        build,
        variant,
        pretrained,
        pretrained_filter_fn=checkpoint_filter_fn,
        feature_cfg=dict(out_indices=out_indices, feature_cls="getter"),
        **{**MODEL_SHAPES[variant], "embed_layer": get_stem(stem), **kwargs},
    )


@register_model
def visattn_vit_tiny_patch16(pretrained: bool = False, **kwargs: Any) -> VisionTransformer:
    """ViT-Ti/16 (dim 192, depth 12, 3 heads) with visattn attention."""
    return _create_visattn_vit("visattn_vit_tiny_patch16", pretrained=pretrained, **kwargs)


@register_model
def visattn_vit_small_patch16(pretrained: bool = False, **kwargs: Any) -> VisionTransformer:
    """ViT-S/16 (dim 384, depth 12, 6 heads) with visattn attention."""
    return _create_visattn_vit("visattn_vit_small_patch16", pretrained=pretrained, **kwargs)


@register_model
def visattn_vit_base_patch16(pretrained: bool = False, **kwargs: Any) -> VisionTransformer:
    """ViT-B/16 (dim 768, depth 12, 12 heads) with visattn attention."""
    return _create_visattn_vit("visattn_vit_base_patch16", pretrained=pretrained, **kwargs)
