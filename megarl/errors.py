"""Anticipated failures: input a user can fix (config, data, model folder, parallel sizes, engine, sandbox).

Every such error derives from `UserError`; its message is ONE line that names the config field (or file, or URL) and
the fix. `megarl` prints it once, from rank 0, as `megarl: error: <message>` and exits with code 2; the other ranks
stay quiet. Anything else is a bug and keeps its traceback.

Errors that only one rank can see (rank 0 loads the data, talks to the engines, scores rewards) must reach every rank
before the others block in a collective: `on_rank0(fn)` runs fn on rank 0 and hands its result, or the UserError it
raised, to every rank, which then all raise the same error together (megarl.cli turns that into the quiet exit).
"""
from __future__ import annotations

import contextlib
from typing import Callable, TypeVar

T = TypeVar("T")

USER_ERROR_EXIT_CODE = 2


class UserError(Exception):
    """Input the user can fix; the message is one line naming the field and the fix."""


def unknown_name(field: str, value, choices, also: str = "") -> str:
    """The one line for a name that is not one of `choices`: the close matches first ("did you mean X?", difflib),
    the choices, and the Fix. also: what else the field takes (e.g. " or give 'package.module:attribute'")."""
    import difflib

    names = [str(c) for c in choices]
    close = difflib.get_close_matches(str(value), names, n=3, cutoff=0.6)
    if close:
        return (f"{field}={value!r} is unknown; did you mean {close[0]}? Fix: {field}={close[0]} (choose one of "
                f"{names}{also})")
    return f"{field}={value!r} is unknown; choose one of {names}{also}. Fix: set {field} to one of these"


class RemoteUserError(UserError):
    """The UserError another rank raised (re-raised on this rank so every rank stops together)."""

    def __init__(self, message: str, kind: str):
        super().__init__(message)
        self.kind = kind


@contextlib.contextmanager
def about(field: str, *also: type):
    """Re-raise a UserError (or one of the `also` exceptions a library raised) as a UserError whose message starts
    with the field it is about: `with about("data.train=x.jsonl"): load(...)`."""
    try:
        yield
    except (UserError, *also) as e:
        message = str(e)
        raise UserError(message if message.startswith(field) else f"{field}: {message}") from None


def on_rank0(fn: Callable[[], T], group=None) -> T | None:
    """fn() on rank 0 of `group` (default: the world); every rank gets its result, or raises the UserError it
    raised. A collective: every rank of the group must call it. Other exceptions propagate on rank 0 alone (a bug
    keeps its traceback; the others are stopped by the launcher)."""
    import torch.distributed as dist

    src = dist.get_global_rank(group, 0) if group is not None else 0
    box = [None]
    if dist.get_rank() == src:
        try:
            box[0] = ("ok", fn())
        except UserError as e:
            box[0] = ("error", (str(e), type(e).__name__))
            dist.broadcast_object_list(box, src=src, group=group)
            raise
    dist.broadcast_object_list(box, src=src, group=group)
    status, value = box[0]
    if status == "error":
        raise RemoteUserError(*value)
    return value


class PeerFailed(UserError):
    """Raised by a rank that stopped because another rank of its group hit a UserError (see on_ranks)."""


def on_ranks(fn: Callable[[], T], here: bool, group=None) -> T | None:
    """fn() on the ranks where `here` is true; every rank of `group` then raises the lowest rank's UserError, if any
    rank raised one. A collective. A rank that stopped because of a peer (PeerFailed) defers to the peer's error."""
    error, result = None, None
    if here:
        try:
            result = fn()
        except PeerFailed:
            pass
        except UserError as e:
            error = e
    agree(error, group)
    return result


def agree(error: UserError | None, group=None) -> None:
    """Every rank passes the UserError it hit (or None); all raise the lowest rank's error, or none does.
    A collective: lets a check that runs on every rank (e.g. a folder each rank reads) fail on all of them together."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    found = [None] * world
    dist.all_gather_object(found, None if error is None else (str(error), type(error).__name__), group=group)
    index = next((i for i, f in enumerate(found) if f is not None), None)
    if index is None:
        return
    if index == dist.get_rank(group):  # the lowest rank that saw an error says it; the others stay quiet
        raise error
    raise RemoteUserError(*found[index])
