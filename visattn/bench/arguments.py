"""What the two commands of ``visattn-bench`` read alike: the arguments they share (the rows, the model and the
op, the device, the output folder), memory sizes and the name of the second command.

Memory sizes (``--max-memory`` of both) are read by :func:`parse_memory`: ``8GiB``, ``512MiB``, ``4GB``; a
bare number is GiB in both.
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

import torch

from visattn.bench.sweep import DEFAULT_MODEL, DTYPES, timm_reference_name
from visattn.layers import list_attentions
from visattn.layers.options import options_per_type, parse_key_values
from visattn.ops.backends import BACKENDS

MAX_TOKENS = "max-tokens"  # visattn-bench max-tokens; without it, visattn-bench runs the sweep
MAX_TOKENS_SUMMARY = "the largest token count each type runs forward and trains within a memory limit"
_MEMORY_UNITS = {
    "": 2**30, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
MEMORY_SYNTAX = "16GiB, 512MiB, 4GB (10^9 bytes); a bare number is GiB"


def parse_memory(text: str) -> int:
    """'16GiB' -> 16 * 2**30 bytes; units B, KiB, MiB, GiB, TiB (powers of 1024) or kB, MB, GB, TB (powers
    of 1000), in any case; a bare number is GiB. The one syntax of every ``--max-memory``."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*", text)
    unit = match and _MEMORY_UNITS.get(match[2].lower())
    if not unit or float(match[1]) <= 0:
        raise ValueError(f"expected a positive size such as 16GiB, 512MiB or 4GB (a bare number is GiB), got {text!r}")
    return int(float(match[1]) * unit)


def memory_argument(text: str) -> int:
    """:func:`parse_memory` as an argparse type."""
    try:
        return parse_memory(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def backend_argument(text: str) -> tuple[str, str]:
    """``axial=sdpa`` -> ("axial", "sdpa"): an op of :data:`visattn.ops.backends.BACKENDS` and one of its paths,
    as an argparse type (``--backend``)."""
    op, equals, name = text.partition("=")
    if not equals or op not in BACKENDS:
        raise argparse.ArgumentTypeError(f"expected OP=NAME with OP one of {', '.join(BACKENDS)}, got {text!r}")
    if name not in BACKENDS[op]:
        raise argparse.ArgumentTypeError(f"{op}'s paths are {', '.join(BACKENDS[op])}, got {text!r}")
    return op, name


def _key_values(text: str) -> dict[str, Any]:
    """``depth=6`` (or ``depth=6,mlp_ratio=2``) -> {"depth": 6, ...}, values read as YAML 1.2."""
    try:
        return parse_key_values(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_shared_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of both commands: the rows, the model and the op, the device, the output folder."""
    p.add_argument("--model", default=DEFAULT_MODEL, help="visattn model (timm name)")
    p.add_argument("--timm-model", help="timm's stock reference model; default: --model without 'visattn_', with '_224'")
    p.add_argument("--attn", nargs="+", default=list_attentions(), help="attention types (beside the reference rows, see --references)")
    p.add_argument(
        "--attn-kwargs", type=_key_values, nargs="*", default=[], metavar="KEY=VALUE",
        help="type options, as in train.py: k=64 for every type that takes it, linformer={k: 64} for one type",
    )
    p.add_argument("--model-kwargs", type=_key_values, nargs="*", default=[], metavar="KEY=VALUE", help="passed to both models, e.g. depth=6")
    p.add_argument("--num-classes", type=int, default=1000, help="classifier width of both models")
    p.add_argument("--heads", type=int, default=6, help="heads of --ops")
    p.add_argument("--head-dim", type=int, default=64, help="head width of --ops")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu, cuda or cuda:N")
    p.add_argument(
        "--dtype", choices=list(DTYPES), default="fp32",
        help="bf16, fp16: the models under autocast, the op's q, k, v created in the dtype",
    )
    p.add_argument("--grad-checkpointing", action="store_true", help="train mode: recompute each block in the backward (timm's set_grad_checkpointing)")
    p.add_argument("--out", type=Path, default=Path("bench_out"), help="output directory")


def check_shared_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace, sizes_from: str) -> torch.device:
    """Check and resolve the arguments of :func:`add_shared_arguments`; returns the device. ``sizes_from``
    names what sets the image size, for the error on ``--model-kwargs img_size=...``."""
    unknown = [a for a in args.attn if a not in list_attentions()]
    if unknown:
        parser.error(f"unknown attention(s) {', '.join(unknown)}; valid: {', '.join(list_attentions())}")
    args.attn = list(dict.fromkeys(args.attn))
    given = {key: value for words in args.attn_kwargs for key, value in words.items()}
    try:
        args.attn_kwargs, unused = options_per_type(args.attn, given)
    except ValueError as err:
        parser.error(f"--attn-kwargs: {err}")
    # Unlike a training recipe, the command line holds only what the user typed for this run.
    unused += [name for name in given if name in list_attentions() and name not in args.attn]
    if unused:
        parser.error(f"--attn-kwargs: {', '.join(unused)} applies to none of --attn ({', '.join(args.attn)})")
    args.model_kwargs = {key: value for words in args.model_kwargs for key, value in words.items()}
    taken = {"img_size", "num_classes", "attn", "attn_kwargs"} & set(args.model_kwargs)
    if taken:
        parser.error(f"--model-kwargs cannot set {', '.join(sorted(taken))}; {sizes_from}")
    for name in ("num_classes", "heads", "head_dim"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    device = torch.device(args.device)
    if device.type not in ("cpu", "cuda") or (device.type == "cuda" and not torch.cuda.is_available()):
        parser.error(f"--device must be cpu or an available cuda device, got {args.device!r}")
    if not args.ops:
        try:
            args.timm_model = args.timm_model or timm_reference_name(args.model)
        except ValueError as err:
            parser.error(str(err))
    return device
