"""The training configuration: one typed dataclass, filled from defaults, a YAML file and flags.

Precedence, lowest first: the dataclass defaults (the embedded-dataset recipe), ``--config FILE``,
then command-line flags. Every field is a flag (``embed_dim`` -> ``--embed-dim``). A key the dataclass
does not have, or a value of the wrong type, is a :class:`ConfigError` naming the key, wherever it
comes from. Mappings (``attn_kwargs``, ``model_kwargs``, ``opt_kwargs``) take ``key=value`` pairs on
the command line, values read as YAML (``--attn-kwargs kernel_size=5 dilation=2``); lists are
comma-separated (``--attn axial,softmax,axial,softmax``, ``--img-size 32,48``).
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

import yaml

DATASETS = ("digits", "cifar10", "cifar100", "imagefolder")
MIXED_PRECISION = ("no", "fp16", "bf16", "fp8")
SCHEDULERS = ("cosine", "tanh", "step", "multistep", "poly", "wsd", "rsqrt", "constant")


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
        metadata=_help("CIFAR root (default ./data) or ImageFolder root (with train/ and val/ or test/, or one folder per class)"),
    )
    img_size: int | list[int] = field(default=16, metadata=_help("image side, or H,W; images are resized to it"))
    eval_fraction: float = field(
        default=0.2, metadata=_help("held-out share for digits and for an ImageFolder without a train/val split")
    )
    max_train_samples: int | None = field(default=None, metadata=_help("train on a fixed random subset of this size"))
    max_eval_samples: int | None = field(default=None, metadata=_help("evaluate on a fixed random subset of this size"))
    num_workers: int = field(default=0, metadata=_help("DataLoader worker processes"))
    # model
    model: str = field(default="visattn_vit_tiny_patch16", metadata=_help("timm model name"))
    attn: str | list[str] = field(
        default="softmax", metadata=_help("attention type, or one per block comma-separated")
    )
    attn_kwargs: dict[str, Any] = field(
        default_factory=dict, metadata=_help("attention type options, key=value (per type name when attn is a list)")
    )
    patch_size: int = field(default=2, metadata=_help("patch side; the grid is img_size / patch_size"))
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
    # optimisation
    epochs: int = field(default=16, metadata=_help("training epochs"))
    batch_size: int = field(default=32, metadata=_help("images per process per step"))
    grad_accum_steps: int = field(default=1, metadata=_help("steps whose gradients add up to one optimizer update"))
    opt: str = field(default="adamw", metadata=_help("timm optimizer name (timm.optim.list_optimizers())"))
    lr: float = field(default=2e-3, metadata=_help("peak learning rate"))
    weight_decay: float = field(default=0.05, metadata=_help("decoupled weight decay (not on biases and norms)"))
    opt_kwargs: dict[str, Any] = field(default_factory=dict, metadata=_help("extra optimizer keywords, key=value"))
    sched: str = field(default="cosine", metadata=_help(f"timm scheduler: {', '.join(SCHEDULERS)}"))
    warmup_epochs: int = field(default=2, metadata=_help("linear warm-up epochs"))
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
    mixed_precision: str = field(default="no", metadata=_help(f"accelerate mixed precision: {', '.join(MIXED_PRECISION)}"))
    run_dir: str | None = field(default=None, metadata=_help("where the run is written (default runs/<dataset>-<attn>)"))
    save_every: int = field(
        default=0, metadata=_help("also checkpoint every this many optimizer updates (0: at epoch ends only)")
    )
    keep_checkpoints: int = field(default=2, metadata=_help("how many of the latest checkpoints to keep"))
    log_with: list[str] = field(default_factory=list, metadata=_help("accelerate trackers, e.g. tensorboard"))

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, _checked(f.name, getattr(self, f.name), _FIELD_TYPES[f.name]))
        self._check_values()

    # -- derived values -------------------------------------------------------------------------
    @property
    def image_hw(self) -> tuple[int, int]:
        size = self.img_size
        return (size, size) if isinstance(size, int) else (size[0], size[1])

    @property
    def resolved_run_dir(self) -> Path:
        if self.run_dir is not None:
            return Path(self.run_dir)
        label = self.attn if isinstance(self.attn, str) else "+".join(dict.fromkeys(self.attn))
        return Path("runs") / f"{self.dataset}-{label}"

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
            **self.model_kwargs,
        }

    # -- value checks ---------------------------------------------------------------------------
    def _check_values(self) -> None:
        import timm
        from timm.optim import list_optimizers

        import visattn

        _choice("dataset", self.dataset, DATASETS)
        _choice("mixed_precision", self.mixed_precision, MIXED_PRECISION)
        _choice("sched", self.sched, SCHEDULERS)
        _choice("global_pool", self.global_pool, ("avg", "token", "max", "avgmax", "map"))
        if self.global_pool == "token" and not self.class_token:
            raise ConfigError("global_pool: 'token' reads the class token; set class_token true or use 'avg'")
        _choice("opt", self.opt, list_optimizers())
        if not timm.is_model(self.model):
            raise ConfigError(f"model: {self.model!r} is not a timm model; visattn's: {', '.join(timm.list_models('visattn_*'))}")
        if self.dataset == "imagefolder" and self.data_dir is None:
            raise ConfigError("data_dir: dataset 'imagefolder' needs --data-dir pointing at the image folder")
        for key in ("epochs", "batch_size", "grad_accum_steps", "patch_size", "embed_dim", "depth", "num_heads",
                    "keep_checkpoints"):
            _at_least(key, getattr(self, key), 1)
        for key in ("num_workers", "save_every", "warmup_epochs", "weight_decay", "warmup_lr", "min_lr"):
            _at_least(key, getattr(self, key), 0)
        for key in ("max_train_samples", "max_eval_samples"):
            if getattr(self, key) is not None:
                _at_least(key, getattr(self, key), 1)
        if not self.lr > 0:
            raise ConfigError(f"lr: must be > 0, got {self.lr}")
        if self.clip_grad is not None and not self.clip_grad > 0:
            raise ConfigError(f"clip_grad: must be > 0 or none, got {self.clip_grad}")
        for key in ("drop_path_rate", "label_smoothing"):
            if not 0 <= getattr(self, key) < 1:
                raise ConfigError(f"{key}: must be in [0, 1), got {getattr(self, key)}")
        if not 0 < self.eval_fraction < 1:
            raise ConfigError(f"eval_fraction: must be in (0, 1), got {self.eval_fraction}")
        for key in ("hflip", "re_prob", "mixup_prob", "mixup_switch_prob"):
            if not 0 <= getattr(self, key) <= 1:
                raise ConfigError(f"{key}: must be a probability in [0, 1], got {getattr(self, key)}")
        for key in ("color_jitter", "mixup", "cutmix"):
            _at_least(key, getattr(self, key), 0)
        for key in ("crop_scale", "crop_ratio"):
            low_high = getattr(self, key)
            if len(low_high) != 2 or not 0 < low_high[0] <= low_high[1]:
                raise ConfigError(f"{key}: must be [low, high] with 0 < low <= high, got {low_high}")
        if isinstance(self.img_size, list) and len(self.img_size) != 2:
            raise ConfigError(f"img_size: give one side or [H, W], got {self.img_size}")
        for side, name in zip(self.image_hw, ("height", "width")):
            if side < 1 or side % self.patch_size:
                raise ConfigError(
                    f"img_size: image {name} {side} must be a positive multiple of patch_size={self.patch_size}"
                )
        if not self.mlp_ratio > 0:
            raise ConfigError(f"mlp_ratio: must be > 0, got {self.mlp_ratio}")
        if self.embed_dim % self.num_heads:
            raise ConfigError(f"num_heads: embed_dim={self.embed_dim} must be divisible by num_heads={self.num_heads}")
        if (self.mixup > 0 or self.cutmix > 0) and self.batch_size % 2:
            raise ConfigError(f"batch_size: mixup/cutmix pair images within a batch, so it must be even, got {self.batch_size}")
        self._check_trackers()
        if self.auto_augment is not None:
            from visattn.data import check_auto_augment

            check_auto_augment(self.auto_augment)
        valid = visattn.list_attentions()
        if isinstance(self.attn, list):
            if len(self.attn) != self.depth:
                raise ConfigError(f"attn: {len(self.attn)} names given for depth={self.depth}; give one name or one per block")
            bad = [name for name in self.attn if name not in valid]
        else:
            bad = [] if self.attn in valid or self.attn == "auto" else [self.attn]
        if bad:
            raise ConfigError(f"attn: unknown attention {', '.join(map(repr, bad))}; valid: {', '.join(valid)}")
        overlap = sorted(set(self.model_kwargs) & _OWN_MODEL_KEYS)
        if overlap:
            raise ConfigError(f"model_kwargs: {', '.join(overlap)} set by their own config keys (or the dataset); set them there")

    def _check_trackers(self) -> None:
        from accelerate.tracking import get_available_trackers

        available = [str(tracker) for tracker in get_available_trackers()]
        for name in self.log_with:
            if name != "all" and name not in available:
                raise ConfigError(
                    f"log_with: tracker {name!r} is not available here; installed: {', '.join(available) or 'none'} "
                    "(or 'all')"
                )


# Model keywords that come from their own config keys or from the dataset (num_classes).
_OWN_MODEL_KEYS = frozenset(
    {"attn", "attn_kwargs", "img_size", "patch_size", "num_classes", "embed_dim", "depth", "num_heads", "mlp_ratio",
     "global_pool", "class_token", "drop_path_rate"}
)

# -- types --------------------------------------------------------------------------------------
_FIELD_TYPES: dict[str, Any] = typing.get_type_hints(TrainConfig)
_SCALARS = (int, float, bool, str)


def _type_name(annotation: Any) -> str:
    if annotation is type(None):
        return "none"
    if _is_union(annotation):
        return " or ".join(_type_name(arg) for arg in typing.get_args(annotation))
    origin = typing.get_origin(annotation)
    if origin is list:
        return f"list of {_type_name(typing.get_args(annotation)[0])}"
    if origin is dict:
        return "mapping"
    return getattr(annotation, "__name__", str(annotation))


def _is_union(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (Union, types.UnionType)


def _matches(value: Any, annotation: Any) -> tuple[bool, Any]:
    """(value fits annotation, the value converted: int -> float where a float is asked for)."""
    if annotation is Any:
        return True, value
    if annotation is type(None):
        return value is None, value
    if _is_union(annotation):
        for arg in typing.get_args(annotation):
            ok, converted = _matches(value, arg)
            if ok:
                return True, converted
        return False, value
    origin = typing.get_origin(annotation)
    if origin is list:
        if not isinstance(value, (list, tuple)):
            return False, value
        (item_type,) = typing.get_args(annotation)
        converted = []
        for item in value:
            ok, item = _matches(item, item_type)
            if not ok:
                return False, value
            converted.append(item)
        return True, converted
    if origin is dict:
        ok = isinstance(value, dict) and all(isinstance(key, str) for key in value)
        return ok, dict(value) if ok else value
    if annotation is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return ok, float(value) if ok else value
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    return isinstance(value, annotation), value


def _checked(key: str, value: Any, annotation: Any) -> Any:
    ok, converted = _matches(value, annotation)
    if not ok:
        raise ConfigError(f"{key}: expected {_type_name(annotation)}, got {type(value).__name__} {value!r}")
    return converted


def _choice(key: str, value: str, accepted: typing.Iterable[str]) -> None:
    accepted = list(accepted)
    if value not in accepted:
        raise ConfigError(f"{key}: {value!r} is not one of {', '.join(accepted)}")


def _at_least(key: str, value: float, low: float) -> None:
    if value < low:
        raise ConfigError(f"{key}: must be >= {low}, got {value}")


def _unknown_key_error(key: str, where: str) -> ConfigError:
    close = difflib.get_close_matches(key, _FIELD_TYPES, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ConfigError(f"{where}unknown config key {key!r}{hint}")


def check_keys(values: dict[str, Any], where: str = "") -> dict[str, Any]:
    """``values`` with every key a field of TrainConfig and every value of the field's type."""
    checked = {}
    for key, value in values.items():
        if key not in _FIELD_TYPES:
            raise _unknown_key_error(str(key), where)
        try:
            checked[key] = _checked(key, value, _FIELD_TYPES[key])
        except ConfigError as error:
            raise ConfigError(f"{where}{error}") from None
    return checked


