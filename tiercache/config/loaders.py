"""The thin loaders that build the configuration tree (tiercache.config.sections): from a mapping, from a YAML file,
with the CLI's dotted-key overrides on top. Every value is turned into its field's type here, with an error that
names the key. Also the two rules for anything else users write (the tenants file, an engine's extra config, files
named in configuration): an unknown key is refused, and a file that cannot be read is one clear error."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any, Mapping

from tiercache.config.sections import Config
from tiercache.config.sizes import parse_size
from tiercache.errors import ConfigError


def _coerce(name: str, hint: Any, value: Any) -> Any:
    """Turn a YAML or CLI value into the field's type, with an error naming the key."""
    if value is None:
        return None
    if name.endswith("_bytes"):
        try:
            return parse_size(value)
        except ConfigError as exc:  # "not a size: 'lots'" alone did not say which of a file's sizes
            raise ConfigError(f"{name}: {exc}") from None
    kinds = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    kind = kinds[0]
    try:
        if kind is bool:
            if isinstance(value, str):
                if value.lower() not in ("true", "false", "yes", "no", "1", "0"):
                    raise ValueError(value)
                return value.lower() in ("true", "yes", "1")
            return bool(value)
        return kind(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}: expected {kind.__name__}, got {value!r}") from None


def _build(cls: type, values: Mapping[str, Any], where: str) -> Any:
    if not isinstance(values, Mapping):
        raise ConfigError(f"{where or 'config'}: expected a mapping, got {type(values).__name__}")
    hints = typing.get_type_hints(cls)
    known = [f.name for f in dataclasses.fields(cls)]
    refuse_unknown(values, known, "unknown config key", prefix=f"{where}." if where else "")
    kwargs = {}
    for name, value in values.items():
        path = f"{where}.{name}" if where else name
        if dataclasses.is_dataclass(hints[name]):
            kwargs[name] = _build(hints[name], value or {}, path)
        else:
            kwargs[name] = _coerce(path, hints[name], value)
    return cls(**kwargs)


def refuse_unknown(given: typing.Iterable[str], known: typing.Iterable[str], head: str,
                   error: type[Exception] = ConfigError, prefix: str = "") -> None:
    """The one rule for every mapping users write (the config file, the tenants file, an engine's extra config): a key
    we do not know is refused, with the keys we do know, never ignored (a typo would silently change nothing).
    The message is `head`, the unknown keys (each after `prefix`: a dotted path), and the known ones."""
    known = sorted(known)
    unknown = sorted(set(given) - set(known), key=str)  # YAML may give keys of any type
    if unknown:
        raise error(f"{head} {', '.join(f'{prefix}{key}' for key in unknown)} (known: {', '.join(known)})")


def read_file(path: str | Path, what: str = "file", error: type[Exception] = ConfigError) -> bytes:
    """A file named in configuration (config, tenants, TLS certificates and keys, tokens), or a clear error."""
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise error(f"cannot read {what} {path}: {exc.strerror}") from None


def from_mapping(values: Mapping[str, Any]) -> Config:
    return _build(Config, values, "")


def load_file(path: str | Path) -> Config:
    import yaml  # here, not at the top: engine processes import this module for its defaults, never a YAML file

    raw = read_file(path, "config file")
    try:
        text = raw.decode()
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {raw[exc.start]:#04x} at offset "
                          f"{exc.start})") from None
    try:
        values = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {_yaml_problem(exc)}") from None
    try:
        return from_mapping(values)
    except ConfigError as exc:  # the key alone does not say where it was written
        raise ConfigError(f"config file {path}: {exc}") from None


def _yaml_problem(exc: Exception) -> str:
    """PyYAML's error on one line, by line and column (1-based, as editors count). Its own text spans four lines
    with the source quoted under a caret, and names the file "<unicode string>": it parsed a string
    (tests/test_config.py)."""
    mark, problem = getattr(exc, "problem_mark", None), getattr(exc, "problem", None)
    if mark is None or problem is None:
        return " ".join(str(exc).split())
    where = f"line {mark.line + 1}, column {mark.column + 1}: {problem}"
    context, start = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    if context and start is not None and (start.line, start.column) != (mark.line, mark.column):
        return f"{where} ({context} that starts at line {start.line + 1}, column {start.column + 1})"
    return f"{where} ({context})" if context else where


def with_overrides(config: Config, overrides: Mapping[str, Any]) -> Config:
    """Apply dotted-key overrides ('server.port': 6000) on top of a config; None values are skipped."""
    tree = {section.name: dataclasses.asdict(getattr(config, section.name)) for section in dataclasses.fields(config)}
    for dotted, value in overrides.items():
        if value is None:
            continue
        section, name = dotted.split(".", 1)
        tree[section][name] = value
    return from_mapping(tree)
