"""Model-level cost of a visattn ViT: FLOPs and memory per image, from the per-type formulas that each
layer class states (:meth:`visattn.layers.GridAttention.mixing_flops` and its siblings; counting rules
in :mod:`visattn.layers.cost`).

FLOPs
-----
The whole model, per image, forward:

* patch embedding: ``2 HW (c_in p_h p_w) C`` for an H x W patch grid and C = embed_dim; a convolutional
  stem (``stem="conv"``) counts each convolution's products, ``2 H_out W_out (c_in k_h k_w) c_out``, and
  leaves out its batch norms and ReLUs (a few operations per element, one to two orders of magnitude
  below the convolutions);
* per block: the qkv projection (``6 N C^2`` unless the type says otherwise) + ``proj 2 N C^2`` +
  ``MLP 4 N C C_mlp`` + the token mixing of the type, with N = P + HW tokens (P prefix tokens: class +
  register);
* head: ``2 C num_classes`` (one pooled token).

A training step (forward + backward) costs ``3 x forward - first convolution``: the backward of a
product is two products of the same size, except that no gradient flows into the image. Where implementation
and definition coincide, the forward counts equal ``torch.utils.flop_counter.FlopCounterMode`` on the
math path of ``scaled_dot_product_attention`` (the fused CPU kernel hides its products from the
counter); the tests check this for every registered type.

Memory
------
:func:`estimate_memory` is the memory a configuration allocates on top of the runtime itself (CUDA
context, interpreter and libraries are not included): parameters (x4 in training: weights, gradients
and the two AdamW moments), the activations saved for the backward (training) or the largest live set
of one block (inference), and each type's own buffers on the paths its op takes on the device
(:meth:`~visattn.layers.GridAttention.mixing_memory`). It is an estimate for deciding what to skip,
good to a small factor; ``visattn-bench`` measures the real peak.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from visattn.layers import get_attention
from visattn.layers.cost import CostCase, TokenLayout
from visattn.models.shapes import patch_grid


@dataclass(frozen=True)
class StemConv:
    """One convolution of a patch embedding: channels in and out, kernel and stride (height, width), padding."""

    in_channels: int
    out_channels: int
    kernel: tuple[int, int]
    stride: tuple[int, int]
    padding: tuple[int, int]

    @classmethod
    def from_module(cls, conv: nn.Conv2d) -> StemConv:
        return cls(conv.in_channels, conv.out_channels, tuple(conv.kernel_size), tuple(conv.stride), tuple(conv.padding))

    def output_size(self, size: tuple[int, int]) -> tuple[int, int]:
        return tuple((s + 2 * p - k) // t + 1 for s, p, k, t in zip(size, self.padding, self.kernel, self.stride))

    def flops(self, output_size: tuple[int, int]) -> int:
        return 2 * output_size[0] * output_size[1] * self.in_channels * self.kernel[0] * self.kernel[1] * self.out_channels


@dataclass(frozen=True)
class ViTShape:
    """What the cost model needs to know about a timm ``VisionTransformer``."""

    embed_dim: int
    depth: int
    num_heads: int
    mlp_hidden: int
    patch_size: tuple[int, int]
    in_chans: int
    num_prefix_tokens: int
    num_classes: int
    stem: tuple[StemConv, ...] = ()  # the convolutions of a conv stem, in order; () for timm's patch projection

    @classmethod
    def from_model(cls, model: nn.Module) -> ViTShape:
        """Read the shape off a timm ``VisionTransformer`` (also one built on the meta device)."""
        block = model.blocks[0]
        head = model.head
        convs = [StemConv.from_module(m) for m in model.patch_embed.proj.modules() if isinstance(m, nn.Conv2d)]
        return cls(
            embed_dim=model.embed_dim,
            depth=len(model.blocks),
            num_heads=block.attn.num_heads,
            mlp_hidden=block.mlp.fc1.out_features,
            patch_size=tuple(model.patch_embed.patch_size),
            in_chans=convs[0].in_channels,
            num_prefix_tokens=model.num_prefix_tokens,
            num_classes=head.out_features if isinstance(head, nn.Linear) else 0,
            stem=tuple(convs) if len(convs) > 1 else (),
        )

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    def grid(self, img_size: tuple[int, int]) -> tuple[int, int]:
        """The patch grid (H, W) of an image of ``img_size`` (height, width) pixels."""
        return patch_grid(img_size, self.patch_size)

    def layout(self, img_size: tuple[int, int]) -> TokenLayout:
        return TokenLayout(self.grid(img_size), self.num_prefix_tokens)

    def cost_case(
        self, img_size: tuple[int, int], options: Mapping[str, Any], act_bytes: int = 4, device: torch.device | str = "cpu"
    ) -> CostCase:
        """One block's token mixing at ``img_size``, as the layers' cost hooks take it."""
        return CostCase(self.layout(img_size), self.num_heads, self.head_dim, options, act_bytes, device)


def mixing_flops(attn: str, layout: TokenLayout, num_heads: int, head_dim: int, options: Mapping[str, Any]) -> int:
    """Forward FLOPs of one block's token mixing for one image."""
    return get_attention(attn).mixing_flops(CostCase(layout, num_heads, head_dim, options))