# -- YAML ---------------------------------------------------------------------------------------
class _Yaml12Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 scalars: ``1e-3`` is a float and ``no``/``on`` are strings; PyYAML's
    YAML 1.1 rules read ``1e-3`` as a string and ``mixed_precision: no`` as False."""


_BOOL, _FLOAT = "tag:yaml.org,2002:bool", "tag:yaml.org,2002:float"
_Yaml12Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in (_BOOL, _FLOAT)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Yaml12Loader.add_implicit_resolver(_BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
_Yaml12Loader.add_implicit_resolver(
    _FLOAT,
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def read_yaml(path: str | Path) -> dict[str, Any]:
    """The mapping in a YAML config file, keys checked; ConfigError for a missing or malformed file."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as error:
        raise ConfigError(f"cannot read config file {path}: {error.strerror or error}") from None
    try:
        values = yaml.load(text, Loader=_Yaml12Loader)
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML: {error}") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: expected a mapping of config keys, got {type(values).__name__}")
    return check_keys(values, where=f"{path}: ")


def config_yaml(config: TrainConfig) -> str:
    """``config`` as YAML that :func:`read_yaml` reads back to an equal config."""
    return yaml.safe_dump(config.to_dict(), sort_keys=False)


# -- command line -------------------------------------------------------------------------------
@dataclass(frozen=True)
class RunOptions:
    """What to do with the run directory and the data; not part of the recipe."""

    config_file: str | None = None
    resume: bool = False
    overwrite: bool = False
    download: bool = False


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Train a visattn ViT with accelerate (python train.py ... or accelerate launch train.py ...).",
        argument_default=argparse.SUPPRESS,
    )
    run = parser.add_argument_group("run")
    run.add_argument("--config", dest="config_file", metavar="FILE", help="YAML recipe (configs/*.yaml); flags override it")
    run.add_argument("--resume", action="store_true", help="continue the run in --run-dir from its last checkpoint")
    run.add_argument("--overwrite", action="store_true", help="replace the previous run in --run-dir")
    run.add_argument("--download", action="store_true", help="download the dataset if it is not in --data-dir")
    recipe = parser.add_argument_group("recipe (every key of TrainConfig)")
    import visattn

    for f in dataclasses.fields(TrainConfig):
        annotation = _FIELD_TYPES[f.name]
        help_text = f.metadata.get("help", "")
        if f.name == "attn":
            help_text += f": {', '.join(visattn.list_attentions())}, or auto (chosen from the model and image size)"
        if annotation is bool:
            recipe.add_argument(_flag(f.name), dest=f.name, action=argparse.BooleanOptionalAction, help=help_text)
        elif typing.get_origin(annotation) is dict:
            recipe.add_argument(_flag(f.name), dest=f.name, nargs="*", metavar="KEY=VALUE", help=help_text)
        else:
            recipe.add_argument(_flag(f.name), dest=f.name, metavar=f.name.upper(), help=help_text)
    return parser


