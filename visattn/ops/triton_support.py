"""Where the Triton kernels of the ops (``ops/<op>/triton.py``) can run, and how they pick a launch configuration.

Triton ships with torch's Linux wheels; elsewhere (macOS, some aarch64 builds) it is absent and the
kernels' paths are never chosen. Its interpreter (``TRITON_INTERPRET=1``, read when a kernel module is
imported) runs the same kernels on CPU tensors: how the test suite checks them on a machine without a
GPU. Without it a CPU tensor never reaches a kernel.

On a GPU a kernel launches with its module's ``TUNED_CONFIGS`` entry, else autotunes over its candidates, each
compiled and timed once per key in a process. ``VISATTN_TRITON_AUTOTUNE=0`` (read when visattn is imported)
launches it with its first candidate instead: no autotuning, for runs that must start at once at many small
shapes, such as the GPU check's cuda tests (the check times the tuned kernels apart, at the model's shapes).
"""
from __future__ import annotations

import importlib.util
import os

import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _autotune_setting() -> bool:
    value = os.environ.get("VISATTN_TRITON_AUTOTUNE", "1")
    if value not in ("0", "1"):
        raise ValueError(
            f"VISATTN_TRITON_AUTOTUNE must be 0 (each kernel's first candidate) or 1 (autotune), got {value!r}"
        )
    return value == "1"


AUTOTUNE = _autotune_setting()


def triton_runs_on(device: torch.device) -> bool:
    """Whether a Triton kernel can run on tensors of ``device``: compiled on CUDA, interpreted on the CPU."""
    if not HAS_TRITON:
        return False
    return device.type == "cuda" or (INTERPRETED and device.type == "cpu")


def check_triton_runs_on(op: str, device: torch.device) -> None:
    """Raises a one-line ValueError when ``op``'s ``triton`` path was asked for where it cannot run."""
    if triton_runs_on(device):
        return
    if not HAS_TRITON:
        raise ValueError(f"{op}: the 'triton' backend needs the triton package, which this torch install lacks")
    raise ValueError(
        f"{op}: the 'triton' backend runs on CUDA tensors (or on the CPU with TRITON_INTERPRET=1 set before "
        f"visattn is imported), got {device.type} tensors"
    )


def register_triton_op(name: str, impl, fake):
    """The torch.library op ``visattn::<name>`` running ``impl``: a Triton op, whose kernels torch.compile
    captures, or under the interpreter (whose kernels cannot be traced) an opaque custom op with ``fake``."""
    if INTERPRETED:
        op = torch.library.custom_op(f"visattn::{name}", impl, mutates_args=())
        op.register_fake(fake)
        return op
    return torch.library.triton_op(f"visattn::{name}", mutates_args=())(impl)