def patch_embed_flops(shape: ViTShape, img_size: tuple[int, int]) -> int:
    return sum(_stem_flops(shape, img_size))


def _stem_sizes(shape: ViTShape, img_size: tuple[int, int]) -> list[tuple[int, int]]:
    """The output size (height, width) of each convolution of a conv stem, in order."""
    sizes, size = [], tuple(img_size)
    for conv in shape.stem:
        size = conv.output_size(size)
        sizes.append(size)
    return sizes


def _stem_activations(shape: ViTShape, img_size: tuple[int, int]) -> tuple[int, int]:
    """Elements of one image a conv stem keeps for the backward (each stride-2 convolution's output, read by
    its batch norm, and the ReLU's output), and its largest live set in inference: a convolution's input and
    output, or a batch norm's (not in place; the ReLU is). (0, 0) for timm's patch projection. The image itself,
    the first convolution's input, is counted with the model's other per-image tensors."""
    if not shape.stem:
        return 0, 0
    sizes = _stem_sizes(shape, img_size)
    outputs = [conv.out_channels * h * w for conv, (h, w) in zip(shape.stem, sizes)]
    inputs = [0, *outputs[:-1]]
    saved = sum(2 * out for out in outputs[:-1])
    live = max(max(i + o for i, o in zip(inputs, outputs)), 2 * max(outputs[:-1]))
    return saved, live


def _stem_flops(shape: ViTShape, img_size: tuple[int, int]) -> list[int]:
    """FLOPs of each convolution of the patch embedding, in order (one for timm's patch projection)."""
    if not shape.stem:
        h, w = shape.grid(img_size)
        return [2 * h * w * shape.in_chans * shape.patch_size[0] * shape.patch_size[1] * shape.embed_dim]
    return [conv.flops(size) for conv, size in zip(shape.stem, _stem_sizes(shape, img_size))]


def vit_flops(shape: ViTShape, img_size: tuple[int, int], attn: str, options: Mapping[str, Any]) -> int:
    """Forward FLOPs of the whole model for one image of ``img_size`` (height, width)."""
    layer = get_attention(attn)
    case = shape.cost_case(img_size, options)
    n, c = case.layout.num_tokens, shape.embed_dim
    block = layer.qkv_flops(case) + 2 * n * c * c + 4 * n * c * shape.mlp_hidden
    mixing = layer.mixing_flops(case)
    return patch_embed_flops(shape, img_size) + shape.depth * (block + mixing) + 2 * c * shape.num_classes


def train_flops(shape: ViTShape, img_size: tuple[int, int], attn: str, options: Mapping[str, Any]) -> int:
    """FLOPs of a training step (forward + backward) for one image."""
    return 3 * vit_flops(shape, img_size, attn, options) - _stem_flops(shape, img_size)[0]


def estimate_memory(
    shape: ViTShape,
    img_size: tuple[int, int],
    attn: str,
    options: Mapping[str, Any],
    batch_size: int,
    training: bool,
    act_bytes: int,
    param_count: int,
    grad_checkpointing: bool = False,
    *,
    device: torch.device | str,
) -> int:
    """Bytes a forward (``training=False``) or a training step with AdamW allocates at its peak, with the
    type's buffers on the paths its op takes on ``device`` in eager mode: the choice of path reads
    ``torch.compiler.is_compiling()``, which is False while a sweep is planned, so a ``--compile`` run is
    estimated on the eager paths.

    Per image and block, training keeps ``5 N C + 2 N C_mlp`` activations for the backward (the inputs of
    both norms, of qkv, proj, fc1, and of the GELU and fc2) plus the type's saved tensors, and needs
    one block's working set on top during the backward; inference holds at most one block's live set:
    the MLP stage (``2 N C + 2 N C_mlp``) or the attention stage (``6 N C`` plus the type's buffers).
    With gradient checkpointing, training keeps only each block's input (``N C``) and, during the
    backward, one recomputed block's saved activations. A conv stem adds what its batch norms and ReLUs
    keep for the backward, and in inference its largest convolution's input and output.
    """
    case = shape.cost_case(img_size, options, act_bytes, device)
    n, c, hidden = case.layout.num_tokens, shape.embed_dim, shape.mlp_hidden
    mix = get_attention(attn).mixing_memory(case)
    image = 3 * img_size[0] * img_size[1] * 4 + 2 * n * c * act_bytes
    mlp_stage = (2 * n * c + 2 * n * hidden) * act_bytes
    attention_stage = 6 * n * c * act_bytes + mix.infer
    stem_saved, stem_live = (elements * act_bytes for elements in _stem_activations(shape, img_size))
    if training:
        block_saved = (5 * n * c + 2 * n * hidden) * act_bytes + mix.train
        saved = shape.depth * n * c * act_bytes + block_saved if grad_checkpointing else shape.depth * block_saved
        per_image = image + stem_saved + saved + max(mlp_stage, attention_stage)
        return 16 * param_count + shape.depth * mix.shared + batch_size * per_image
    return 4 * param_count + mix.shared + batch_size * (image + max(mlp_stage, attention_stage, stem_live))