def _accepts(annotation: Any, kind: Any) -> bool:
    args = typing.get_args(annotation) if _is_union(annotation) else (annotation,)
    return any(arg is kind or typing.get_origin(arg) is kind for arg in args)


def _parse_scalar(key: str, text: str, annotation: Any) -> Any:
    """One command-line word as the scalar type(s) the field accepts."""
    if _accepts(annotation, type(None)) and text.lower() in ("none", "null"):
        return None
    if _accepts(annotation, str):
        return text
    for kind in (int, float):
        if _accepts(annotation, kind):
            try:
                return kind(text)
            except ValueError:
                continue
    raise ConfigError(f"{_flag(key)}: expected {_type_name(annotation)}, got {text!r}")


def _parse_flag(key: str, raw: Any) -> Any:
    annotation = _FIELD_TYPES[key]
    if annotation is bool:
        return raw
    if typing.get_origin(annotation) is dict:
        mapping = {}
        for pair in raw:
            name, sep, text = pair.partition("=")
            if not sep or not name:
                raise ConfigError(f"{_flag(key)}: expected KEY=VALUE pairs, got {pair!r}")
            try:
                mapping[name] = yaml.load(text, Loader=_Yaml12Loader)
            except yaml.YAMLError:
                raise ConfigError(f"{_flag(key)}: value of {name!r} is not valid YAML: {text!r}") from None
        return mapping
    alternatives = typing.get_args(annotation) if _is_union(annotation) else (annotation,)
    list_types = [arg for arg in alternatives if typing.get_origin(arg) is list]
    if list_types and ("," in raw or not _accepts_scalar(annotation)):
        (item_type,) = typing.get_args(list_types[0])
        return [_parse_scalar(key, item.strip(), item_type) for item in raw.split(",") if item.strip()]
    return _parse_scalar(key, raw, annotation)


