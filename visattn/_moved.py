"""Old module paths and names kept for one release, each served from its new home with a DeprecationWarning.

This module imports nothing of visattn, so every room, ops included, may use it.
"""
from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any


def warn_moved(old: str, new: str, stacklevel: int = 3) -> None:
    """The DeprecationWarning of an old path; ``stacklevel`` points it at the line that used the old path,
    so that Python shows it by default there (it hides deprecations blamed on library code)."""
    warnings.warn(
        f"{old} moved to {new}; import it from there (the old path goes in the next release)",
        DeprecationWarning,
        stacklevel=stacklevel,
    )


def alias_module(old: str, new: str) -> None:
    """Make the module ``old`` the module ``new`` itself (so attributes and patches are shared)."""
    warn_moved(old, new, stacklevel=4)  # past this function and the old module's body, to its importer
    sys.modules[old] = importlib.import_module(new)


def moved_attributes(module: str, moved: Mapping[str, str], warn: bool = True) -> Callable[[str], Any]:
    """A module-level ``__getattr__`` (PEP 562) serving names that moved, looked up on first use.

    Args:
        module: the module's ``__name__``.
        moved: old name -> ``"new.module:new_name"``.
        warn: warn on each use (False where the module's import already warned).
    """

    def __getattr__(name: str) -> Any:
        if name not in moved:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        path, _, attr = moved[name].partition(":")
        if warn:
            warn_moved(f"{module}.{name}", f"{path}.{attr}")
        return getattr(importlib.import_module(path), attr)

    return __getattr__
