"""The training configuration: one typed dataclass, filled from defaults, a YAML recipe and flags.

Precedence, lowest first: the dataclass defaults (the embedded-dataset recipe), ``--config FILE``,
then command-line flags (:mod:`visattn.train.cli`). A key the dataclass does not have, or a value of
the wrong type, is a :class:`ConfigError` naming the key, wherever it comes from; :func:`check_values`
then checks ranges and the keys that must agree with each other. Recipes are YAML with YAML 1.2
scalars (``lr: 1e-3`` is a float, ``mixed_precision: no`` a string).
"""
from __future__ import annotations

import dataclasses
import difflib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import timm
import yaml
from accelerate.tracking import get_available_trackers
from timm.optim import list_optimizers

from visattn.layers import list_attentions
from visattn.layers.options import load_yaml
from visattn.layers.patch_embed import STEMS
from visattn.models import TIMM_ATTENTION, model_shape
from visattn.models.transfer import TRANSFER_MODES
from visattn.train.augment import check_auto_augment
from visattn.train.datasets import DATASET_SPECS
from visattn.train.fieldtypes import matches, type_name
from visattn.train.generated_tasks import TASKS, task_options

DATASETS = tuple(DATASET_SPECS)
MIXED_PRECISION = ("no", "fp16", "bf16", "fp8")
SCHEDULERS = ("cosine", "tanh", "step", "multistep", "poly", "wsd", "rsqrt", "constant")
GLOBAL_POOLS = ("avg", "token", "max", "avgmax", "map")


# The most patch tokens a patch size chosen for the user makes: a 64 x 64 grid (512 px images, patch 8).
MAX_DEFAULT_TOKENS = 4096


