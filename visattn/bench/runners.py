"""What a worker runs: one runner per kind of case and mode, built once in its worker, then stepped.

* :class:`ModelInference`: the model's forward under ``inference_mode``;
* :class:`ModelTraining`: forward, backward and an AdamW step;
* :class:`OpInference`: the token mixing alone (no projections) on random q, k, v created in the case's
  dtype (and run under autocast in bf16/fp16, for the layer's own parameters);
* :class:`OpTraining`: the token mixing and its backward.

A case's ``backends`` (``--backend OP=NAME``) hold for its whole worker: :func:`forced_backends`.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from contextlib import ExitStack
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from visattn.bench.sweep import DTYPES, EXPLICIT_SOFTMAX, Case, build_layer, build_model
from visattn.layers import GridAttention
from visattn.ops.backends import force_backend
from visattn.ops.softmax import naive_softmax_attn


def forced_backends(pairs: Iterable[tuple[str, str]]) -> ExitStack:
    """A context in which each op of ``pairs`` ((op, path) of :data:`visattn.ops.backends.BACKENDS`) runs on its
    path (:func:`~visattn.ops.backends.force_backend`)."""
    with ExitStack() as stack:  # a bad pair undoes the ones before it
        for op, name in pairs:
            stack.enter_context(force_backend(op, name))
        return stack.pop_all()


class Runner(ABC):
    """Builds one case on its device; :meth:`step` runs one step of it, the unit that is timed."""

    def __init__(self, case: Case) -> None:
        self.case = case
        self.device = torch.device(case.device)
        self.param_count = 0

    def autocast(self) -> Any:
        """Mixed precision in bf16/fp16; a no-op in fp32."""
        dtype = DTYPES[self.case.dtype]
        return torch.autocast(device_type=self.device.type, dtype=dtype, enabled=self.case.dtype != "fp32")

    @abstractmethod
    def step(self) -> None:
        """One step."""


class _ModelRunner(Runner):
    """A model case: the model and a batch of random images."""

    def __init__(self, case: Case) -> None:
        super().__init__(case)
        self.model = build_model(case)
        self.param_count = sum(p.numel() for p in self.model.parameters())
        self.images = torch.randn(case.batch_size, 3, *case.size, device=self.device)
        self.forward = torch.compile(self.model) if case.compile else self.model


class ModelInference(_ModelRunner):
    """The forward in eval mode under ``inference_mode``."""

    def __init__(self, case: Case) -> None:
        super().__init__(case)
        self.model.eval()

    def step(self) -> None:
        with torch.inference_mode(), self.autocast():
            self.forward(self.images)


class ModelTraining(_ModelRunner):
    """Forward, cross-entropy backward and an AdamW step; timm's gradient checkpointing if the case asks."""

    def __init__(self, case: Case) -> None:
        super().__init__(case)
        self.model.train()
        self.model.set_grad_checkpointing(case.grad_checkpointing)
        self.target = torch.randint(0, case.num_classes, (case.batch_size,), device=self.device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)

    def step(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        with self.autocast():
            loss = F.cross_entropy(self.forward(self.images), self.target)
        loss.backward()
        self.optimizer.step()


class _OpRunner(Runner):
    """An op case: the layer's ``mix`` (or the explicit-softmax twin) on random q, k, v, no projections."""

    trains: ClassVar[bool]

    def __init__(self, case: Case) -> None:
        super().__init__(case)
        h, d, grid = case.num_heads, case.head_dim, case.size
        dtype = DTYPES[case.dtype]
        self.qkv = [
            torch.randn(case.batch_size, h, grid[0] * grid[1], d, device=self.device, dtype=dtype, requires_grad=self.trains)
            for _ in range(3)
        ]  # (B, heads, N, d) each, in the dtype asked
        self.layer: GridAttention | None = None
        if case.attn == EXPLICIT_SOFTMAX:
            mix: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] = naive_softmax_attn
        else:
            self.layer = layer = build_layer(case)
            layer.set_grid(grid, 0)
            self.param_count = sum(p.numel() for p in layer.parameters())

            def mix(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                return layer.mix(q, k, v, grid=grid, attn_mask=None, is_causal=False)

        self.mix = torch.compile(mix) if case.compile else mix


class OpInference(_OpRunner):
    """The mixing under ``inference_mode``."""

    trains = False

    def step(self) -> None:
        with torch.inference_mode(), self.autocast():
            self.mix(*self.qkv)


class OpTraining(_OpRunner):
    """The mixing and its backward from a fixed random output gradient."""

    trains = True

    def __init__(self, case: Case) -> None:
        super().__init__(case)
        self.cotangent = torch.randn_like(self.qkv[0])

    def step(self) -> None:
        for t in self.qkv:
            t.grad = None
        if self.layer is not None:
            self.layer.zero_grad(set_to_none=True)
        with self.autocast():
            out = self.mix(*self.qkv)
        out.backward(self.cotangent.to(out.dtype))


RUNNERS: dict[tuple[str, str], type[Runner]] = {
    ("model", "infer"): ModelInference,
    ("model", "train"): ModelTraining,
    ("op", "infer"): OpInference,
    ("op", "train"): OpTraining,
}


def build_runner(case: Case) -> Runner:
    """The runner of ``case`` (kind ``model`` or ``op``, mode ``infer`` or ``train``), built."""
    try:
        cls = RUNNERS[case.kind, case.mode]
    except KeyError:
        raise ValueError(
            f"no runner for kind={case.kind!r}, mode={case.mode!r}; valid: {', '.join(map(str, RUNNERS))}"
        ) from None
    return cls(case)
