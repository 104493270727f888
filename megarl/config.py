"""YAML presets + dotted command-line overrides -> typed dataclasses.

    cfg = load_config(TrainConfig, "configs/quickstart.yaml", ["rl.steps=20", "algorithm.clip_eps_high=0.28"])

Rules: every key must be a field of the dataclass it lands in (an unknown key is an error that suggests the closest
valid key); values are checked against the field's type (int, float, bool, str, Optional[...], list, nested
dataclasses) and a wrong type names the field; an override's value is parsed as YAML (`x=3` is an int, `x=null` is
None, `x=[1,2]` a list). `defaults:` at the top of a YAML file names another file (relative to it) to start from.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from typing import Any

import yaml

from .errors import UserError


class ConfigError(UserError, ValueError):
    """A configuration value that cannot be used; the message names the field and the fix."""


def load_config(cls, path: str | None = None, overrides: list[str] | None = None):
    raw: dict = {}
    if path:
        raw = _read_yaml(path)
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.key=value (e.g. rl.steps=20)")
        key, value = item.split("=", 1)
        _set_dotted(raw, key.strip(), yaml.safe_load(value) if value.strip() else "")
    return build(cls, raw)


def _read_yaml(path: str) -> dict:
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path!r} does not exist")
    with open(path) as f:
        try:
            data = yaml.safe_load(f) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path!r} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path!r} must hold a mapping at the top level")
    base = data.pop("defaults", None)
    if base:
        merged = _read_yaml(os.path.join(os.path.dirname(os.path.abspath(path)), base))
        _merge(merged, data)
        return merged
    return data


def _merge(into: dict, update: dict) -> None:
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def _set_dotted(raw: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = raw
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    node[parts[-1]] = value


def build(cls, raw: dict | None, prefix: str = ""):
    """Instantiate dataclass `cls` from a mapping, checking keys and types."""
    raw = raw or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix[:-1] or 'config'} must be a mapping, got {type(raw).__name__} {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        name = f"{prefix}{key}"
        if key not in fields:
            everything = sorted(all_keys(cls))
            close = difflib.get_close_matches(name, everything, n=1, cutoff=0.5) or \
                difflib.get_close_matches(key, list(fields), n=1, cutoff=0.5)
            hint = f" Did you mean {close[0] if '.' in close[0] else prefix + close[0]!r}?" if close else ""
            fix = f"rename it to {close[0] if '.' in close[0] else prefix + close[0]}" if close else "remove it"
            raise ConfigError(f"unknown config key {name!r}.{hint} Valid keys under "
                              f"{prefix[:-1] or 'the top level'}: {sorted(fields)}. Fix: {fix}")
        kwargs[key] = _coerce(hints[key], value, name)
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ConfigError(f"{prefix[:-1] or 'config'}: {e}") from None


def all_keys(cls, prefix: str = "") -> list[str]:
    """Every dotted key of a dataclass tree (for suggestions and docs)."""
    keys = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        keys.append(prefix + f.name)
        inner = _dataclass_of(hints[f.name])
        if inner is not None:
            keys += all_keys(inner, f"{prefix}{f.name}.")
    return keys


def _dataclass_of(tp):
    for t in (tp, *typing.get_args(tp)):
        if dataclasses.is_dataclass(t):
            return t
    return None


def _coerce(tp, value, name: str):
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, name)
            except ConfigError as e:
                errors.append(e)  # the error itself: a single one is re-raised as it is
        raise errors[0] if len(errors) == 1 else ConfigError(f"{name}: {value!r} matches none of {args}")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        return build(tp, value, f"{name}.")
    if tp is Any:
        return value
    if origin in (list, tuple) or tp in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{name} must be a list, got {type(value).__name__} {value!r}")
        (inner,) = typing.get_args(tp)[:1] or (Any,)
        return [_coerce(inner, v, f"{name}[{i}]") for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{name} must be a mapping, got {type(value).__name__} {value!r}")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{name} must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)  # YAML 1.1 reads 1e-6 as a string
            except ValueError:
                pass
        raise ConfigError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{name} must be a string, got {type(value).__name__} {value!r}")
    return value


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)