class ConfigError(ValueError):
    """A configuration the training script cannot run; the message names the key and what it accepts."""


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass
class TrainConfig:
    """One training run. The defaults are the embedded-dataset recipe (``configs/digits.yaml``)."""

    # data
    dataset: str = field(default="digits", metadata=_help(f"one of {', '.join(DATASETS)}"))
    data_dir: str | None = field(
        default=None,
        metadata=_help(
            "root of a downloadable dataset (none: ./data) or ImageFolder root (with train/ and val/ or test/, "
            "or one folder per class)"
        ),
    )
    img_size: int | list[int] | None = field(
        default=None, metadata=_help("image side, or H,W; images are resized to it (none: the dataset's default size)")
    )
    dataset_kwargs: dict[str, Any] = field(
        default_factory=dict,
        metadata=_help("options of a generated dataset, key=value (pathfinder: level=easy; both: seed=0 train_size=10000)"),
    )
    eval_fraction: float = field(
        default=0.2,
        metadata=_help("held-out test share for datasets without a test split (digits, EuroSAT, a one-folder ImageFolder)"),
    )
    max_train_samples: int | None = field(default=None, metadata=_help("train on a fixed random subset of this size"))
    max_eval_samples: int | None = field(default=None, metadata=_help("evaluate on a fixed random subset of this size"))
    num_workers: int = field(
        default=0,
        metadata=_help("DataLoader worker processes (and threads of the image check before training), kept alive "
                       "between epochs; at most this machine's CPU cores (a larger number is capped, with a notice)"),
    )
    skip_bad_images: bool = field(
        default=False,
        metadata=_help("leave out image files that cannot be read (counted, named at the start and end and in "
                       "summary.json) instead of stopping"),
    )
    # model
    model: str = field(
        default="visattn_vit_tiny_patch16",
        metadata=_help("visattn_vit_* or any timm VisionTransformer name (vit_*, deit_*), converted to --attn; another "
                       "model than the recipe's brings its own shape (patch size, width, depth, heads, MLP ratio, "
                       "pooling, class token) where flags give none"),
    )
    attn: str | list[str] = field(
        default="softmax", metadata=_help("attention type, or one per block comma-separated")
    )
    attn_kwargs: dict[str, Any] = field(
        default_factory=dict,
        metadata=_help("attention options: key=value for every type in use that takes it, or type={key: value} for one "
                       "type; options no type in use takes are dropped with a notice"),
    )
    patch_size: int | None = field(
        default=None,
        metadata=_help(f"patch side; the grid is img_size / patch_size (none: the smallest side from 2 up that divides "
                       f"the image and keeps the grid at {MAX_DEFAULT_TOKENS:,} tokens or fewer: 2 for the digits)"),
    )
    stem: str = field(
        default="patch",
        metadata=_help("patch embedding: patch (timm's, one linear projection per patch) or conv (stride-2 3x3 "
                       "convolutions with batch norm and ReLU, then 1x1, the same patch size; for training from "
                       "scratch)"),
    )
    embed_dim: int = field(default=64, metadata=_help("token width"))
    depth: int = field(default=4, metadata=_help("number of blocks"))
    num_heads: int = field(default=2, metadata=_help("attention heads"))
    mlp_ratio: float = field(default=2.0, metadata=_help("MLP hidden width / embed_dim"))
    global_pool: str = field(default="avg", metadata=_help("how the head reads the tokens: avg, token (class token), max, map"))
    class_token: bool = field(default=False, metadata=_help("prepend a class token"))
    drop_path_rate: float = field(default=0.0, metadata=_help("stochastic depth rate"))
    model_kwargs: dict[str, Any] = field(
        default_factory=dict,
        metadata=_help("any other timm VisionTransformer keyword, key=value (reg_tokens=4 qk_norm=true); replaces the mapping"),
    )
    pretrained: bool = field(
        default=False,
        metadata=_help("start from timm's pretrained weights of --model (Hugging Face cache, or the hub when reachable)"),
    )
    initial_checkpoint: str | None = field(
        default=None,
        metadata=_help("start from these weights: a .safetensors or .pth state dict, or a visattn run directory (its best weights)"),
    )
    transfer_epochs: int = field(
        default=0,
        metadata=_help("attention transfer epochs before the fine-tune epochs: each converted attention layer learns to "
                       "reproduce the softmax attention of the initial_checkpoint (or pretrained) weights on the "
                       "training images (MSE of its output on its parent's input), everything else frozen (LoLCATs); "
                       "per-block losses in transfer_metrics.jsonl; 0: off"),
    )
    transfer_lr: float = field(default=1e-3, metadata=_help("AdamW learning rate of attention transfer (constant, no weight decay)"))
    transfer_mode: str = field(
        default="joint",
        metadata=_help(f"{' or '.join(TRANSFER_MODES)}: every layer in every transfer step, or one layer at a time, each "
                       "for an equal share of the steps (less memory, fewer steps per layer)"),
    )
    transfer_projections: bool = field(
        default=False,
        metadata=_help("attention transfer trains the attention's qkv, proj and norms too, not only the parameters the "
                       "type adds (feature_map=learned, dwconv_kernel, decay)"),
    )
    lora_rank: int = field(
        default=0,
        metadata=_help("low-rank adapters of this rank on every attention qkv and proj, the model's trained weights "
                       "frozen but the attention's own parameters and the head (and attention transfer trains the "
                       "adapters); the saved weights have them merged in; 0: off (train every weight)"),
    )
    lora_alpha: float | None = field(
        default=None,
        metadata=_help("the adapters' update is scaled by lora_alpha / lora_rank; none: lora_rank (a scale of 1)"),
    )
    # optimisation
    epochs: int = field(default=26, metadata=_help("training epochs"))
    batch_size: int = field(default=32, metadata=_help("images per process per step"))
    grad_accum_steps: int = field(default=1, metadata=_help("steps whose gradients add up to one optimizer update"))
    opt: str = field(default="adamw", metadata=_help("timm optimizer name (timm.optim.list_optimizers())"))
    lr: float = field(default=2e-3, metadata=_help("peak learning rate"))
    weight_decay: float = field(default=0.05, metadata=_help("decoupled weight decay (not on biases and norms)"))
    opt_kwargs: dict[str, Any] = field(default_factory=dict, metadata=_help("extra optimizer keywords, key=value"))
    sched: str = field(default="cosine", metadata=_help(f"timm scheduler: {', '.join(SCHEDULERS)}"))
    warmup_epochs: int = field(default=1, metadata=_help("linear warm-up epochs"))
    warmup_lr: float = field(default=1e-5, metadata=_help("learning rate at the start of warm-up"))
    min_lr: float = field(default=1e-5, metadata=_help("learning rate at the end of the schedule"))
    clip_grad: float | None = field(default=1.0, metadata=_help("clip the gradient norm to this; none to turn off"))
    label_smoothing: float = field(default=0.1, metadata=_help("label smoothing"))
    # augmentation (timm.data.create_transform and timm.data.Mixup)
    augment: bool = field(default=True, metadata=_help("random augmentation of training images"))
    auto_augment: str | None = field(
        default=None, metadata=_help("timm RandAugment/AutoAugment policy, e.g. rand-m9-mstd0.5-inc1; none: off")
    )
    crop_scale: list[float] = field(default_factory=lambda: [0.7, 1.0], metadata=_help("random-resized-crop area range"))
    crop_ratio: list[float] = field(default_factory=lambda: [0.8, 1.25], metadata=_help("random-resized-crop aspect range"))
    hflip: float = field(default=0.0, metadata=_help("horizontal flip probability"))
    color_jitter: float = field(default=0.0, metadata=_help("colour jitter strength (off while auto_augment is set)"))
    re_prob: float = field(default=0.0, metadata=_help("random erasing probability"))
    mixup: float = field(default=0.0, metadata=_help("mixup alpha (0: off)"))
    cutmix: float = field(default=0.0, metadata=_help("cutmix alpha (0: off)"))
    mixup_prob: float = field(default=1.0, metadata=_help("probability of mixing a batch"))
    mixup_switch_prob: float = field(default=0.5, metadata=_help("probability of cutmix instead of mixup when both are on"))
    # run
    seed: int = field(default=0, metadata=_help("seed of the weights, the data order and the augmentation"))
    mixed_precision: str = field(
        default="no",
        metadata=_help(f"accelerate mixed precision: {', '.join(MIXED_PRECISION)}; given on the command line it wins "
                       "over accelerate launch --mixed_precision, which wins over a recipe's (its 'no', also the "
                       "launcher's default, leaves the recipe's); config.yaml records the one that ran"),
    )
    compile: bool = field(
        default=False,
        metadata=_help("torch.compile the model in place (inductor; accelerate launch --dynamo_backend takes the same "
                       "path with its backend); the first steps, and those at a new image size, compile"),
    )
    grad_checkpointing: bool = field(
        default=False,
        metadata=_help("recompute each block's activations in backward instead of storing them (timm's "
                       "set_grad_checkpointing): less memory for about one more forward per step; same loss and gradients"),
    )
    test_every_epoch: bool = field(
        default=False,
        metadata=_help("also evaluate the test split after every epoch (test_acc in metrics.jsonl) and, in a run from "
                       "initial weights, before any update and after attention transfer (initial_test_acc, "
                       "transfer_test_acc in summary.json): learning curves on test, for tables; the reported weights "
                       "are still chosen on validation"),
    )
    run_dir: str | None = field(default=None, metadata=_help("where the run is written (none: runs/<dataset>-<attn>)"))
    save_every: int = field(
        default=0, metadata=_help("also checkpoint every this many optimizer updates (0: at epoch ends only)")
    )
    keep_checkpoints: int = field(default=2, metadata=_help("how many of the latest checkpoints to keep"))
    skip_nonfinite: bool = field(
        default=False,
        metadata=_help("skip an update whose loss or gradient is not finite (counted, printed at the end) instead of stopping"),
    )
    log_with: list[str] = field(default_factory=list, metadata=_help("accelerate trackers, e.g. tensorboard"))

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, _checked(f.name, getattr(self, f.name), FIELD_TYPES[f.name]))
        if self.img_size is None and self.dataset in DATASET_SPECS:
            self.img_size = DATASET_SPECS[self.dataset].default_img_size
        if self.patch_size is None and self.img_size is not None:
            self.patch_size = default_patch_size(self.image_hw)
        check_values(self)

    # -- derived values -------------------------------------------------------------------------
    @property
    def image_hw(self) -> tuple[int, int]:
        size = self.img_size
        return (size, size) if isinstance(size, int) else (size[0], size[1])

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def model_kwargs_for_timm(self, num_classes: int) -> dict[str, Any]:
        """Keyword arguments of ``timm.create_model(self.model, **...)`` for this configuration."""
        return {
            "attn": self.attn,
            "attn_kwargs": dict(self.attn_kwargs),
            "img_size": self.image_hw,
            "patch_size": self.patch_size,
            "num_classes": num_classes,
            "embed_dim": self.embed_dim,
            "depth": self.depth,
            "num_heads": self.num_heads,
            "mlp_ratio": self.mlp_ratio,
            "global_pool": self.global_pool,
            "class_token": self.class_token,
            "drop_path_rate": self.drop_path_rate,
            **({"stem": self.stem} if self.stem != "patch" else {}),
            # attn="auto" chooses for the batch each process steps
            **({"auto_batch_size": self.batch_size} if self.attn == "auto" else {}),
            **self.model_kwargs,
        }