def _accepts_scalar(annotation: Any) -> bool:
    return any(_accepts(annotation, kind) for kind in (*_SCALARS, type(None)))


def parse_args(argv: list[str] | None = None) -> tuple[dict[str, Any], dict[str, Any], RunOptions]:
    """(values from --config, values from flags, run options), each key and type checked.

    The two value mappings stay apart because ``--resume`` lays them over the run's saved config
    rather than over the defaults.
    """
    namespace = vars(build_parser().parse_args(argv))
    options = RunOptions(
        config_file=namespace.pop("config_file", None),
        resume=namespace.pop("resume", False),
        overwrite=namespace.pop("overwrite", False),
        download=namespace.pop("download", False),
    )
    if options.resume and options.overwrite:
        raise ConfigError("--resume and --overwrite exclude each other: continue the run, or replace it")
    from_file = read_yaml(options.config_file) if options.config_file else {}
    from_flags = check_keys({key: _parse_flag(key, raw) for key, raw in namespace.items()})
    return from_file, from_flags, options


def make_config(*layers: dict[str, Any]) -> TrainConfig:
    """The defaults with each mapping of ``layers`` laid over the previous ones, then checked."""
    values: dict[str, Any] = {}
    for layer in layers:
        values.update(check_keys(layer))
    return TrainConfig(**values)


def changed_keys(old: TrainConfig, new: TrainConfig) -> list[str]:
    """'key: old -> new' for every field that differs."""
    old_values, new_values = old.to_dict(), new.to_dict()
    return [f"{key}: {old_values[key]!r} -> {new_values[key]!r}" for key in old_values if old_values[key] != new_values[key]]
