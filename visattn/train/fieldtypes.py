"""Values checked against the type annotations of a dataclass's fields.

The annotations the training config uses: ``int``, ``float``, ``bool``, ``str``, ``None``, unions
of them, ``list[X]`` and ``dict[str, Any]``. ``bool`` is never accepted for ``int`` or ``float``
(YAML's ``true`` is not a number), while an ``int`` is accepted, and converted, where a ``float`` is asked for.
"""
from __future__ import annotations

import types
import typing
from typing import Any, Union

SCALARS = (int, float, bool, str)


def is_union(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (Union, types.UnionType)


def alternatives(annotation: Any) -> tuple[Any, ...]:
    """The members of a union, or ``(annotation,)``."""
    return typing.get_args(annotation) if is_union(annotation) else (annotation,)


def accepts(annotation: Any, kind: Any) -> bool:
    """Whether ``annotation`` (or one member of it) is ``kind`` or a generic of it (``list[int]`` for list)."""
    return any(arg is kind or typing.get_origin(arg) is kind for arg in alternatives(annotation))


def accepts_scalar(annotation: Any) -> bool:
    return any(accepts(annotation, kind) for kind in (*SCALARS, type(None)))


def type_name(annotation: Any) -> str:
    """How an error message names the type: ``int``, ``float or none``, ``list of str``, ``mapping``."""
    if annotation is type(None):
        return "none"
    if is_union(annotation):
        return " or ".join(type_name(arg) for arg in typing.get_args(annotation))
    origin = typing.get_origin(annotation)
    if origin is list:
        return f"list of {type_name(typing.get_args(annotation)[0])}"
    if origin is dict:
        return "mapping"
    return getattr(annotation, "__name__", str(annotation))


def matches(value: Any, annotation: Any) -> tuple[bool, Any]:
    """(value fits annotation, the value converted: int -> float where a float is asked for)."""
    if annotation is Any:
        return True, value
    if annotation is type(None):
        return value is None, value
    if is_union(annotation):
        for arg in typing.get_args(annotation):
            ok, converted = matches(value, arg)
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
            ok, item = matches(item, item_type)
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
