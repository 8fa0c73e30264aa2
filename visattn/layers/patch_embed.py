"""Patch embeddings: timm's ``PatchEmbed`` (one linear projection per patch) and a convolutional stem.

Replacing a ViT's patch projection by a few stride-2 3x3 convolutions, each followed by batch norm and
ReLU, and a last 1x1 convolution to the token width makes its optimisation less sensitive to learning rate
and schedule (Xiao et al. 2021, "Early convolutions help transformers see better"); what it does for the
high-resolution recipes is measured on the dated results pages. :class:`ConvPatchEmbed` is that stem behind timm's ``PatchEmbed``
interface; the visattn models take it by name, timm's own ``VisionTransformer`` as ``embed_layer``::

    model = timm.create_model("visattn_vit_tiny_patch16", attn="linear", stem="conv")
    model = timm.create_model("vit_small_patch16_224", embed_layer=ConvPatchEmbed)

It subclasses ``PatchEmbed`` rather than using timm's ``HybridEmbed`` + ``ConvStem`` because those count the
stem's stride as a feature ratio and set ``patch_size`` to 1, while every grid computation here (the
attention's grid, tiling, the cost model) reads ``patch_embed.patch_size`` as the pixels behind one token.
"""
from __future__ import annotations

from typing import Any

import torch.nn as nn
from timm.layers import PatchEmbed

STRIDE = 2
KERNEL = 3


def stem_strides(patch_size: tuple[int, int]) -> tuple[list[tuple[int, int]], tuple[int, int]]:
    """The stride-2 steps of a conv stem for ``patch_size`` and the stride left for its last convolution.

    One 3x3 stride-2 convolution per factor of 2 shared by both sides; the last convolution covers the
    rest (kernel = stride = what is left: 1x1 for a power-of-2 patch, 7x7 after one step for 14 px).
    """
    height, width = patch_size
    steps = []
    while height % STRIDE == 0 and width % STRIDE == 0:
        steps.append((STRIDE, STRIDE))
        height, width = height // STRIDE, width // STRIDE
    return steps, (height, width)


class ConvPatchEmbed(PatchEmbed):
    """``PatchEmbed`` whose ``proj`` is a convolutional stem with the same total stride, ``patch_size``.

    Channels double at each stride-2 convolution and reach ``embed_dim`` at the last of them (for 3 steps
    and width 192: 48, 96, 192), as in Xiao et al., never below 8; then a convolution with kernel = stride = the rest of the
    patch (1x1 for a power-of-2 patch) gives the tokens. Input (B, C, H, W) -> (B, H/p * W/p, embed_dim)
    like ``PatchEmbed``.

    Raises:
        ValueError: a patch size with no factor of 2 shared by both sides (nothing to stride by).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        linear = self.proj
        steps, rest = stem_strides(self.patch_size)
        if not steps:
            raise ValueError(
                f"stem conv: patch size {self.patch_size[0]}x{self.patch_size[1]} has no factor of 2 shared by both "
                f"sides to stride by; use an even patch size, or stem patch"
            )
        factory = {"device": linear.weight.device, "dtype": linear.weight.dtype}
        layers: list[nn.Module] = []
        in_channels = linear.in_channels
        for index, stride in enumerate(steps):
            channels = max(linear.out_channels >> (len(steps) - 1 - index), 8)
            layers += [
                nn.Conv2d(in_channels, channels, KERNEL, stride=stride, padding=KERNEL // 2, bias=False, **factory),
                nn.BatchNorm2d(channels, **factory),
                nn.ReLU(inplace=True),
            ]
            in_channels = channels
        layers.append(nn.Conv2d(in_channels, linear.out_channels, rest, stride=rest, bias=linear.bias is not None,
                                **factory))
        self.proj = nn.Sequential(*layers)


STEMS: dict[str, type[PatchEmbed]] = {"patch": PatchEmbed, "conv": ConvPatchEmbed}


def check_stem(name: str, pretrained: bool, model_kwargs: dict) -> None:
    """ValueError for an unknown stem, an ``embed_layer`` keyword beside it (the stem names the patch embedding),
    or a conv stem asked for pretrained weights (published ViTs have a patch projection, whose weights a stem
    cannot take)."""
    get_stem(name)
    if "embed_layer" in model_kwargs:
        raise ValueError(f"choose the patch embedding with stem= (one of {', '.join(STEMS)}), not embed_layer=")
    if pretrained and name != "patch":
        raise ValueError(f"stem {name!r} has no pretrained weights (they are for the patch projection); use stem 'patch'")


def get_stem(name: str) -> type[PatchEmbed]:
    """The patch embedding class of a ``stem`` name: ``patch`` (timm's) or ``conv``."""
    if name not in STEMS:
        raise ValueError(f"stem {name!r} is not one of {', '.join(STEMS)}")
    return STEMS[name]
