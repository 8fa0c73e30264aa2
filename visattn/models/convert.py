"""Put visattn attention into a timm ``VisionTransformer``, and tell the layers the patch grid.

:func:`convert` replaces the attention of every block of an existing timm ViT in place. The registered
``visattn_vit_*`` models (:mod:`visattn.models.vit`) are timm's own ``VisionTransformer`` passed through
the same function, so both ways of getting a visattn model share one code path.

How the grid reaches the layers
-------------------------------
A 2D layer needs the patch grid (H, W) and the number of prefix (class + register) tokens on every
forward; the image size can change between calls (``dynamic_img_size=True``, ``set_input_size``).
:func:`convert` registers one :class:`PatchGridHook` as a forward hook on ``model.patch_embed``: after
the patch embedding runs, the hook computes the grid from the input image with
``patch_embed.dynamic_feat_size((H_img, W_img))`` (which accounts for ``dynamic_img_pad``) and calls
``set_grid(grid, model.num_prefix_tokens)`` on every visattn layer. Every path through the model
(``forward``, ``forward_features``, ``forward_intermediates``, ``get_intermediate_layers``, feature
wrappers) calls ``patch_embed`` first, so the layers always see the grid of the current image. The hook
is an object holding the list of layers, not a closure, so ``copy.deepcopy(model)`` (EMA) and pickling
give a model whose hook updates its own layers.

The grid is state of the layers between the patch embedding and the blocks. Two consequences:
``torch.compile`` traces the hook without a graph break and specialises on the grid, so each new image
size compiles once more (timm's own ViT does the same, its position-embedding resampling specialises
too); and with gradient checkpointing, the blocks are recomputed in backward with the grid of the
latest forward, so run the backward of a forward before a forward at another image size.

timm's ``attn_layer=`` argument
-------------------------------
``timm.create_model("vit_small_patch16_224", attn_layer=visattn.get_attention("softmax"))`` builds a
working model for the layers that do not need the grid (``needs_grid`` False: ``softmax`` and ``floor``;
``linear`` needs it for its default locality term), because those layers honour timm's ``attn_layer`` constructor
and forward contract. It cannot carry a layer that needs the grid: timm's ``Block`` only passes
``(x, attn_mask, is_causal)`` to the attention, so nothing tells the layer (H, W) and it raises on its
first forward. It cannot carry type options either (timm calls ``issubclass`` on ``attn_layer``, which
rejects a ``functools.partial``). Use :func:`convert` or the registered models for those.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch.nn as nn
from timm.layers import Attention, PatchDropout
from timm.models.vision_transformer import VisionTransformer

from visattn.layers import GridAttention, get_attention, list_attentions
from visattn.models.tile_order import keep_tokens_in_tile_order

# Submodules every layer shares with timm's Attention; they move as they are into the new layer.
CARRIED_MODULES = ("qkv", "q_norm", "k_norm", "norm", "proj")
# The ``attn`` name, beside the registry's, that keeps timm's own Attention: the reference the visattn types
# are measured against. Never a registry name.
TIMM_ATTENTION = "timm"


class PatchGridHook:
    """Forward hook on ``model.patch_embed``: tells every visattn layer the patch grid of this forward.

    Args:
        layers: the visattn layers of the model's blocks.
        num_prefix_tokens: class + register tokens before the patch tokens (``model.num_prefix_tokens``).
    """

    def __init__(self, layers: list[GridAttention], num_prefix_tokens: int) -> None:
        self.layers = layers
        self.num_prefix_tokens = num_prefix_tokens

    def __call__(self, patch_embed: nn.Module, args: tuple, output: Any) -> None:
        image = args[0]  # (B, C, H_img, W_img)
        grid = patch_embed.dynamic_feat_size((image.shape[-2], image.shape[-1]))
        for layer in self.layers:
            layer.set_grid(grid, self.num_prefix_tokens)


def convert(model: nn.Module, attn: str | Sequence[str] = "linear", **attn_kwargs: Any) -> nn.Module:
    """Replace the attention of every block of a timm ``VisionTransformer`` in place.

    The new layers take over the ``qkv``, ``q_norm``, ``k_norm``, ``norm`` and ``proj`` modules of the
    old ones (the same parameters, so their weights and any optimizer state stay valid); every other
    weight of the model is untouched. Parameters the new type adds (e.g. a depthwise convolution) are
    freshly initialised. ``convert(model, "softmax")`` computes exactly what timm's fused attention does.

    Args:
        model: a timm ``VisionTransformer`` (or subclass) whose blocks hold timm's ``Attention`` or a visattn
            layer without parameters beyond the carried ones.
        attn: one name of :func:`visattn.list_attentions` for every block, or a list with one name per block.
        **attn_kwargs: type options (keyword-only constructor arguments of the layer class). With a list of
            names, give the options of each type under its name: ``convert(m, ["axial", "softmax"],
            axial={...})``. Options that depend on the model (``ref_grid``: the patch grid the model was
            built for) are filled in where the layer class accepts them and they are not given.
    Returns:
        ``model``, converted, with a :class:`PatchGridHook` on ``model.patch_embed``, and its blocks in a
        :class:`visattn.models.tile_order.TileOrderBlocks` where a layer is local.
    Raises:
        ValueError: an unsupported model or attention, an unknown attention name or option, a list whose
            length is not the depth, or a layer that needs the grid in a model with patch dropout.
    """
    _check_model(model)
    blocks = list(model.blocks)
    names = _names_per_block(attn, len(blocks))
    options = _options_per_type(attn, names, attn_kwargs)
    # Options that depend on the model, given to the layer classes that accept them unless set by the
    # caller. ref_grid: the grid a layer's token-axis parameters are defined on.
    model_defaults = {"ref_grid": tuple(model.patch_embed.grid_size)}

    new_layers = [
        _layer_like(block.attn, index, get_attention(name), options[name], model_defaults)
        for index, (block, name) in enumerate(zip(blocks, names))
    ]
    _check_patch_drop(model, new_layers)
    for block, layer in zip(blocks, new_layers):
        block.attn = layer
    _install_grid_hook(model, new_layers)
    keep_tokens_in_tile_order(model)
    return model


def keep_timm_attention(model: VisionTransformer, attn_kwargs: Mapping[str, Any]) -> VisionTransformer:
    """``model`` as timm built it, for ``attn="timm"``: timm's ``Attention`` in every block, no grid hook.

    Raises:
        ValueError: ``attn_kwargs`` given; timm's Attention takes its options (``qk_norm``, ...) as model keywords.
    """
    if attn_kwargs:
        raise ValueError(
            f"attn={TIMM_ATTENTION!r} keeps timm's Attention, which takes no attention options; got "
            f"{', '.join(map(str, attn_kwargs))} (timm's own, such as qk_norm, are model keywords)"
        )
    return model


def _check_model(model: nn.Module) -> None:
    supported = (
        "convert supports timm's VisionTransformer (timm.create_model('vit_small_patch16_224') and other "
        "'vit_*' models, with or without class token, with register tokens, with dynamic_img_size)"
    )
    if not isinstance(model, VisionTransformer):
        raise ValueError(f"{supported}; got {type(model).__name__}")
    if not hasattr(model.patch_embed, "dynamic_feat_size"):
        raise ValueError(
            f"{supported}; its patch_embed ({type(model.patch_embed).__name__}) has no dynamic_feat_size, "
            "so the patch grid cannot be computed"
        )
    for index, block in enumerate(model.blocks):
        if not isinstance(getattr(block, "attn", None), nn.Module):
            raise ValueError(
                f"{supported} with one self-attention per block (block.attn); block {index} "
                f"({type(block).__name__}) has none"
            )


def _names_per_block(attn: str | Sequence[str], depth: int) -> list[str]:
    if isinstance(attn, str):
        names = [attn] * depth
    elif isinstance(attn, Sequence) and all(isinstance(name, str) for name in attn):
        names = list(attn)
        if len(names) != depth:
            raise ValueError(f"attn list has {len(names)} names but the model has depth={depth}; give one per block")
    else:
        raise ValueError(
            f"attn must be a name or a list of names, one per block; valid names: {', '.join(list_attentions())}"
        )
    for name in names:
        get_attention(name)  # ValueError listing the valid names
    return names


def _options_per_type(
    attn: str | Sequence[str], names: list[str], attn_kwargs: dict[str, Any]
) -> dict[str, dict[str, Any]]:
    """Type options keyed by attention name, each checked against its layer's constructor."""
    if isinstance(attn, str):
        options = {attn: dict(attn_kwargs)}
    else:
        used = sorted(set(names))
        unknown = [key for key in attn_kwargs if key not in used]
        bad = [key for key in attn_kwargs if key in used and not isinstance(attn_kwargs[key], Mapping)]
        if unknown or bad:
            raise ValueError(
                f"with a list of attention names, give type options under the type's name "
                f"(e.g. {used[0]}={{...}}); names in the list: {', '.join(used)}; got {', '.join(unknown + bad)}"
            )
        options = {name: dict(attn_kwargs.get(name, {})) for name in used}
    for name, opts in options.items():
        accepted = set(get_attention(name).type_options())
        unknown = sorted(set(opts) - accepted)
        if unknown:
            raise ValueError(
                f"{name}: unknown option(s) {', '.join(unknown)}; accepted: {', '.join(sorted(accepted)) or 'none'}"
            )
    return options


