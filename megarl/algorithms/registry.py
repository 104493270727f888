"""Name -> function tables for the pieces chosen by name in config (algorithm parts, rewards, environments,
transports), and the one way a config name is looked up: registered, or "package.module:attribute" imported."""
from __future__ import annotations

import importlib
from typing import Callable

from ..errors import unknown_name


def registrar(table: dict[str, Callable]):
    """A decorator factory that adds functions to `table` under a name: @register("name")."""
    def register(name: str):
        def add(fn):
            table[name] = fn
            return fn
        return add
    return register


def resolve(table: dict, name: str, field: str):
    """table[name], or "package.module:attribute" imported by dotted path; ValueError naming `field` (the config key)
    otherwise."""
    if name in table:
        return table[name]
    if ":" in name:
        module, _, attr = name.partition(":")
        try:
            found = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"{field}={name!r}: cannot import {attr!r} from {module!r} ({e}). Fix: make {module!r} "
                             "importable (installed, or its folder on PYTHONPATH) and check the attribute's name, or "
                             f"use a registered name: {sorted(table)}") from None
        if not callable(found):
            raise ValueError(f"{field}={name!r} is not callable")
        return found
    raise ValueError(unknown_name(field, name, sorted(table), " or give 'package.module:attribute'"))
