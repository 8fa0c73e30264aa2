"""What a training run is built from, each piece from the config: the accelerator, data, model,
optimizer, scheduler, loaders and mixup. Every builder turns a bad combination into a ConfigError
before the run directory is touched."""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import accelerate
import torch
import torch.nn as nn
from accelerate import Accelerator, DataLoaderConfiguration, PartialState
from accelerate.utils import DynamoBackend, ProjectConfiguration, broadcast_object_list, parse_flag_from_env
from timm.data import Mixup
from timm.optim import create_optimizer_v2, param_groups_layer_decay, param_groups_weight_decay
from timm.scheduler import create_scheduler_v2
from timm.scheduler.scheduler import Scheduler
from torch.utils.data import DataLoader, RandomSampler

from visattn.models import create_model
from visattn.models.transfer import trainable_attention_parameters
from visattn.models.lora import add_lora, freeze_for_lora
from visattn.train.config import ConfigError, TrainConfig
from visattn.train.data import (
    DataError, DataSplits, ImageCheck, TransformedDataset, build_transform, check_images, describe_unreadable, load_splits,
    without_images,
)
from visattn.train.generated_tasks.statistics import available_cpus
from visattn.train.progress import preparation_bar


def launched_without_accelerator() -> bool:
    """Several processes on a machine without GPU (or other accelerator).

    ``accelerate launch --multi_gpu`` starts them but leaves each alone (DistributedType.NO) there;
    ``cpu=True`` makes them one gloo process group (MULTI_CPU) instead.
    """
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.accelerator.is_available()


def process_state() -> PartialState:
    """This process's place in the launch, usable before (and without) an Accelerator."""
    return PartialState(cpu=launched_without_accelerator())


def check_sharding() -> None:
    """ConfigError for FSDP (``accelerate launch`` with an FSDP config sets ``ACCELERATE_USE_FSDP``) on a
    machine without GPU or other accelerator: accelerate chooses FSDP only for accelerator processes and
    would run CPU processes as plain data parallel (MULTI_CPU, every process holding the whole model),
    silently, although torch's FSDP itself runs on CPU processes with gloo."""
    if parse_flag_from_env("ACCELERATE_USE_FSDP") and not torch.accelerator.is_available():
        raise ConfigError(
            f"the FSDP config needs a GPU or other accelerator: on CPU processes accelerate {accelerate.__version__} "
            "would train without sharding; launch without it (--multi_gpu for several processes)"
        )


# What ``accelerate launch`` exports to the script: its --dynamo_backend ("NO" when none was chosen).
LAUNCHER_DYNAMO = "ACCELERATE_DYNAMO_BACKEND"


def build_accelerator(config: TrainConfig, run_dir: Path) -> Accelerator:
    """The run's Accelerator. ``config.mixed_precision`` is already the one that applies
    (:func:`visattn.train.cli.choose_mixed_precision`). accelerate never compiles: :func:`compile_model` does,
    for ``--compile`` and for the launcher's ``--dynamo_backend`` alike. Batches reach the device with
    non-blocking copies, from pinned memory on CUDA (:func:`build_loaders`)."""
    check_sharding()
    return Accelerator(
        cpu=launched_without_accelerator(),
        mixed_precision=config.mixed_precision,
        gradient_accumulation_steps=config.grad_accum_steps,
        log_with=config.log_with or None,
        project_config=ProjectConfiguration(project_dir=str(run_dir), logging_dir=str(run_dir / "tensorboard")),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=config.seed, non_blocking=True),
        dynamo_backend=DynamoBackend.NO,
    )


def compile_backend(config: TrainConfig) -> tuple[str | None, str]:
    """(the torch.compile backend, or None for none; the start-up line saying which and who asked): the
    launcher's ``--dynamo_backend``, or inductor for ``--compile`` without one."""
    launcher = os.environ.get(LAUNCHER_DYNAMO, DynamoBackend.NO.value).lower()
    if launcher != "no":
        return launcher, f"torch.compile: {launcher} (accelerate launch --dynamo_backend)"
    if config.compile:
        return "inductor", "torch.compile: inductor (--compile)"
    return None, "torch.compile: off"


def compile_model(prepared: nn.Module, backend: str) -> None:
    """torch.compile ``prepared`` (the model as ``accelerator.prepare`` returned it: DDP's wrapper on several
    processes, so that dynamo splits the graph at its gradient buckets) in place, with ``nn.Module.compile``.

    In place, not accelerate's dynamo plugin nor ``torch.compile(model)``: those wrap the model in an
    ``OptimizedModule``, whose weights accelerate 1.15's ``get_state_dict`` saves as ``_orig_mod.*``, so the
    run's weights would not load into an uncompiled model (visattn.predict, a resume without --compile).
    """
    prepared.compile(backend=backend)


