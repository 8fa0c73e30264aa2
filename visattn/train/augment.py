"""timm augmentation policies checked before a run starts: a policy is a string such as
``rand-m9-mstd0.5-inc1``, and an unknown one, or one the installed Pillow cannot run, should fail at
once rather than mid-epoch.
"""
from __future__ import annotations

from PIL import Image, ImageOps
from timm.data.auto_augment import (
    augment_and_mix_transform,
    auto_augment_transform,
    posterize,
    rand_augment_transform,
)


def check_auto_augment(policy: str) -> None:
    """ValueError unless ``policy`` is a timm augmentation policy that the installed Pillow can run.

    timm's posterize keeps ``int(4 * magnitude / 10)`` bits (plain RandAugment), ``4 - int(4 * magnitude
    / 10)`` (``inc1``) or a fixed count (some AutoAugment policies), so it reaches 0 bits at the ends of
    the magnitude range, and Pillow 13 raises on 0 bits: ``rand-m9-mstd0.5-inc1`` fails on about one
    image in 500, mid-epoch. Checked here, before anything runs, from timm's own level functions.
    """
    hparams = dict(translate_const=10, img_mean=(128, 128, 128))
    try:
        if policy.startswith("rand"):
            ops = rand_augment_transform(policy, hparams).ops
        elif policy.startswith("augmix"):
            ops = augment_and_mix_transform(policy, hparams).ops
        else:
            ops = [op for sub_policy in auto_augment_transform(policy, hparams).policy for op in sub_policy]
    except (AssertionError, ValueError, KeyError, IndexError) as error:
        raise ValueError(f"{policy!r} is not a timm augmentation policy ({error or 'bad section'})") from None
    try:
        ImageOps.posterize(Image.new("RGB", (1, 1)), 0)
        return  # this Pillow accepts 0 bits
    except ValueError:
        pass
    for op in ops:
        if op.aug_fn is not posterize:
            continue
        upper = op.magnitude_max or 10
        if op.magnitude_std == float("inf"):
            levels = (0.0, min(op.magnitude, upper))
        else:  # Gaussian magnitude noise: six standard deviations, passed once in a billion draws
            spread = 6 * op.magnitude_std
            levels = tuple(max(0.0, min(level, upper)) for level in (op.magnitude - spread, op.magnitude + spread))
        bits = min(op.level_fn(level, op.hparams)[0] for level in levels)
        if bits < 1:
            raise ValueError(
                f"{policy!r} can posterize to {bits} bits ({op.name} over magnitudes "
                f"{levels[0]:g}..{levels[-1]:g}), which Pillow rejects mid-epoch; keep the magnitude away from "
                "that end, e.g. add -mmax9 to an inc1 policy"
            )
