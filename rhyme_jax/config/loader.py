"""``load_config``: YAML files and dotted ``--set`` overrides merged by OmegaConf, returned as
a frozen ``RunConfig``; ``to_dict`` / ``to_yaml`` write one back.

OmegaConf merges onto the structured schema of ``RunConfig`` (so an unknown key, a value of the
wrong type or outside a ``Literal`` fails naming the key), then ``OmegaConf.to_object`` builds
the dataclasses, whose ``__post_init__`` checks the values. Every error is one ``ConfigError``
line ``<file or --set>: <key>...``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Optional

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException, ValidationError

from rhyme_jax.config.checks import ConfigError, field_types, literal_choices
from rhyme_jax.config.run_config import RunConfig


def load_config(path: Optional[str | Path] = None, overrides: Optional[list[str]] = None) -> RunConfig:
    """Build the run configuration from defaults, a YAML file and dotted overrides.

    Args:
      path: YAML file whose keys follow ``RunConfig``; a top-level ``defaults: [other.yaml]``
        list loads those files first (paths relative to this file).
      overrides: ``["grpo.steps=10", "run.name=x"]`` style strings, applied last.

    Returns:
      A frozen ``RunConfig``. Only the YAML is read: ``model.path`` stays as written (a known
      model's name is mapped to its cache directory by ``rhyme_jax.model.hub.resolve`` where the
      model is loaded), and checks that need this machine (backend, attention kernels, the
      distributed environment) run in ``rhyme_jax.train.preflight.prepare``.

    Raises:
      ConfigError: the file is missing or not valid YAML, a key is unknown, a value has the wrong
        type or fails a check of ``RunConfig`` / its sections; the message names the file (or
        ``--set``) and the key.
    """
    node = OmegaConf.structured(RunConfig)
    if path is not None:
        node = _merge_file(node, Path(path), seen=())
    for item in overrides or []:
        node = _merge_override(node, item, f"{path} --set {item!r}" if path is not None else f"--set {item!r}")
    source = str(path) if path is not None else "--set"
    source += " with --set overrides" if path is not None and overrides else ""
    try:
        return OmegaConf.to_object(node)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def _merge_override(node: DictConfig, item: str, where: str) -> DictConfig:
    """``node`` with the dotted override ``item`` (``a.b=value``, the value parsed as YAML)."""
    if "=" not in item:
        raise ConfigError(f"{where}: expected KEY=VALUE, e.g. grpo.steps=10")
    try:
        return OmegaConf.merge(node, OmegaConf.from_dotlist([item]))
    except OmegaConfBaseException as exc:
        raise ConfigError(f"{where}: {_one_line(exc)}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where}: not a YAML value: {' '.join(str(exc).split())}") from None


def _read_file(path: Path, seen: tuple) -> tuple[DictConfig, list]:
    """A config file's mapping without its ``defaults`` list, and that list.

    Raises:
      ConfigError: the file is missing, not valid YAML, not a mapping, or includes itself.
    """
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    if path.resolve() in seen:
        raise ConfigError(f"{path}: circular 'defaults' include")
    try:
        raw = OmegaConf.load(path)
    except Exception as exc:  # yaml.YAMLError and friends carry line numbers in their text
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(raw, DictConfig):
        raise ConfigError(f"{path}: top level must be a mapping")
    return raw, list(raw.pop("defaults", []))


def _merge_file(node: DictConfig, path: Path, seen: tuple) -> DictConfig:
    raw, includes = _read_file(path, seen)
    for inc in includes:
        node = _merge_file(node, path.parent / str(inc), seen + (path.resolve(),))
    try:
        return OmegaConf.merge(node, raw)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"{path}: {_one_line(exc)}") from None


def required_keys(path: str | Path) -> list[str]:
    """Dotted keys that a config file (or a file its ``defaults`` include) marks ``???``: values
    the user must give (``--set KEY=VALUE``), e.g. ``model.path`` of a recipe for a model that is
    not shipped. ``load_config`` keeps the schema default there (OmegaConf does not merge a
    missing value onto a default), so tools that need only the shapes still read the file; the
    training commands refuse it (``check_required``).

    Raises:
      ConfigError: a file is missing, not valid YAML or includes itself (as ``load_config``).
    """
    out: list[str] = []

    def walk(node, prefix):
        for key in node.keys():
            name = f"{prefix}{key}"
            if OmegaConf.is_missing(node, key):
                out.append(name)
            elif isinstance(node[key], DictConfig):
                walk(node[key], name + ".")

    def visit(p: Path, seen: tuple):
        raw, includes = _read_file(p, seen)
        for inc in includes:
            visit(p.parent / str(inc), seen + (p.resolve(),))
        walk(raw, "")

    visit(Path(path), ())
    return sorted(set(out))


def check_required(path: Optional[str | Path], overrides: Optional[list[str]] = None) -> None:
    """Every ``required_keys(path)`` is set by an override.

    Raises:
      ConfigError: one is not, naming the file, the key and the ``--set`` that gives it.
    """
    if path is None:
        return
    given = {item.split("=", 1)[0].strip() for item in overrides or [] if "=" in item}
    for key in required_keys(path):
        if key not in given:
            raise ConfigError(f"{path}: {key} is required (the file marks it ???): add --set {key}=VALUE")


def _one_line(exc: OmegaConfBaseException) -> str:
    """OmegaConf's error as ``key: problem`` (``key=value must be one of [...]`` for a
    ``Literal`` field, worded like the sections' own checks), without its type noise."""
    key = getattr(exc, "full_key", None) or ""
    prefix = getattr(getattr(exc, "object_type", None), "KEY", None)  # an entry of a list: OmegaConf drops its path
    if key and "." not in key and prefix and not key.startswith(prefix):
        key = f"{prefix}.{key}"
    choices = literal_choices(_annotation(key)) if key else None
    if isinstance(exc, ValidationError) and choices is not None:
        return f"{key}={exc.value!r} must be one of {list(choices)}"
    lines = [line.strip() for line in str(getattr(exc, "msg", None) or exc).splitlines() if line.strip()]
    first = next((ln for ln in lines if not ln.startswith("full_key:")), type(exc).__name__)
    return f"{key}: {first}" if key else first


def _annotation(key: str) -> Any:
    """The annotation of the ``RunConfig`` field at dotted ``key`` (None if there is none)."""
    cls: Any = RunConfig
    annotation = None
    for part in key.split("."):
        if not dataclasses.is_dataclass(cls) or part not in field_types(cls):
            return None
        annotation = cls = field_types(cls)[part]
    return annotation


def to_dict(cfg: RunConfig) -> dict:
    """Plain nested dict of a config (``dataclasses.asdict``), e.g. for saving next to a run."""
    return dataclasses.asdict(cfg)


def to_yaml(cfg: RunConfig) -> str:
    """The config as YAML text that ``load_config`` reads back to an equal ``RunConfig``."""
    return OmegaConf.to_yaml(OmegaConf.create(to_dict(cfg)))


def schema_fields() -> list[str]:
    """Dotted names of every configurable field (for docs and error hints)."""
    out = []

    def walk(cls, prefix):
        for name, annotation in field_types(cls).items():
            if dataclasses.is_dataclass(annotation):
                walk(annotation, prefix + name + ".")
            else:
                out.append(prefix + name)

    walk(RunConfig, "")
    return out