def load_data(accelerator: Accelerator, config: TrainConfig, download: bool) -> tuple[DataSplits, ImageCheck]:
    """The splits of ``config``, every image file in them checked (:func:`check_images`).

    The main process loads (and downloads) and checks first, with a progress bar for what takes long (a generated
    dataset's statistics, the image check); the others then read what it left on disk and take its findings, so
    that every process stops with the same error or leaves out the same files.
    Unreadable files stop the run with one line naming them, or with ``skip_bad_images`` are left out.
    """
    splits, error, check = None, None, ImageCheck()
    if accelerator.is_main_process:
        try:
            splits = load_splits(config, download, progress=True)
            check = check_images(config, splits, progress=True)
        except DataError as caught:
            error = caught
    accelerator.wait_for_everyone()
    error, check = broadcast_object_list([error, check])
    if error is not None:
        raise error
    if splits is None:
        splits = load_splits(config, download=False)
    if check.unreadable:
        if not config.skip_bad_images:
            raise DataError(
                f"{describe_unreadable(check.unreadable)}. Fix or remove them, or pass --skip-bad-images to train "
                "without them"
            )
        splits = without_images(splits, check.unreadable)
    return splits, check


def build_model(config: TrainConfig, num_classes: int) -> nn.Module:
    """The model with freshly initialised weights (a timm ViT name is built by timm and converted);
    :func:`visattn.train.initial.load_initial_weights` then loads the run's first weights, if any."""
    try:
        model = create_model(config.model, **config.model_kwargs_for_timm(num_classes))
    except (ValueError, TypeError) as error:
        raise ConfigError(f"model {config.model!r} cannot be built from this config: {error}") from None
    model.set_grad_checkpointing(config.grad_checkpointing)
    return model


def add_adapters(config: TrainConfig, model: nn.Module) -> list[str]:
    """With ``lora_rank``: low-rank adapters on the attention projections of ``model`` (its trained weights loaded),
    every weight frozen but the adapters, the attention's own parameters and the head; a line saying so. None
    without."""
    if not config.lora_rank:
        return []
    try:
        adapted = add_lora(model, config.lora_rank, config.lora_alpha)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    own = [param for block in trainable_attention_parameters(model) for param in block]
    freeze_for_lora(model, [*own, *model.get_classifier().parameters()])
    trained = sum(param.numel() for param in model.parameters() if param.requires_grad)
    total = sum(param.numel() for param in model.parameters())
    return [f"low-rank adapters: rank {config.lora_rank} on {adapted} attention projections (qkv, proj); trained: "
            f"{trained:,} of {total:,} parameters (the adapters, the attention's own, the head)"]


def no_weight_decay_names(model: nn.Module) -> set[str]:
    """Parameter names kept out of weight decay: the model's own ``no_weight_decay()`` (timm's ViT: position
    embedding, class and register tokens) and those of any submodule that declares some (a layer's learned
    rotary frequencies), prefixed with the submodule's name."""
    names = set(model.no_weight_decay()) if hasattr(model, "no_weight_decay") else set()
    for prefix, module in model.named_modules():
        if module is not model and hasattr(module, "no_weight_decay"):
            names |= {f"{prefix}.{name}" for name in module.no_weight_decay()}
    return names