def _layer_like(
    old: nn.Module, index: int, cls: type[GridAttention], options: dict[str, Any], model_defaults: dict[str, Any]
) -> GridAttention:
    """A ``cls`` layer of ``old``'s shape that takes over ``old``'s projections and norms."""
    _check_source(old, index)
    accepted = cls.type_options()
    kwargs = {key: value for key, value in model_defaults.items() if key in accepted} | options
    weight = old.qkv.weight
    layer = cls(
        old.qkv.in_features,
        num_heads=old.num_heads,
        qkv_bias=old.qkv.bias is not None,
        proj_bias=old.proj.bias is not None,
        attn_drop=old.attn_drop.p,
        proj_drop=old.proj_drop.p,
        device=weight.device,
        dtype=weight.dtype,
        **kwargs,
    )
    for name in CARRIED_MODULES:
        setattr(layer, name, getattr(old, name))
    return layer.train(old.training)


def _check_source(old: nn.Module, index: int) -> None:
    supported = (
        f"convert replaces timm.layers.Attention (dim -> 3*dim qkv, dim -> dim proj, no gate) and visattn layers "
        f"without parameters beyond {'/'.join(CARRIED_MODULES)}"
    )
    if isinstance(old, GridAttention):
        extra = [name for name, _ in old.named_parameters() if name.split(".")[0] not in CARRIED_MODULES]
        if extra:
            raise ValueError(
                f"block {index}: {old.name!r} attention has parameters ({', '.join(extra)}) that cannot carry over; "
                f"{supported}"
            )
        return
    if type(old) is not Attention:
        source = f"{type(old).__module__}.{type(old).__name__}"
        raise ValueError(f"block {index}: attention {source} is not supported; {supported}")
    dim = old.qkv.in_features
    if getattr(old, "gate", None) is not None:
        raise ValueError(f"block {index}: gated attention (gated=True) is not supported; {supported}")
    shapes_match = (
        old.qkv.out_features == 3 * dim
        and old.proj.in_features == dim
        and old.proj.out_features == dim
        and old.num_heads * old.head_dim == dim
    )
    if not shapes_match:
        raise ValueError(
            f"block {index}: attention of shape qkv {dim}->{old.qkv.out_features}, proj "
            f"{old.proj.in_features}->{old.proj.out_features}, {old.num_heads} heads x {old.head_dim} "
            f"cannot carry over; {supported}"
        )


def _check_patch_drop(model: VisionTransformer, layers: list[GridAttention]) -> None:
    drops_patches = isinstance(model.patch_drop, PatchDropout) and model.patch_drop.prob > 0
    gridded = sorted({layer.name for layer in layers if layer.needs_grid or layer.rope is not None})
    if drops_patches and gridded:
        gridless = [name for name in list_attentions() if get_attention(name).needs_grid is False]
        raise ValueError(
            f"patch_drop_rate={model.patch_drop.prob} drops patch tokens, so there is no patch grid for "
            f"{', '.join(gridded)}; use patch_drop_rate=0 or a type that does not need the grid "
            f"(e.g. {', '.join(gridless)}, without rope)"
        )


def _install_grid_hook(model: VisionTransformer, layers: list[GridAttention]) -> None:
    """One PatchGridHook per model: a second convert hands the existing hook the new layers."""
    for hook in model.patch_embed._forward_hooks.values():
        if isinstance(hook, PatchGridHook):
            hook.layers = layers
            hook.num_prefix_tokens = model.num_prefix_tokens
            return
    model.patch_embed.register_forward_hook(PatchGridHook(layers, model.num_prefix_tokens))
