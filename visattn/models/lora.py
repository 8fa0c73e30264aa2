"""Low-rank adapters (LoRA, Hu et al. 2022) on the attention projections of a timm ViT, for fine-tuning a
converted model with its trained weights frozen (as LoLCATs, Zhang et al. 2025, fine-tunes after attention
transfer).

Each adapted ``nn.Linear`` (a block's attention ``qkv`` and ``proj``) computes with ``W + (alpha / r) B A``:
``A`` (r, in) drawn as ``nn.Linear`` draws its weight, ``B`` (out, r) zero, so that an untrained adapter changes
nothing. The sum is a parametrization of the weight (``torch.nn.utils.parametrize``, torch's own machinery
for this) rather than peft's ``LoraModel``: peft requires transformers (and its tokenizers) for what a weight
parametrization does here, and the adapted model keeps timm's module tree. :func:`merged_state_dict` folds
each adapter into its weight, so that the weights a run saves are a plain model's, loaded as any other.

State-dict keys of an adapted weight: ``<module>.parametrizations.weight.original`` (the frozen weight) and
``<module>.parametrizations.weight.0.{down,up,scale}``.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
from torch.nn.utils import parametrize

# The attention modules whose weights get adapters: the projections every attention type carries.
ADAPTED_MODULES = ("qkv", "proj")
_ORIGINAL = ".parametrizations.weight.original"
_ADAPTER = ".parametrizations.weight.0."


class LowRankDelta(nn.Module):
    """``weight + scale * up @ down``: a weight of shape (out, in) plus a rank-``rank`` update.

    Args:
        out_features, in_features: the weight's shape.
        rank: r, at least 1.
        alpha: the update is scaled by ``alpha / rank``.
    """

    def __init__(self, out_features: int, in_features: int, rank: int, alpha: float,
                 device: torch.device | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.down = nn.Parameter(torch.empty(rank, in_features, device=device, dtype=dtype))  # (r, in)
        self.up = nn.Parameter(torch.zeros(out_features, rank, device=device, dtype=dtype))  # (out, r)
        nn.init.kaiming_uniform_(self.down, a=math.sqrt(5))  # nn.Linear's draw
        self.register_buffer("scale", torch.tensor(alpha / rank, device=device, dtype=dtype))

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight + self.scale * (self.up @ self.down)

    def extra_repr(self) -> str:
        return f"rank={self.down.shape[0]}, scale={float(self.scale):g}"


def add_lora(model: nn.Module, rank: int, alpha: float | None = None) -> int:
    """Adapters of rank ``rank`` on the ``qkv`` and ``proj`` weights of every block's attention (``alpha``:
    the update's scale times ``rank``; None: ``rank``, a scale of 1); returns how many weights were adapted.
    ValueError (one line) for a rank below 1, an alpha not above 0, or a model without such projections."""
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"lora_rank: an integer, at least 1, got {rank!r}")
    alpha = float(rank) if alpha is None else alpha
    if not alpha > 0:
        raise ValueError(f"lora_alpha: above 0, got {alpha!r}")
    targets = [getattr(block.attn, name) for block in getattr(model, "blocks", [])
               for name in ADAPTED_MODULES if isinstance(getattr(block.attn, name, None), nn.Linear)]
    if not targets:
        raise ValueError(f"lora_rank: {type(model).__name__} has no blocks with attention {'/'.join(ADAPTED_MODULES)} "
                         "linear layers to adapt; accepted: a timm VisionTransformer")
    if any(parametrize.is_parametrized(linear, "weight") for linear in targets):
        raise ValueError("lora_rank: the attention projections already have adapters (or another parametrization "
                         "of their weights); accepted: a model without, adapters added once")
    for linear in targets:
        weight = linear.weight
        parametrize.register_parametrization(linear, "weight", LowRankDelta(
            *weight.shape, rank, alpha, device=weight.device, dtype=weight.dtype))
    return len(targets)


def is_adapter(name: str) -> bool:
    """Whether a parameter or state-dict name is an adapter's (``down``, ``up``, ``scale``)."""
    return _ADAPTER in name and name.rsplit(".", 1)[-1] in ("down", "up", "scale")


def freeze_for_lora(model: nn.Module, trained: list[nn.Parameter]) -> None:
    """Every parameter of ``model`` frozen but the adapters' and ``trained`` (the attention's own, the head)."""
    keep = {id(param) for param in trained}
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter(name) or id(param) in keep)


def merged_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state_dict`` with every adapter folded into its weight under the plain name (``<module>.weight``):
    the state dict of the same model without adapters. A state dict without adapters is returned as is."""
    merged = {}
    for key, value in state_dict.items():
        if is_adapter(key):
            continue
        prefix = f"{key[: -len(_ORIGINAL)]}{_ADAPTER}"
        if key.endswith(_ORIGINAL) and f"{prefix}up" in state_dict:
            up, down, scale = (state_dict[prefix + part] for part in ("up", "down", "scale"))
            merged[f"{key[: -len(_ORIGINAL)]}.weight"] = value + scale * (up @ down)
        else:
            merged[key] = value
    return merged


def adapted_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A plain model's ``state_dict`` (a merged one) as the state dict of ``model``, which has adapters: each
    adapted weight as the adapter's frozen weight, its update zero (``up``), so that ``model`` computes what the
    plain weights do; the inverse of :func:`merged_state_dict`. A model without adapters takes it as it is."""
    adapted = {}
    for key, value in model.state_dict().items():
        if key.endswith(_ORIGINAL):
            adapted[key] = state_dict[f"{key[: -len(_ORIGINAL)]}.weight"]
        elif is_adapter(key):
            adapted[key] = torch.zeros_like(value) if key.endswith(".up") else value
        else:
            adapted[key] = state_dict[key]
    return adapted