def build_optimizer(config: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    """timm's optimizer, its parameter groups as timm forms them (with ``layer_decay`` in ``opt_kwargs``,
    per layer) but with every name of :func:`no_weight_decay_names` kept out of weight decay."""
    kwargs = dict(config.opt_kwargs)
    layer_decay = {key: kwargs.pop(key) for key in ("layer_decay", "layer_decay_min_scale", "layer_decay_no_opt_scale") if key in kwargs}
    if layer_decay.get("layer_decay") is None and len(layer_decay) > ("layer_decay" in layer_decay):
        extra = sorted(key for key in layer_decay if key != "layer_decay")
        raise ConfigError(f"opt_kwargs: {', '.join(extra)} without layer_decay has no effect; give layer_decay too, or drop it")

    def param_groups(module: nn.Module) -> list[dict]:
        names = no_weight_decay_names(module)
        if layer_decay.get("layer_decay") is None:
            return param_groups_weight_decay(module, config.weight_decay, no_weight_decay_list=names)
        return param_groups_layer_decay(
            module, config.weight_decay, no_weight_decay_list=names, layer_decay=layer_decay["layer_decay"],
            min_scale=layer_decay.get("layer_decay_min_scale", 0.0), no_opt_scale=layer_decay.get("layer_decay_no_opt_scale"),
        )

    try:
        return create_optimizer_v2(
            model, opt=config.opt, lr=config.lr, weight_decay=config.weight_decay, param_group_fn=param_groups, **kwargs
        )
    except TypeError as error:
        raise ConfigError(f"opt_kwargs: {error}") from None


def build_scheduler(config: TrainConfig, optimizer: torch.optim.Optimizer, batches_per_epoch: int) -> Scheduler:
    """timm's scheduler, stepped per optimizer update; stateless but for the update count (which the
    trainer state carries), so it needs no checkpoint file."""
    scheduler, _ = create_scheduler_v2(
        optimizer, sched=config.sched, num_epochs=config.epochs, warmup_epochs=config.warmup_epochs,
        warmup_lr=config.warmup_lr, min_lr=config.min_lr, step_on_epochs=False,
        updates_per_epoch=math.ceil(batches_per_epoch / config.grad_accum_steps),
    )
    return scheduler


def build_loaders(
    config: TrainConfig, splits: DataSplits, num_processes: int
) -> tuple[DataLoader, DataLoader | None, DataLoader]:
    """(train, validation, test) loaders; validation is None where the dataset has no validation split."""
    global_batch = config.batch_size * num_processes
    if len(splits.train) < global_batch:
        raise ConfigError(
            f"batch_size: {config.batch_size} x {num_processes} process(es) is more than the {len(splits.train)} "
            "training images; no full batch to train on"
        )
    train_set = TransformedDataset(splits.train, build_transform(config, splits, training=True), seed=config.seed)
    eval_transform = build_transform(config, splits, training=False)
    # Own generators, so that creating a loader iterator never draws from the process RNG. Workers live as
    # long as the loader: an epoch does not wait for them to start (the dataset's epoch is shared with them).
    workers = loader_workers(config.num_workers)
    common = dict(batch_size=config.batch_size, num_workers=workers, persistent_workers=workers > 0,
                  pin_memory=torch.cuda.is_available())
    train_loader = DataLoader(
        train_set, shuffle=True, drop_last=True, generator=torch.Generator().manual_seed(config.seed), **common
    )
    val_loader, eval_loader = (
        None if split is None else DataLoader(
            TransformedDataset(split, eval_transform, seed=None), shuffle=False,
            generator=torch.Generator().manual_seed(config.seed), **common,
        )
        for split in (splits.val, splits.eval)
    )
    return train_loader, val_loader, eval_loader


def loader_workers(asked: int) -> int:
    """``num_workers`` capped at this machine's cores: more workers than cores only wait on each other
    (and make torch warn on every loader)."""
    return min(asked, available_cpus())


def worker_notice(asked: int) -> list[str]:
    """One line when :func:`loader_workers` caps the recipe's ``num_workers``, else none."""
    workers = loader_workers(asked)
    if workers == asked:
        return []
    return [f"notice: num_workers {asked} capped at {workers}, the CPU cores this process can use"]


@dataclass(frozen=True)
class LoaderSpeed:
    """What :func:`measure_loader` timed: ``images`` in ``batches`` batches over ``seconds``."""

    images: int
    batches: int
    seconds: float

    @property
    def images_per_s(self) -> float:
        return self.images / self.seconds if self.seconds > 0 else float("nan")


def measure_loader(loader: DataLoader, batches: int, device: torch.device, progress: bool = False) -> LoaderSpeed:
    """How fast the input pipeline alone delivers: ``batches`` batches of ``loader``'s dataset, drawn in a
    shuffled order by a loader of the same batch size, workers and pinning, each copied to ``device`` as
    training copies it (non-blocking), with no model. The first batch, which waits for the workers to start,
    is not timed; fewer batches are timed when the split has fewer. A progress bar counts the batches if
    ``progress``."""
    probe = DataLoader(
        loader.dataset, batch_size=loader.batch_size, num_workers=loader.num_workers, pin_memory=loader.pin_memory,
        sampler=RandomSampler(loader.dataset, generator=torch.Generator().manual_seed(0)), drop_last=True,
    )
    images = timed = 0
    bar = preparation_bar(min(batches, len(probe) - 1), "loader alone", "batch", shown=progress)
    batch_iter = iter(probe)
    next(batch_iter)
    started = time.perf_counter()
    for images_batch, targets in batch_iter:
        images_batch.to(device, non_blocking=True)
        targets.to(device, non_blocking=True)
        images += len(images_batch)
        timed += 1
        bar.update()
        if timed == batches:
            break
    bar.close()
    if device.type != "cpu":
        torch.accelerator.synchronize(device)  # the last copies have landed
    return LoaderSpeed(images=images, batches=timed, seconds=time.perf_counter() - started)


def build_mixup(config: TrainConfig, num_classes: int) -> Mixup | None:
    if config.mixup == 0 and config.cutmix == 0:
        return None
    return Mixup(
        mixup_alpha=config.mixup, cutmix_alpha=config.cutmix, prob=config.mixup_prob,
        switch_prob=config.mixup_switch_prob, label_smoothing=config.label_smoothing, num_classes=num_classes,
    )


def build_criterion(config: TrainConfig, mixup: Mixup | None) -> nn.Module:
    """Cross-entropy; with mixup the smoothing is already in the mixed targets."""
    return nn.CrossEntropyLoss(label_smoothing=0.0 if mixup else config.label_smoothing)


def default_cpu_threads() -> None:
    """One CPU thread per process unless ``OMP_NUM_THREADS`` sets the number, as under ``accelerate launch``
    (which sets it to 1). torch's own default, a thread per physical core, makes every parallel region
    wait for all its threads: on cores that other processes share, a step then takes many times longer."""
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