DEFAULT_MODEL: str = next(f.default for f in dataclasses.fields(TrainConfig) if f.name == "model")
# The keys a named model brings its own value of (make_config).
MODEL_SHAPE_KEYS = ("patch_size", "embed_dim", "depth", "num_heads", "mlp_ratio", "global_pool", "class_token")

# Model keywords that come from their own config keys or from the dataset (num_classes).
_OWN_MODEL_KEYS = frozenset(
    {"attn", "attn_kwargs", "img_size", "patch_size", "num_classes", "embed_dim", "depth", "num_heads", "mlp_ratio",
     "global_pool", "class_token", "drop_path_rate", "pretrained", "auto_batch_size", "stem"}
)
FIELD_TYPES: dict[str, Any] = typing.get_type_hints(TrainConfig)


def default_patch_size(image_hw: tuple[int, int]) -> int:
    """The smallest patch side from 2 up that divides both image sides and leaves at most MAX_DEFAULT_TOKENS
    patches: the digits' 16 px get 2 (64 tokens), 512 px images 8 (4,096), 224 px 4 (3,136)."""
    height, width = image_hw
    for side in range(2, min(height, width) + 1):
        if height % side == 0 and width % side == 0 and (height // side) * (width // side) <= MAX_DEFAULT_TOKENS:
            return side
    raise ConfigError(
        f"patch_size: no patch side divides {height}x{width} into at most {MAX_DEFAULT_TOKENS:,} patches; give --patch-size"
    )


# -- value checks -------------------------------------------------------------------------------
def check_values(config: TrainConfig) -> None:
    """ConfigError for the first value out of range, or keys that contradict each other; in this order, as the
    shape checks divide by patch_size and num_heads, which the counts have found positive."""
    _check_names(config)
    _check_dataset(config)
    _check_counts_and_rates(config)
    _check_transfer_and_adapters(config)
    _check_regularisation_and_augmentation(config)
    _check_shapes(config)
    _check_trackers(config)
    _check_auto_augment(config)
    _check_attention(config)
    _check_weights_and_model_kwargs(config)


def _check_names(config: TrainConfig) -> None:
    """The named choices (dataset, mixed precision, scheduler, pooling, stem, optimizer, timm model), and the
    stem and pooling that need something of another key."""
    _choice("dataset", config.dataset, DATASETS)
    _choice("mixed_precision", config.mixed_precision, MIXED_PRECISION)
    _choice("sched", config.sched, SCHEDULERS)
    _choice("global_pool", config.global_pool, GLOBAL_POOLS)
    _choice("stem", config.stem, tuple(STEMS))
    if config.stem != "patch" and config.pretrained:
        raise ConfigError(f"stem: {config.stem!r} has no pretrained weights (timm's are a patch projection); "
                          f"use stem 'patch' with --pretrained")
    if config.global_pool == "token" and not config.class_token:
        raise ConfigError("global_pool: 'token' reads the class token; set class_token true or use 'avg'")
    _choice("opt", config.opt, list_optimizers())
    if not timm.is_model(config.model):
        raise ConfigError(f"model: {config.model!r} is not a timm model; visattn's: {', '.join(timm.list_models('visattn_*'))}")


def _check_dataset(config: TrainConfig) -> None:
    """An image folder's directory, and the options of a generated dataset (the others take none)."""
    if config.dataset == "imagefolder" and config.data_dir is None:
        raise ConfigError("data_dir: dataset 'imagefolder' needs --data-dir pointing at the image folder")
    if config.dataset in TASKS:
        try:
            task_options(config.dataset, config.dataset_kwargs, config.image_hw)
        except ValueError as error:
            raise ConfigError(str(error)) from None
    elif config.dataset_kwargs:
        raise ConfigError(f"dataset_kwargs: dataset {config.dataset!r} takes no options; generated ones do: {', '.join(TASKS)}")


def _check_counts_and_rates(config: TrainConfig) -> None:
    """Counts and sizes (at least 1, or 0 where none is a choice), sample caps, learning rates."""
    for key in ("epochs", "batch_size", "grad_accum_steps", "patch_size", "embed_dim", "depth", "num_heads",
                "keep_checkpoints"):
        _at_least(key, getattr(config, key), 1)
    for key in ("transfer_epochs", "num_workers", "save_every", "warmup_epochs", "weight_decay", "warmup_lr", "min_lr"):
        _at_least(key, getattr(config, key), 0)
    for key in ("max_train_samples", "max_eval_samples"):
        if getattr(config, key) is not None:
            _at_least(key, getattr(config, key), 1)
    for key in ("lr", "transfer_lr"):
        if not getattr(config, key) > 0:
            raise ConfigError(f"{key}: must be > 0, got {getattr(config, key)}")


def _check_transfer_and_adapters(config: TrainConfig) -> None:
    """Attention transfer and LoRA adapters: their settings, the trained weights both start from, and what
    they cannot be combined with."""
    _choice("transfer_mode", config.transfer_mode, TRANSFER_MODES)
    if config.transfer_epochs and config.initial_checkpoint is None and not config.pretrained:
        raise ConfigError(
            "transfer_epochs: attention transfer learns from trained softmax weights; give --initial-checkpoint or --pretrained"
        )
    _at_least("lora_rank", config.lora_rank, 0)
    if config.lora_alpha is not None and not config.lora_alpha > 0:
        raise ConfigError(f"lora_alpha: must be > 0 or none, got {config.lora_alpha}")
    if config.lora_alpha is not None and not config.lora_rank:
        raise ConfigError("lora_alpha: has no effect without lora_rank; give --lora-rank R too, or drop it")
    if config.lora_rank and config.initial_checkpoint is None and not config.pretrained:
        raise ConfigError("lora_rank: adapters fine-tune trained weights, which stay frozen; give --initial-checkpoint "
                          "or --pretrained, or lora_rank 0 to train from scratch")
    if config.lora_rank and config.transfer_projections:
        raise ConfigError("transfer_projections: trains the attention's qkv and proj, which lora_rank keeps frozen (its "
                          "transfer trains their adapters); give one or the other")
    if config.transfer_epochs and config.attn == TIMM_ATTENTION:
        raise ConfigError(f"transfer_epochs: attn {TIMM_ATTENTION!r} keeps timm's Attention; give the type to transfer to")


def _check_regularisation_and_augmentation(config: TrainConfig) -> None:
    """Gradient clipping, drop path, label smoothing, the held-out fraction, and the augmentation's
    probabilities, strengths and crop ranges."""
    if config.clip_grad is not None and not config.clip_grad > 0:
        raise ConfigError(f"clip_grad: must be > 0 or none, got {config.clip_grad}")
    for key in ("drop_path_rate", "label_smoothing"):
        if not 0 <= getattr(config, key) < 1:
            raise ConfigError(f"{key}: must be in [0, 1), got {getattr(config, key)}")
    if not 0 < config.eval_fraction < 1:
        raise ConfigError(f"eval_fraction: must be in (0, 1), got {config.eval_fraction}")
    for key in ("hflip", "re_prob", "mixup_prob", "mixup_switch_prob"):
        if not 0 <= getattr(config, key) <= 1:
            raise ConfigError(f"{key}: must be a probability in [0, 1], got {getattr(config, key)}")
    for key in ("color_jitter", "mixup", "cutmix"):
        _at_least(key, getattr(config, key), 0)
    for key in ("crop_scale", "crop_ratio"):
        low_high = getattr(config, key)
        if len(low_high) != 2 or not 0 < low_high[0] <= low_high[1]:
            raise ConfigError(f"{key}: must be [low, high] with 0 < low <= high, got {low_high}")


def _check_shapes(config: TrainConfig) -> None:
    """The image size against the patch size and stem, the model's width against its heads, and a batch that
    mixup can pair."""
    if isinstance(config.img_size, list) and len(config.img_size) != 2:
        raise ConfigError(f"img_size: give one side or [H, W], got {config.img_size}")
    for side, name in zip(config.image_hw, ("height", "width")):
        if side < 1 or side % config.patch_size:
            raise ConfigError(
                f"img_size: image {name} {side} must be a positive multiple of patch_size={config.patch_size}"
            )
    if config.stem == "conv" and config.patch_size % 2:
        raise ConfigError(f"stem: 'conv' strides by 2 and needs an even patch_size, got {config.patch_size}")
    if not config.mlp_ratio > 0:
        raise ConfigError(f"mlp_ratio: must be > 0, got {config.mlp_ratio}")
    if config.embed_dim % config.num_heads:
        raise ConfigError(f"num_heads: embed_dim={config.embed_dim} must be divisible by num_heads={config.num_heads}")
    if (config.mixup > 0 or config.cutmix > 0) and config.batch_size % 2:
        raise ConfigError(f"batch_size: mixup/cutmix pair images within a batch, so it must be even, got {config.batch_size}")


def _check_trackers(config: TrainConfig) -> None:
    available = [str(tracker) for tracker in get_available_trackers()]
    for name in config.log_with:
        if name != "all" and name not in available:
            raise ConfigError(
                f"log_with: tracker {name!r} is not available here; installed: {', '.join(available) or 'none'} "
                "(or 'all')"
            )


def _check_auto_augment(config: TrainConfig) -> None:
    if config.auto_augment is not None:
        try:
            check_auto_augment(config.auto_augment)
        except ValueError as error:
            raise ConfigError(f"auto_augment: {error}") from None


def _check_attention(config: TrainConfig) -> None:
    """One attention name, or one per block; each a registered type, "auto" or timm's own (for every block)."""
    valid = list_attentions()
    if isinstance(config.attn, list):
        if len(config.attn) != config.depth:
            raise ConfigError(f"attn: {len(config.attn)} names given for depth={config.depth}; give one name or one per block")
        if TIMM_ATTENTION in config.attn:
            raise ConfigError(f"attn: {TIMM_ATTENTION!r} (timm's own Attention) is for every block; give it alone, not per block")
        bad = [name for name in config.attn if name not in valid]
    else:
        bad = [] if config.attn in valid or config.attn in ("auto", TIMM_ATTENTION) else [config.attn]
    if bad:
        raise ConfigError(
            f"attn: unknown attention {', '.join(map(repr, bad))}; valid: {', '.join(valid)}, auto, {TIMM_ATTENTION}"
        )


def _check_weights_and_model_kwargs(config: TrainConfig) -> None:
    """One source of first weights at most, and model_kwargs that leave alone what other keys set."""
    if config.pretrained and config.initial_checkpoint is not None:
        raise ConfigError("pretrained and initial_checkpoint exclude each other: start from timm's weights or from the file")
    overlap = sorted(set(config.model_kwargs) & _OWN_MODEL_KEYS)
    if overlap:
        raise ConfigError(f"model_kwargs: {', '.join(overlap)} set by their own config keys (or the dataset); set them there")
    if "embed_layer" in config.model_kwargs:
        raise ConfigError(f"model_kwargs: embed_layer is chosen by stem, one of {', '.join(STEMS)}; set stem")


def _choice(key: str, value: str, accepted: typing.Iterable[str]) -> None:
    accepted = list(accepted)
    if value not in accepted:
        raise ConfigError(f"{key}: {value!r} is not one of {', '.join(accepted)}")


def _at_least(key: str, value: float, low: float) -> None:
    if value < low:
        raise ConfigError(f"{key}: must be >= {low}, got {value}")


# -- keys and types -----------------------------------------------------------------------------
def _checked(key: str, value: Any, annotation: Any) -> Any:
    ok, converted = matches(value, annotation)
    if not ok:
        raise ConfigError(f"{key}: expected {type_name(annotation)}, got {type(value).__name__} {value!r}")
    return converted


def _unknown_key_error(key: str, where: str) -> ConfigError:
    close = difflib.get_close_matches(key, FIELD_TYPES, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ConfigError(f"{where}unknown config key {key!r}{hint}")


def check_keys(values: dict[str, Any], where: str = "") -> dict[str, Any]:
    """``values`` with every key a field of TrainConfig and every value of the field's type."""
    checked = {}
    for key, value in values.items():
        if key not in FIELD_TYPES:
            raise _unknown_key_error(str(key), where)
        try:
            checked[key] = _checked(key, value, FIELD_TYPES[key])
        except ConfigError as error:
            raise ConfigError(f"{where}{error}") from None
    return checked


def make_config(*layers: dict[str, Any]) -> TrainConfig:
    """The defaults with each mapping of ``layers`` laid over the previous ones, then checked.

    A layer that names another model than the layers below it brings that model's own shape
    (:data:`MODEL_SHAPE_KEYS`, :func:`visattn.models.model_shape`): the shape below was chosen for the model
    below (the defaults' is the digits recipe's small ViT), and ``--model vit_tiny_patch16_224`` means ViT-Ti.
    Shape keys the same layer (or a later one) gives still win.
    """
    values: dict[str, Any] = {}
    for layer in layers:
        layer = check_keys(layer)
        if "model" in layer and layer["model"] != values.get("model", DEFAULT_MODEL):
            try:
                values.update(model_shape(layer["model"]))
            except ValueError as error:
                raise ConfigError(f"model: {error}") from None
        values.update(layer)
    return TrainConfig(**values)


def run_dir_of(values: dict[str, Any]) -> Path:
    """The folder a run of ``values`` writes to: ``run_dir``, or ``runs/<dataset>-<attn>``, a missing ``dataset`` or
    ``attn`` taking TrainConfig's default. ``values`` are config keys whose types are checked (:func:`check_keys`)
    but not yet the values together: ``--resume`` reads the settings saved in the folder first and lays the flags
    over them, and a flag may be valid only beside them (``--lora-rank`` needs the run's initial checkpoint)."""
    if values.get("run_dir") is not None:
        return Path(values["run_dir"])
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig) if f.name in ("dataset", "attn")}
    dataset, attn = values.get("dataset", defaults["dataset"]), values.get("attn", defaults["attn"])
    label = attn if isinstance(attn, str) else "+".join(dict.fromkeys(attn))
    return Path("runs") / f"{dataset}-{label}"


def changed_keys(old: TrainConfig, new: TrainConfig) -> list[str]:
    """'key: old -> new' for every field that differs."""
    old_values, new_values = old.to_dict(), new.to_dict()
    return [f"{key}: {old_values[key]!r} -> {new_values[key]!r}" for key in old_values if old_values[key] != new_values[key]]


# -- YAML recipes -------------------------------------------------------------------------------
def read_yaml(path: str | Path) -> dict[str, Any]:
    """The mapping in a YAML config file, keys checked; ConfigError for a missing or malformed file."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as error:
        raise ConfigError(f"cannot read config file {path}: {error.strerror or error}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a YAML text file (not UTF-8)") from None
    try:
        values = load_yaml(text)
    except yaml.YAMLError as error:
        # one line: the problem and where, not the multi-line excerpt
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(f"{path}: not valid YAML{where}: {problem}") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: expected a mapping of config keys, got {type(values).__name__}")
    return check_keys(values, where=f"{path}: ")


def config_yaml(config: TrainConfig) -> str:
    """``config`` as YAML that :func:`read_yaml` reads back to an equal config."""
    return yaml.safe_dump(config.to_dict(), sort_keys=False)
