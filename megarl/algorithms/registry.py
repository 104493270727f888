"""Name -> function tables for the algorithm pieces chosen by name in AlgorithmConfig."""
from __future__ import annotations

from typing import Callable


def registrar(table: dict[str, Callable]):
    """A decorator factory that adds functions to `table` under a name: @register("name")."""
    def register(name: str):
        def add(fn):
            table[name] = fn
            return fn
        return add
    return register
