"""``ConfigError`` and the value checks the config sections run in their ``__post_init__``.

Every message starts with the dotted key (``grpo.learning_rate=0.0 must be > 0``);
``load_config`` puts the file (or ``--set``) in front, so a bad value reads as one line
``file: key=value must be ...``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from typing import Any, Literal


class ConfigError(ValueError):
    """A configuration file or override is invalid; the message names the file and key."""


def fail(section: Any, name: str, requirement: str) -> ConfigError:
    """The error for field ``name`` of ``section`` (a section dataclass with a ``KEY``):
    ``"<KEY>.<name>=<value!r> <requirement>"``."""
    return ConfigError(f"{section.KEY}.{name}={getattr(section, name)!r} {requirement}")


@functools.lru_cache(maxsize=None)
def field_types(cls: type) -> dict[str, Any]:
    """Resolved annotations of the dataclass ``cls``'s fields (``typing.get_type_hints``)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def literal_choices(annotation: Any) -> tuple | None:
    """The allowed values of a ``Literal[...]`` annotation; None for any other type."""
    return typing.get_args(annotation) if typing.get_origin(annotation) is Literal else None


def check_fields(section: Any) -> None:
    """Values of ``Literal`` fields are among their choices; ``float`` fields are finite.

    Raises:
      ConfigError: naming the first offending field.
    """
    for name, annotation in field_types(type(section)).items():
        value = getattr(section, name)
        choices = literal_choices(annotation)
        if choices is not None and value not in choices:
            raise fail(section, name, f"must be one of {list(choices)}")
        if annotation is float and not math.isfinite(value):
            raise fail(section, name, "must be a finite number")


def at_least(section: Any, low: int | float, *names: str, note: str = "") -> None:
    """Fields ``names`` of ``section`` are ``>= low`` (``note``: what the bound's edge means).

    Raises:
      ConfigError: naming the first field below ``low``.
    """
    for name in names:
        if getattr(section, name) < low:
            raise fail(section, name, f"must be >= {low}{note}")


def above(section: Any, low: float, *names: str, note: str = "") -> None:
    """Fields ``names`` of ``section`` are ``> low`` (``note``: why).

    Raises:
      ConfigError: naming the first field ``<= low``.
    """
    for name in names:
        if not getattr(section, name) > low:
            raise fail(section, name, f"must be > {low}{note}")
