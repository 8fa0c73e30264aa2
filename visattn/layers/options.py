"""Layer options written as text: ``kernel_size=5,dilation=2`` or ``{"kernel_size": 5}``, and which
attention type each option of an ``attn_kwargs`` mapping goes to.

The one reader of option text for the training config and the benchmark command line. Values follow
YAML 1.2 scalar rules: ``1e-3`` is a float, ``no``/``on`` are strings, ``true``/``false`` booleans,
``[7, 7]`` a list; PyYAML's default YAML 1.1 rules would read ``1e-3`` as a string and ``no`` as False.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

import yaml

from visattn.layers.registry import get_attention, list_attentions


class Yaml12Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 booleans and floats (``1e-3`` a float, ``no``/``on`` strings)."""


_BOOL, _FLOAT = "tag:yaml.org,2002:bool", "tag:yaml.org,2002:float"
Yaml12Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in (_BOOL, _FLOAT)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
Yaml12Loader.add_implicit_resolver(_BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
Yaml12Loader.add_implicit_resolver(
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


def load_yaml(text: str) -> Any:
    """``text`` read as YAML with YAML 1.2 scalars; ``yaml.YAMLError`` when it is not YAML."""
    return yaml.load(text, Loader=Yaml12Loader)


def parse_key_values(text: str) -> dict[str, Any]:
    """``k=v,k2=v2`` or a YAML/JSON mapping ``{"k": v}`` as a dict; ValueError naming the bad part.

    Commas inside brackets, braces or quotes belong to the value (``window=[7,7]``); values are read
    as YAML 1.2 (``lr=1e-3`` a float, ``options={k: 64}`` a mapping).
    """
    if text.strip().startswith("{"):
        try:
            mapping = load_yaml(text)
        except yaml.YAMLError:
            raise ValueError(f"not a valid YAML/JSON mapping: {text!r}") from None
        if not isinstance(mapping, dict) or not all(isinstance(key, str) for key in mapping):
            raise ValueError(f"expected a mapping with string keys, got {text!r}")
        return mapping
    values: dict[str, Any] = {}
    for pair in _split_top_level(text):
        name, sep, value = pair.partition("=")
        name = name.strip()
        if not sep or not name:
            raise ValueError(f"expected KEY=VALUE pairs, got {pair!r}")
        try:
            values[name] = load_yaml(value)
        except yaml.YAMLError:
            raise ValueError(f"value of {name!r} is not valid YAML: {value!r}") from None
    return values


_OPENING, _CLOSING, _VALUE_STARTS = "[{(", "]})", ("=", "[", "{", ",", ":")


def _split_top_level(text: str) -> list[str]:
    """``text`` cut at the commas outside brackets, braces and quoted values."""
    pieces, current, depth, quote = [], [], 0, None
    for char in text:
        if quote:
            quote = None if char == quote else quote
        elif char in "\"'" and "".join(current).rstrip()[-1:] in _VALUE_STARTS:
            quote = char  # a quote that starts a value; an apostrophe inside a word (it's) opens nothing
        elif char in _OPENING:
            depth += 1
        elif char in _CLOSING:
            depth -= 1
        elif char == "," and depth == 0:
            pieces.append("".join(current))
            current = []
            continue
        current.append(char)
    pieces.append("".join(current))
    return [piece for piece in pieces if piece.strip()]


def options_per_type(names: Iterable[str], attn_kwargs: Mapping[str, Any]) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """The options of each attention type in ``names``, from ``attn_kwargs`` in either form, mixed freely:

    - ``{option: value}`` (``kernel_size=5``): for every type of ``names`` that accepts the option;
    - ``{type: {option: value}}`` (``neighborhood={kernel_size: 5}``): for that type only, over the
      flat options; a type not in ``names`` is passed over, so one mapping can hold several types' options.

    Returns:
        ({name: options} for each distinct name, in order; the flat options no type of ``names`` accepts).
    Raises:
        ValueError: a key that is neither an attention type nor an option of one, a type's entry that is not a
            mapping, or an option under a type that the type does not accept.
    """
    accepted = {name: get_attention(name).type_options() for name in list_attentions()}
    flat = {key: value for key, value in attn_kwargs.items() if key not in accepted}
    unknown = sorted(key for key in flat if not any(key in options for options in accepted.values()))
    if unknown:
        every_option = sorted({option for options in accepted.values() for option in options})
        raise ValueError(
            f"unknown option(s) {', '.join(unknown)}: neither an attention type nor an option of one; options: "
            f"{', '.join(every_option)}; or a type with its own options, e.g. neighborhood={{kernel_size: 5}}"
        )
    for name, options in attn_kwargs.items():
        if name not in accepted:
            continue
        if not isinstance(options, Mapping):
            raise ValueError(f"{name}: expected a mapping of its options, e.g. {name}={{...}}, got {options!r}")
        wrong = sorted(set(options) - set(accepted[name]))
        if wrong:
            raise ValueError(
                f"{name}: unknown option(s) {', '.join(map(str, wrong))}; accepted: {', '.join(accepted[name]) or 'none'}"
            )
    per_type = {
        name: {key: value for key, value in flat.items() if key in accepted[name]} | dict(attn_kwargs.get(name, {}))
        for name in dict.fromkeys(names)
    }
    unused = [key for key in flat if not any(key in accepted[name] for name in per_type)]
    return per_type, unused
