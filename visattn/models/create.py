"""Any timm ViT with visattn attention, and weights made for another image size or attention loaded into it.

:func:`create_model` builds a registered ``visattn_vit_*`` model, or any timm model whose class is timm's
``VisionTransformer`` (``vit_*``, ``deit_*``, ...) built by timm and passed through :func:`convert`;
``pretrained=True`` loads timm's weights into the stock model before the conversion, so the attention's
``qkv``, ``proj`` and norms keep them. :func:`load_weights` loads a state dict of the same architecture
made at another image size or with another attention type:

- ``pos_embed`` is resampled to the model's patch grid and the patch embedding to its patch size by timm's
  ``checkpoint_filter_fn`` (``resample_abs_pos_embed`` on the patch part, the prefix tokens kept as they are);
- a head of another class count is not loaded: the model keeps its freshly initialised head;
- parameters of an attention type (outside the ``qkv``/``q_norm``/``k_norm``/``norm``/``proj`` that every
  type shares) load where the model has the same name and shape; the model's others keep the
  initialisation of their layer, and the file's others are left out;
- every other weight must match by name and shape.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import timm
import torch
from timm.layers import Mlp
from timm.models.vision_transformer import VisionTransformer, checkpoint_filter_fn

from visattn.layers.patch_embed import check_stem, get_stem
from visattn.models.auto import check_auto_batch_size, select_attention
from visattn.models.convert import CARRIED_MODULES, TIMM_ATTENTION, convert, keep_timm_attention
from visattn.models.shapes import MODEL_SHAPES

HEAD_PREFIX = "head."


def create_model(
    model_name: str,
    attn: str | Sequence[str] = "linear",
    attn_kwargs: dict[str, Any] | None = None,
    pretrained: bool = False,
    auto_batch_size: int | None = None,
    stem: str = "patch",
    **kwargs: Any,
) -> VisionTransformer:
    """``timm.create_model(model_name, **kwargs)`` with ``attn`` in every block.

    Args:
        model_name: a ``visattn_vit_*`` name, or a timm model name whose class is ``VisionTransformer``.
        attn: one name of :func:`visattn.list_attentions`, one per block, ``"auto"``
            (:func:`visattn.models.auto.select_attention` from the name, the image size and ``auto_batch_size``),
            or ``"timm"``: timm's own ``Attention`` kept, the stock model (no ``attn_kwargs``).
        attn_kwargs: type options, as in :func:`convert`.
        pretrained: timm's pretrained weights (loaded into the stock model, then converted).
        auto_batch_size: with ``attn="auto"``, the images per step the model will run at (default 1).
        stem: the patch embedding, ``"patch"`` (timm's) or ``"conv"``
            (:class:`~visattn.layers.patch_embed.ConvPatchEmbed`).
        **kwargs: any keyword of timm's ``VisionTransformer`` (``img_size``, ``patch_size``, ``num_classes``, ...).
    Returns:
        The converted model (for ``"timm"``, the model as timm built it).
    Raises:
        ValueError: an unknown model name, or one whose class is not timm's ``VisionTransformer``;
            ``auto_batch_size`` without ``attn="auto"``; ``attn_kwargs`` with ``"timm"``.
    """
    attn_kwargs = dict(attn_kwargs or {})
    check_auto_batch_size(attn, auto_batch_size)
    check_stem(stem, pretrained, kwargs)
    if model_name in MODEL_SHAPES:
        return timm.create_model(
            model_name, pretrained=pretrained, attn=attn, attn_kwargs=attn_kwargs, auto_batch_size=auto_batch_size,
            stem=stem, **kwargs
        )
    check_vit_name(model_name)
    model = timm.create_model(model_name, pretrained=pretrained, embed_layer=get_stem(stem), **kwargs)
    if attn == TIMM_ATTENTION:
        return keep_timm_attention(model, attn_kwargs)
    names = attn
    if attn == "auto":
        embed = model.patch_embed
        names = select_attention(model_name, tuple(embed.img_size), tuple(embed.patch_size), auto_batch_size or 1)
    return convert(model, names, **attn_kwargs)


def model_shape(model_name: str) -> dict[str, Any]:
    """The shape ``timm.create_model(model_name)`` builds when no keyword changes it: ``patch_size``,
    ``embed_dim``, ``depth``, ``num_heads``, ``mlp_ratio``, ``global_pool``, ``class_token`` (built on the meta
    device: no memory or time goes into weights).

    Raises:
        ValueError: ``model_name`` is not a visattn model nor a timm ``VisionTransformer``, or its patches are not
            square or its MLP is not timm's ``Mlp`` (no single ``patch_size`` or ``mlp_ratio`` describes it).
    """
    with torch.device("meta"):
        model = create_model(model_name, attn=TIMM_ATTENTION)
    patch_h, patch_w = model.patch_embed.patch_size
    if patch_h != patch_w:
        raise ValueError(f"model {model_name!r} has {patch_h}x{patch_w} patches; give --patch-size for square ones")
    mlp = model.blocks[0].mlp
    if not isinstance(mlp, Mlp):
        raise ValueError(f"model {model_name!r} has a {type(mlp).__name__} MLP; give --mlp-ratio for timm's Mlp")
    return dict(
        patch_size=int(patch_h), embed_dim=model.embed_dim, depth=len(model.blocks),
        num_heads=model.blocks[0].attn.num_heads, mlp_ratio=mlp.fc1.out_features / model.embed_dim,
        global_pool=model.global_pool, class_token=model.cls_token is not None,
    )


def check_vit_name(model_name: str) -> None:
    """ValueError unless ``timm.create_model(model_name)`` is a ``VisionTransformer`` (built on the meta
    device, so no memory or time goes into weights)."""
    accepted = (
        f"give a visattn model ({', '.join(MODEL_SHAPES)}) or a timm VisionTransformer "
        "(timm.list_models('vit_*'), 'deit_*', ...)"
    )
    if not timm.is_model(model_name):
        raise ValueError(f"model {model_name!r} is not a timm model; {accepted}")
    with torch.device("meta"):
        probe = timm.create_model(model_name)
    if not isinstance(probe, VisionTransformer):
        raise ValueError(f"model {model_name!r} is a {type(probe).__name__}, which convert cannot change; {accepted}")


@dataclass
class LoadReport:
    """What :func:`load_weights` did beyond copying tensors of equal name and shape."""

    resampled: list[str] = field(default_factory=list)  # keys resampled to the model's grid or patch size
    new_head: bool = False  # the file's head has another shape: the model keeps its own
    kept_init: list[str] = field(default_factory=list)  # the model's attention parameters the file lacks
    left_out: list[str] = field(default_factory=list)  # the file's attention parameters the model lacks

    def lines(self) -> list[str]:
        notes = []
        if self.resampled:
            notes.append(f"resampled to the model's grid: {', '.join(self.resampled)}")
        if self.new_head:
            notes.append("the head has another class count: a new head is trained")
        if self.kept_init:
            notes.append(f"new attention parameters keep their initialisation: {_short(self.kept_init)}")
        if self.left_out:
            notes.append(f"attention parameters of the file not in the model, left out: {_short(self.left_out)}")
        return notes


def load_weights(model: VisionTransformer, state_dict: Mapping[str, torch.Tensor]) -> LoadReport:
    """Load ``state_dict`` (of this architecture, at any image size, with any attention type) into ``model``.

    Args:
        model: a converted (or stock) timm ``VisionTransformer``.
        state_dict: its weights, e.g. of the stock model or of a visattn run at another image size.
    Returns:
        A :class:`LoadReport`.
    Raises:
        ValueError: one line naming the keys missing from the file, the keys the model lacks, and the keys
            whose shapes differ (file vs model), outside what is adapted as the module docstring says.
    """
    target = model.state_dict()
    file_stem, model_stem = _stem_of(state_dict), _stem_of(target)
    if file_stem and model_stem and file_stem != model_stem:
        raise ValueError(
            f"the weights are of a model with stem {file_stem!r}, the model has stem {model_stem!r}; build it with "
            f"stem={file_stem!r} (train.py --stem {file_stem})"
        )
    try:
        source = checkpoint_filter_fn(dict(state_dict), model)
    except (RuntimeError, ValueError):
        # timm's resampling failed (a reshape of pos_embed to a grid the file does not have): the file is of
        # another architecture, described here by its keys and shapes instead of timm's traceback
        adapted = {key for key in (*state_dict, *target) if _is_attention_own(key) or key.startswith(HEAD_PREFIX)}
        problems = _mismatches(
            {key: value for key, value in state_dict.items() if key not in adapted}, target, adapted
        )
        raise ValueError(f"the weights do not fit the model ({'; '.join(problems)})") from None
    report = LoadReport()
    for key in ("pos_embed", "patch_embed.proj.weight"):
        if key in state_dict and key in source and state_dict[key].shape != source[key].shape:
            report.resampled.append(key)

    head_keys = [key for key in source if key.startswith(HEAD_PREFIX)]
    if any(key not in target or source[key].shape != target[key].shape for key in head_keys):
        report.new_head = True
        source = {key: value for key, value in source.items() if not key.startswith(HEAD_PREFIX)}

    own = {key for key in target if _is_attention_own(key)}
    for key in sorted(key for key in source if _is_attention_own(key)):
        if key not in own or source[key].shape != target[key].shape:
            report.left_out.append(key)
            del source[key]
    report.kept_init = sorted(own - set(source))

    not_needed = {key for key in target if _is_attention_own(key) or (report.new_head and key.startswith(HEAD_PREFIX))}
    problems = _mismatches(source, target, not_needed)
    if problems:
        raise ValueError(f"the weights do not fit the model ({'; '.join(problems)})")
    model.load_state_dict(source, strict=False)
    return report


def _stem_of(state_dict: Mapping[str, torch.Tensor]) -> str | None:
    """The stem whose patch embedding ``state_dict`` holds (a name of ``STEMS``), None if it holds none."""
    if "patch_embed.proj.weight" in state_dict:
        return "patch"
    if "patch_embed.proj.0.weight" in state_dict:
        return "conv"
    return None


def _mismatches(source: Mapping[str, torch.Tensor], target: Mapping[str, torch.Tensor], not_needed: set[str]) -> list[str]:
    """What keeps ``source`` from loading into ``target``: keys whose shapes differ (both shapes named), keys
    missing from the file (outside ``not_needed``), keys the model lacks; [] when it loads."""
    missing = sorted(set(target) - set(source) - not_needed)
    unexpected = sorted(set(source) - set(target))
    differ = [
        f"{key} {tuple(source[key].shape)} in the file, {tuple(target[key].shape)} in the model"
        for key in sorted(set(source) & set(target))
        if source[key].shape != target[key].shape
    ]
    problems = []
    if differ:
        problems.append(f"shapes differ: {_short(differ)}")
    if missing:
        problems.append(f"missing from the file: {_short(missing)}")
    if unexpected:
        problems.append(f"not in the model: {_short(unexpected)}")
    return problems


def _is_attention_own(key: str) -> bool:
    """Whether ``key`` is a parameter of an attention type rather than one every type shares:
    ``blocks.<i>.attn.<name>...`` with ``<name>`` not one of CARRIED_MODULES."""
    parts = key.split(".")
    return len(parts) > 3 and parts[0] == "blocks" and parts[2] == "attn" and parts[3] not in CARRIED_MODULES


def _short(items: list[str], limit: int = 4) -> str:
    shown = ", ".join(items[:limit])
    return shown if len(items) <= limit else f"{shown} and {len(items) - limit} more"
