"""Attention transfer: teach the converted attention layers of a trained softmax ViT to reproduce their parent.

:func:`convert` keeps every weight of a trained timm ViT (qkv, proj), but a softmax-trained model whose
attention is swapped for another type starts near chance. LoLCATs (Zhang et al. ICLR 2025) first trains each
new attention layer to reproduce its parent layer's output, everything else frozen, and only then fine-tunes
the whole model briefly; Hedgehog (Zhang et al. ICLR 2024) gives linear attention a learnable feature map
to make that possible (``feature_map="learned"`` of the linear layer).

How a layer is trained: forward hooks on the parent's attention modules capture, for every block, the
tokens that enter the attention (after the block's first norm) and what the attention returns; the
converted layer of the same block gets the same tokens, and its loss is the mean squared error between
the two outputs. The parent runs without gradients. Only the parameters the new type adds (a learned
feature map, a depthwise convolution, decay rates, ...) are trained; the carried ``qkv``, ``proj`` and
norms stay as the parent trained them unless ``train_projections`` says otherwise (LoLCATs keeps them for
this stage and adapts them in the fine-tune). A type that adds nothing has nothing to learn and is refused
in one line.

Because every converted layer sees its parent's input, not the output of the converted layers before it,
the layers' losses are independent: ``mode="joint"`` trains all of them at once (one parent forward serves
every layer), ``mode="layerwise"`` trains one layer at a time, each over its own consecutive, equal share
of the steps (one layer's activations kept for the backward, the memory of a large model, at the cost of
fewer steps per layer).
"""
from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.models.vision_transformer import VisionTransformer

from visattn.layers import GridAttention
from visattn.models.convert import CARRIED_MODULES, convert
from visattn.models.lora import is_adapter

TRANSFER_MODES = ("joint", "layerwise")


@dataclass
class TransferResult:
    """What :func:`transfer_attention` returns: the converted ``model`` and ``losses[epoch][block]``, the mean
    training MSE of each block's attention output over the epoch (NaN for a block not trained in it)."""

    model: VisionTransformer
    losses: list[list[float]]


def trainable_attention_parameters(student: VisionTransformer, train_projections: bool = False) -> list[list[nn.Parameter]]:
    """Per block of ``student``, the parameters attention transfer trains: those its attention layer adds
    to the carried modules (``qkv``, ``q_norm``, ``k_norm``, ``norm``, ``proj``) and the low-rank adapters on
    those (:mod:`visattn.models.lora`), and the carried modules' own too with ``train_projections``."""
    return [
        [param for name, param in block.attn.named_parameters()
         if train_projections or name.split(".")[0] not in CARRIED_MODULES or is_adapter(name)]
        for block in student.blocks
    ]


def check_something_to_learn(student: VisionTransformer, train_projections: bool = False) -> None:
    """ValueError (one line) when no attention layer of ``student`` has a parameter for transfer to train."""
    if any(trainable_attention_parameters(student, train_projections)):
        return
    names = ", ".join(dict.fromkeys(repr(getattr(block.attn, "name", type(block.attn).__name__)) for block in student.blocks))
    raise ValueError(
        f"attention transfer: {names} add(s) no parameters to the parent's {'/'.join(CARRIED_MODULES)}, which transfer "
        "keeps, so there is nothing to learn; use options that add some (linear: feature_map='learned') or "
        "train_projections=True"
    )


