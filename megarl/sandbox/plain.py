"""Plain data across the sandbox boundary: the one codec for values that cross it, in both directions.

A plain value is built from exact builtin types only: None, bool, int, float (inf and nan included), str, bytes, list,
tuple, dict, set, frozenset. Anything else (subclasses of int, str or list, objects with their own __eq__, generators,
functions...) is refused by `encode` with a reason, as are recursive structures. On the wire a value is JSON: None,
bool, int and str as themselves, lists as lists, the rest tagged ({"f": repr}, {"b": hex}, {"t": [...]}, {"s": [...]},
{"z": [...]}, {"d": [[key, value], ...]}). `decode` builds exact builtin types only, so what comes out of the sandbox
compares with the builtin ==, whatever the sandbox sent.

Stdlib only (json): megarl.sandbox.session sends this file's source into the sandbox, whose interpreter runs with -I -S,
to decode call arguments and encode results there; the trusted side encodes arguments and decodes results with the
same functions. A frame is 8 bytes of big-endian length, then the JSON.
"""
import json

PLAIN = "None, bool, int, float, str, bytes, list, tuple, dict, set, frozenset"
_TAGS = {tuple: "t", set: "s", frozenset: "z"}
_TYPES = {"t": tuple, "s": set, "z": frozenset}


class NotPlain(TypeError):
    """A value that is not plain data (the message says why)."""


def encode(value, _open=None):
    """value -> a JSON-able tree, or NotPlain. `_open`: ids of the containers being encoded (a recursive one is
    refused rather than recursed into)."""
    kind = type(value)
    if value is None or kind is bool or kind is int or kind is str:
        return value
    if kind is float:
        return {"f": repr(value)}
    if kind is bytes:
        return {"b": value.hex()}
    if kind not in (list, tuple, set, frozenset, dict):
        raise NotPlain("a %s, which is not plain data (%s)" % (kind.__name__, PLAIN))
    _open = set() if _open is None else _open
    if id(value) in _open:
        raise NotPlain("a recursive %s (it contains itself), which is not plain data" % kind.__name__)
    _open.add(id(value))
    try:
        if kind is dict:
            return {"d": [[encode(k, _open), encode(v, _open)] for k, v in value.items()]}
        items = [encode(v, _open) for v in value]
    finally:
        _open.discard(id(value))
    return items if kind is list else {_TAGS[kind]: items}


def decode(tree):
    """The inverse of encode; ValueError (or TypeError: an unhashable key) on anything encode cannot produce."""
    kind = type(tree)
    if tree is None or kind is bool or kind is int or kind is str:
        return tree
    if kind is list:
        return [decode(v) for v in tree]
    if kind is dict and len(tree) == 1:
        (tag, inner), = tree.items()
        if tag == "f" and type(inner) is str:
            return float(inner)
        if tag == "b" and type(inner) is str:
            return bytes.fromhex(inner)
        if tag in _TYPES and type(inner) is list:
            return _TYPES[tag](decode(v) for v in inner)
        if tag == "d" and type(inner) is list and all(type(p) is list and len(p) == 2 for p in inner):
            return {decode(k): decode(v) for k, v in inner}
    raise ValueError("not an encoded plain value")


def frame(value) -> bytes:
    data = json.dumps(encode(value), separators=(",", ":")).encode("ascii")
    return len(data).to_bytes(8, "big") + data


def unframe(data: bytes):
    """The value of one frame's JSON (the bytes after its length); ValueError on anything malformed."""
    try:
        return decode(json.loads(data))
    except (ValueError, TypeError, RecursionError, UnicodeDecodeError) as e:
        raise ValueError("not plain data (%s)" % type(e).__name__) from None
