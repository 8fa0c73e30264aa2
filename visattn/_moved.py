"""Old module paths kept for one release, each re-exporting the names from their new homes."""
from __future__ import annotations

import importlib
import sys
import warnings


def warn_moved(old: str, new: str) -> None:
    """The DeprecationWarning of an old module path, pointing at the line that imported it."""
    warnings.warn(
        f"{old} moved to {new}; import it from there (the old path goes in the next release)",
        DeprecationWarning,
        stacklevel=3,
    )


def alias_module(old: str, new: str) -> None:
    """Make ``old`` the module ``new`` itself (so attributes and patches are shared), with a warning."""
    warn_moved(old, new)
    sys.modules[old] = importlib.import_module(new)