class AttentionTransfer:
    """The per-block losses of ``student``'s attention layers against ``parent``'s, for a training loop to minimise.

    Args:
        parent: the trained model (a timm ``VisionTransformer``, softmax attention); put in eval mode, never
            changed.
        student: the same architecture with converted attention layers (:func:`convert` of a copy of
            ``parent``, or a model loaded with the same weights); its attention layers are the ones trained.
        mode: ``"joint"`` or ``"layerwise"`` (which blocks :meth:`blocks_at` a step trains).
        train_projections: also train the carried ``qkv``, ``proj`` and norms of the attention layers.
    Raises:
        ValueError: models of different depth or width, an unknown mode, or nothing to learn.
    """

    def __init__(
        self, parent: VisionTransformer, student: VisionTransformer, mode: str = "joint", train_projections: bool = False
    ) -> None:
        if mode not in TRANSFER_MODES:
            raise ValueError(f"attention transfer: mode must be one of {', '.join(TRANSFER_MODES)}, got {mode!r}")
        _check_pair(parent, student)
        check_something_to_learn(student, train_projections)
        self.parent = parent.eval()
        self.student = student
        self.mode = mode
        self.block_parameters = trainable_attention_parameters(student, train_projections)
        trained = {id(param) for params in self.block_parameters for param in params}
        # the attention parameters the transfer keeps: no gradient is recorded for them in its forwards
        self.kept = [param for block in student.blocks for param in block.attn.parameters() if id(param) not in trained]
        self.trained_blocks = [index for index, params in enumerate(self.block_parameters) if params]
        self._block_index: dict[tuple[tuple[int, ...], torch.device], torch.Tensor] = {}

    @property
    def depth(self) -> int:
        return len(self.block_parameters)

    def parameters(self) -> list[nn.Parameter]:
        """Every parameter the transfer trains, for its optimizer."""
        return [param for params in self.block_parameters for param in params]

    def blocks_at(self, step: int, total_steps: int) -> list[int]:
        """The blocks step ``step`` (0-based) of ``total_steps`` trains: every block with parameters to train
        (``"joint"``), or one of them, in order, each for an equal share of the steps (``"layerwise"``)."""
        if self.mode == "joint":
            return list(self.trained_blocks)
        share = min(step * len(self.trained_blocks) // max(total_steps, 1), len(self.trained_blocks) - 1)
        return [self.trained_blocks[share]]

    def add_losses(self, sums: torch.Tensor, counts: torch.Tensor, blocks: Sequence[int], losses: torch.Tensor) -> None:
        """Adds ``losses`` (len(blocks),) to the per-block ``sums`` and one to ``counts`` (both (depth,), on the
        losses' device) through an index kept on that device: no copy from the host in a training step."""
        key = (tuple(blocks), losses.device)
        if key not in self._block_index:
            self._block_index[key] = torch.tensor(blocks, device=losses.device)
        index = self._block_index[key]
        sums.index_add_(0, index, losses.detach().to(sums.dtype))
        counts.index_add_(0, index, torch.ones_like(index, dtype=counts.dtype))

    def losses(self, images: torch.Tensor, blocks: Sequence[int] | None = None) -> torch.Tensor:
        """The MSE of each block of ``blocks`` (default: every block with something to train) between the
        student's attention output and the parent's, on the parent's attention input for ``images``.

        images: (B, C, H, W) -> (len(blocks),) fp32, differentiable in the trained parameters.
        """
        blocks = list(self.trained_blocks if blocks is None else blocks)
        grid = self.student.patch_embed.dynamic_feat_size((images.shape[-2], images.shape[-1]))
        with torch.no_grad(), _captured_attention(self.parent, blocks) as captured:
            self.parent(images)
        losses = []
        with _without_grad(self.kept):
            for index in blocks:
                tokens, target = captured[index]  # (B, N, C) each
                layer = self.student.blocks[index].attn
                if isinstance(layer, GridAttention):
                    layer.set_grid(grid, self.student.num_prefix_tokens)
                losses.append(F.mse_loss(layer(tokens).float(), target.float()))
        return torch.stack(losses)

    @torch.no_grad()
    def mean_losses(self, batches: Iterable[Any]) -> list[float]:
        """The mean MSE of every block over ``batches`` (images, or (images, targets) pairs), the student's
        attention layers in eval mode; NaN for a block with nothing to train."""
        layers = [block.attn for block in self.student.blocks]
        modes = [layer.training for layer in layers]
        for layer in layers:
            layer.eval()
        sums = torch.zeros(len(self.trained_blocks), dtype=torch.float64)
        count = 0
        try:
            for batch in batches:
                images = batch[0] if isinstance(batch, (tuple, list)) else batch
                sums += self.losses(images).double().cpu() * len(images)
                count += len(images)
        finally:
            for layer, mode in zip(layers, modes):
                layer.train(mode)
        means = [float("nan")] * self.depth
        for index, total in zip(self.trained_blocks, sums.tolist()):
            means[index] = total / max(count, 1)
        return means


def transfer_attention(
    parent: VisionTransformer,
    attn: str | Sequence[str] = "linear",
    loader: Iterable[Any] = (),
    epochs: int = 1,
    mode: str = "joint",
    lr: float = 1e-3,
    weight_decay: float = 0.0,
    train_projections: bool = False,
    **attn_kwargs: Any,
) -> TransferResult:
    """A copy of ``parent`` converted to ``attn`` whose attention layers were trained to reproduce ``parent``'s.

    Args:
        parent: a trained timm ``VisionTransformer`` (left as it is, but put in eval mode).
        attn, **attn_kwargs: the target type(s) and their options, as in :func:`convert` (e.g. ``"linear"``
            with ``feature_map="learned"``).
        loader: batches of images (B, C, H, W), or (images, targets) pairs, on the parent's device or the CPU;
            iterated once per epoch.
        epochs: passes over ``loader``.
        mode: ``"joint"`` or ``"layerwise"`` (:class:`AttentionTransfer`).
        lr, weight_decay: of the AdamW optimizer over the trained parameters (no decay by default: it would
            pull a learned feature map away from the identity it starts from).
        train_projections: also train the attention layers' ``qkv``, ``proj`` and norms.
    Returns:
        A :class:`TransferResult` with the converted model (in train mode) and the per-block losses.
    Raises:
        ValueError: an unknown mode, epochs < 1, an empty loader, or a type with nothing to learn.
    """
    if epochs < 1:
        raise ValueError(f"transfer_attention: epochs must be >= 1, got {epochs}")
    student = convert(copy.deepcopy(parent), attn, **attn_kwargs).train()
    transfer = AttentionTransfer(parent, student, mode=mode, train_projections=train_projections)
    optimizer = torch.optim.AdamW(transfer.parameters(), lr=lr, weight_decay=weight_decay)
    device = next(parent.parameters()).device
    batches = list(loader) if not hasattr(loader, "__len__") else loader
    total_steps = epochs * len(batches)
    if total_steps == 0:
        raise ValueError("transfer_attention: the loader yields no batches")
    history, step = [], 0
    for _ in range(epochs):
        sums = torch.zeros(transfer.depth, dtype=torch.float64, device=device)
        counts = torch.zeros(transfer.depth, dtype=torch.int64, device=device)
        for batch in batches:
            images = (batch[0] if isinstance(batch, (tuple, list)) else batch).to(device)
            blocks = transfer.blocks_at(step, total_steps)
            losses = transfer.losses(images, blocks)
            optimizer.zero_grad(set_to_none=True)
            losses.sum().backward()
            optimizer.step()
            transfer.add_losses(sums, counts, blocks, losses)
            step += 1
        history.append([total / count if count else float("nan") for total, count in zip(sums.tolist(), counts.tolist())])
    return TransferResult(model=student, losses=history)


def _check_pair(parent: nn.Module, student: nn.Module) -> None:
    for which, model in (("parent", parent), ("student", student)):
        if not isinstance(model, VisionTransformer):
            raise ValueError(f"attention transfer: the {which} must be a timm VisionTransformer, got {type(model).__name__}")
    if len(parent.blocks) != len(student.blocks) or parent.embed_dim != student.embed_dim:
        raise ValueError(
            f"attention transfer: the parent (depth {len(parent.blocks)}, width {parent.embed_dim}) and the student "
            f"(depth {len(student.blocks)}, width {student.embed_dim}) must have the same architecture"
        )


@contextmanager
def _captured_attention(model: VisionTransformer, blocks: Sequence[int]) -> Iterator[dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """block index -> (the attention's input tokens, its output), each (B, N, C), filled by ``model``'s next forward."""
    captured: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def capture(index: int):
        def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
            captured[index] = (args[0], output)
        return hook

    handles = [model.blocks[index].attn.register_forward_hook(capture(index)) for index in blocks]
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def _without_grad(params: list[nn.Parameter]) -> Iterator[None]:
    """Forwards inside record no gradient for ``params`` (autograd decides at the forward, so the backward
    after the block leaves them without one too)."""
    flags = [param.requires_grad for param in params]
    for param in params:
        param.requires_grad_(False)
    try:
        yield
    finally:
        for param, flag in zip(params, flags):
            param.requires_grad_(flag)
