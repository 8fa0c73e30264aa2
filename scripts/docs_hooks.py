"""mkdocs hook: the configuration reference is generated from TrainConfig's fields at every build, so the
page cannot drift from the code (docs/configuration.md holds the marker it replaces)."""
from __future__ import annotations

import dataclasses

from visattn.train.config import TrainConfig

MARKER = "<!-- trainconfig-fields -->"


def _default(field: dataclasses.Field) -> str:
    if field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        value = field.default
    return "none" if value is None else f"`{value!r}`".replace("|", "\\|")


def config_table() -> str:
    """One row per TrainConfig field: key, flag, type, default, help."""
    rows = ["| key | flag | type | default | what |", "|---|---|---|---|---|"]
    for field in dataclasses.fields(TrainConfig):
        type_name = str(field.type).replace("|", "or")
        help_text = field.metadata.get("help", "").replace("|", "\\|")
        rows.append(f"| `{field.name}` | `--{field.name.replace('_', '-')}` | `{type_name}` | {_default(field)} | {help_text} |")
    return "\n".join(rows) + "\n"


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARKER in markdown:
        return markdown.replace(MARKER, config_table())
    return markdown
