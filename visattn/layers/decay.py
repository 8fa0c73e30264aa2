"""The learnable per-head decay rates of linear attention's spatial decay (``decay=`` of the linear layer)."""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn

# RMT's initialisation (Fan et al. 2024, the init_values=2 and heads_ranges=4 of its first stages):
# head h of H starts at gamma_h = 1 - 2 ** -(2 + 4 h / H), from 0.75 up towards 1 - 2 ** -6.
RMT_EXPONENTS = (2.0, 4.0)


def check_decay_option(decay: object, op: str) -> tuple[float, float] | bool | None:
    """``decay`` as given to the layer: None or False (off), True (RMT's initialisation), or a pair
    [first, last] of rates in (0, 1) for the first and the last head. Returns None (off), True or the pair."""
    if decay is None or decay is False:
        return None
    if decay is True:
        return True
    if (
        isinstance(decay, Sequence)
        and not isinstance(decay, str)
        and len(decay) == 2
        and all(isinstance(x, (int, float)) and not isinstance(x, bool) and 0 < x < 1 for x in decay)
    ):
        return float(decay[0]), float(decay[1])
    raise ValueError(
        f"{op}: decay must be None (off), True (RMT's initialisation) or [first, last] with rates in (0, 1), got {decay!r}"
    )


def initial_decay_rates(num_heads: int, decay: tuple[float, float] | bool) -> torch.Tensor:
    """(num_heads,) float64 rates. True: RMT's ``1 - 2 ** -(2 + 4 h / H)``; (first, last): from ``first``
    (head 0) to ``last`` (the last head) with ``log(1 - gamma)`` evenly spaced, as RMT spaces them."""
    heads = torch.arange(num_heads, dtype=torch.float64)
    if decay is True:
        start, spread = RMT_EXPONENTS
        return 1 - 2 ** -(start + spread * heads / num_heads)
    first, last = decay
    t = heads / max(num_heads - 1, 1)
    return 1 - (1 - first) ** (1 - t) * (1 - last) ** t


class SpatialDecay(nn.Module):
    """One decay rate per head, ``gamma = sigmoid(logit)``: always in (0, 1), however it is trained.

    Args:
        num_heads: heads of the layer.
        decay: True or (first, last), see :func:`initial_decay_rates`.
    """

    def __init__(
        self,
        num_heads: int,
        decay: tuple[float, float] | bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        init = check_decay_option(decay, "SpatialDecay")
        if init is None:
            raise ValueError(f"SpatialDecay: decay must be True or [first, last] with rates in (0, 1), got {decay!r}")
        self.num_heads = num_heads
        self.init = init
        self.logit = nn.Parameter(torch.empty(num_heads, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The initial rates (timm's weight init calls this)."""
        with torch.no_grad():
            self.logit.copy_(torch.logit(initial_decay_rates(self.num_heads, self.init)))

    def no_weight_decay(self) -> set[str]:
        """Weight decay would pull every logit towards 0, every rate towards 1/2."""
        return {"logit"}

    def forward(self) -> torch.Tensor:
        """The rates (num_heads,)."""
        return torch.sigmoid(self.logit)

    def extra_repr(self) -> str:
        rates = ", ".join(f"{g:.3f}" for g in self().tolist()) if self.logit.device.type != "meta" else "meta"
        return f"num_heads={self.num_heads}, gamma=[{rates}]"
