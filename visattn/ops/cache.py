"""Caching of the plans and layouts the ops build from shapes, safe across inference mode and tracing."""
from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache, wraps

import torch


def cache_per_inference_mode(maxsize: int) -> Callable[[Callable], Callable]:
    """``lru_cache`` that also keys on whether ``torch.inference_mode`` is on: tensors made in inference
    mode cannot be saved for backward, so a plan built during an evaluation must not serve a later
    training step (nor the other way round).

    While ``torch.compile`` or ``torch.export`` traces, the plan is built afresh and not cached: its
    tensors are then fake (traced) tensors, which must become operations of the traced graph. A cached
    one would be read back as a constant by a later trace (export refuses a fake constant) and by
    eager calls (which would compute with a fake tensor).
    """

    def wrap(fn: Callable) -> Callable:
        cached = lru_cache(maxsize=maxsize)(lambda inference, *args: fn(*args))

        @wraps(fn)
        def call(*args):
            if torch.compiler.is_compiling():
                return fn(*args)
            return cached(torch.is_inference_mode_enabled(), *args)

        return call

    return wrap
