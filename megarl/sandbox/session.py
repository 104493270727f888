"""A solution module loaded once in a sandbox, serving calls of its functions by name: the untrusted half of a test
run whose trusted half (the tests) runs in the caller's process (megarl.rewards.code).

Inside, one process (an Execution, isolated and limited like every run_python run) runs _SERVER with
megarl.sandbox.plain's source: it runs /work/setup.py, then /work/solution.py, as the module `solution` (so
`if __name__ == "__main__":` blocks do not run), replies "ready" (or what loading raised), then answers each request
read from its stdin, (name, args, kwargs), with the call's result, the exception the call raised, or why the result is
not plain data. Requests and replies are plain.frame()s; replies travel on a pipe of their own, the solution's stdin is
/dev/null, and its stdout and stderr share one pipe that is only kept for failure reasons. The server shares its
process with the solution, so it is exactly as untrusted: all that counts is the bytes of its replies, which the
caller decodes as plain data (exact builtin types, at most result_bytes encoded); nothing from inside is ever executed
or compared as an object outside.

Limits: SandboxLimits as for run_python, for the whole session (cpu_s and wall_s over its whole life, memory_mb...),
and per call (loading the module is one): call_cpu_s (checked with a cgroup; without one the call's wall clock bounds
it), call_wall_s, result_bytes. A limit, a result that is not plain data or the process ending kills the session:
that call and every later one raise SessionFailed, and `failure` keeps the reason. State persists across the calls of
one session (module globals, as in the original harnesses) and is gone after close().
"""
from __future__ import annotations

import builtins
import os
import reprlib
import subprocess
import time

from . import plain
from .execution import Execution, SandboxLimits, error_reason
from .isolation import SandboxUnavailable

_SOLUTION, _SETUP = "solution.py", "setup.py"

# Runs inside the sandbox after megarl.sandbox.plain's source; REPLY_FD is the reply pipe's fd number.
_SERVER = r'''
import os, sys, types


def _read(n):
    data = b""
    while len(data) < n:
        chunk = os.read(_REQUESTS, n - len(data))
        if not chunk:
            os._exit(0)  # the caller closed the session
        data += chunk
    return data


def _send(message):
    try:
        data = frame(message)
    except (NotPlain, RecursionError, ValueError) as e:  # ValueError: an int too long to print
        data = frame(("error", str(e) if type(e) is NotPlain else "a value that cannot be encoded (%s)"
                      % type(e).__name__))
    view = memoryview(data)
    while view:
        view = view[os.write(REPLY_FD, view):]


def _raised(e):
    try:
        return ("raised", type(e).__name__, str(e)[:1000])
    except BaseException:
        return ("raised", "Exception", "(an exception whose message cannot be read)")


def _target(name):
    found = vars(solution)
    if name in found:
        return found[name]
    cls = found.get("Solution")
    if isinstance(cls, type) and hasattr(cls, name):  # LeetCode style (LiveCodeBench): a method of class Solution
        if not _instance:
            _instance.append(cls())
        return getattr(_instance[0], name)
    raise NameError("the solution defines no %r" % name)


_REQUESTS, _null, _instance = os.dup(0), os.open(os.devnull, os.O_RDONLY), []
os.dup2(_null, 0)
os.close(_null)
solution = types.ModuleType("solution")
solution.__file__ = os.path.join(os.getcwd(), "solution.py")
sys.modules["solution"] = solution
try:
    for _name in ("setup.py", "solution.py"):
        with open(_name, encoding="utf-8") as _f:
            exec(compile(_f.read(), _name, "exec"), vars(solution))
except BaseException as e:
    _send(_raised(e))
else:
    _send(("ready",))
    while True:
        _, _name, _args, _kwargs = unframe(_read(int.from_bytes(_read(8), "big")))
        try:
            _result = ("value", _target(_name)(*_args, **_kwargs))
        except BaseException as e:
            _result = _raised(e)
        _send(_result)
'''
with open(plain.__file__, encoding="utf-8") as _f:
    _PLAIN = _f.read()


class SessionFailed(BaseException):
    """The session cannot go on (a limit, a result that is not plain data, the process ended); the message says why.
    A BaseException, so that test code's `except Exception:` does not mistake it for an error it expects (the caller
    checks Session.failure anyway)."""


class SolutionError(Exception):
    """The solution raised an exception that is not a builtin Exception class: "TypeName: message"."""


# Exceptions that are control flow, not errors: a StopIteration raised into the trusted test would end whatever
# iteration called the proxy (all(map(f, xs)) would be True, sum(map(f, xs)) 0), forging a pass. They arrive as
# SolutionError (as PEP 479 turns a StopIteration inside a generator into a RuntimeError).
_CONTROL_FLOW = (StopIteration, StopAsyncIteration)


def _exception(type_name: str, message: str) -> Exception:
    """What a call raises in the caller: the builtin Exception class of that name with the message (so that tests
    expecting, say, a ValueError see one), else SolutionError. Only classes and text from here: nothing the solution
    made."""
    cls = getattr(builtins, type_name, None)
    if isinstance(cls, type) and issubclass(cls, Exception) and not issubclass(cls, _CONTROL_FLOW):
        try:
            return cls(message)
        except Exception:  # a class whose constructor wants other arguments (UnicodeDecodeError...)
            pass
    return SolutionError(f"{type_name}: {message}")


_SHOW = reprlib.Repr()
_SHOW.maxstring = _SHOW.maxother = 120


def _text(what) -> str:
    return what if isinstance(what, str) else what()


def show(value) -> str:
    """A short repr of a (decoded, plain) value for failure reasons."""
    try:
        return _SHOW.repr(value)
    except ValueError:  # an int too long to print
        return "(a long int)"


class _Reply:
    """The reply pipe's bytes: one frame at a time (8 bytes of length, then at most `limit` bytes of JSON)."""

    def __init__(self, limit: int):
        self.limit, self.data, self.eof = limit, bytearray(), False

    def add(self, chunk: bytes) -> None:
        self.data += chunk

    def length(self) -> int | None:
        return int.from_bytes(self.data[:8], "big") if len(self.data) >= 8 else None

    def framed(self) -> bool:
        """A whole frame is here, or the start of one over the limit (no need to read the rest)."""
        n = self.length()
        return n is not None and (n > self.limit or len(self.data) >= 8 + n)

    def ready(self) -> bool:
        return self.framed() or self.eof

    def take(self) -> bytes:
        n = self.length()
        body = bytes(self.data[8:8 + n])
        del self.data[:8 + n]
        return body


class Session:
    """`solution` (Python source) loaded in a fresh sandbox, after `setup`; call() its functions by name until close()
    (also a context manager). Raises SandboxUnavailable, with nothing run, when the isolation cannot be set up, and
    SessionFailed when loading fails (the module raised, a limit...)."""

    def __init__(self, solution: str, limits: SandboxLimits | None = None, setup: str = ""):
        self.limits = limits or SandboxLimits()
        self.failure: str | None = None
        self._last = None  # (name, args, kwargs, "returned"/"raised", what) of the last call, for failure reasons
        self._run, (reply_r, reply_w) = None, os.pipe()
        self._reply_r = reply_r
        try:
            self._run = Execution(f"REPLY_FD = {reply_w}\n{_PLAIN}\n{_SERVER}", self.limits,
                                  files={_SOLUTION: solution, _SETUP: setup}, stdin=subprocess.PIPE,
                                  merge_output=True, pass_fds=(reply_w,))
            os.close(reply_w)
            reply_w = -1
            self._reply = _Reply(self.limits.result_bytes)
            self._run.streams[reply_r] = self._reply
            os.set_blocking(reply_r, False)
            self._requests = self._run.proc.stdin.fileno()
            os.set_blocking(self._requests, False)
            reply = self._exchange(None, "loading the solution")
            if not self._run.started():  # a reply, yet the preamble never reported: run nothing more (fail closed)
                raise SandboxUnavailable("the sandbox answered without its isolation check having reported")
            if reply[:1] == ("raised",) and len(reply) == 3:
                self._fail(f"loading the solution raised {error_reason(f'{reply[1]}: {reply[2]}', self.limits)}")
            if reply != ("ready",):
                self._fail("loading the solution: an unexpected reply")
        except BaseException:
            if reply_w >= 0:
                os.close(reply_w)
            self.close()
            raise

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *_) -> None:
        self.close()

    def call(self, name: str, args: tuple = (), kwargs: dict | None = None):
        """solution.<name>(*args, **kwargs)'s result, decoded (plain data of exact builtin types). Raises the builtin
        exception the call raised (same class and message) or SolutionError; SessionFailed when the session cannot
        go on, also when the test's args or kwargs are not plain data (a TypeError there could be one the test
        expects from the solution)."""
        args, kwargs = tuple(args), dict(kwargs or {})
        try:
            plain.encode((args, kwargs))
        except plain.NotPlain as e:
            self._fail(f"{name}(...): the test passed {e}; such a call cannot cross into the sandbox")
        reply = self._exchange(("call", name, args, kwargs), lambda: self._shown_call(name, args, kwargs))
        if reply[:1] == ("value",) and len(reply) == 2:
            self._last = (name, args, kwargs, "returned", reply[1])
            return reply[1]
        if reply[:1] == ("raised",) and len(reply) == 3 and all(type(x) is str for x in reply[1:]):
            self._last = (name, args, kwargs, "raised", reply[1])
            raise _exception(reply[1], reply[2])
        if reply[:1] == ("error",) and len(reply) == 2 and type(reply[1]) is str:
            self._fail(f"{self._shown_call(name, args, kwargs)} returned {reply[1][:300]}")
        self._fail(f"{self._shown_call(name, args, kwargs)}: an unexpected reply")

    def last_call(self) -> str | None:
        """The last call that came back and its outcome, e.g. "add(1, 2) returned -1"."""
        if self._last is None:
            return None
        name, args, kwargs, outcome, what = self._last
        return f"{self._shown_call(name, args, kwargs)} {outcome} {show(what) if outcome == 'returned' else what}"

    @staticmethod
    def _shown_call(name: str, args: tuple, kwargs: dict) -> str:
        shown = [show(a) for a in args] + [f"{k}={show(v)}" for k, v in kwargs.items()]
        return f"{name}({', '.join(shown)})"[:300]

    def _fail(self, reason: str):
        self.failure = reason
        raise SessionFailed(reason)

    def _exchange(self, request, what):
        """Send `request` (None: only wait for the loading's reply) and return the decoded reply, within the call's
        limits and the session's; SessionFailed otherwise. `what` (text, or a function making it) names the call in
        reasons."""
        if self.failure is not None:
            raise SessionFailed(self.failure)
        limits, run = self.limits, self._run
        send = None if request is None else (self._requests, bytearray(plain.frame(request)))
        call_deadline = time.monotonic() + limits.call_wall_s
        deadline = min(call_deadline, run.start + limits.wall_s)
        cpu_per_call = run.cpu_s() + limits.call_cpu_s
        cpu_limit = min(cpu_per_call, limits.cpu_s)
        stopped = run.pump(deadline, cpu_limit, until=self._reply.ready, send=send)
        if stopped == "until" and self._reply.framed():  # even after EOF: what was written before the end counts
            n = self._reply.length()
            if n > limits.result_bytes:
                self._fail(f"{_text(what)}: its result is {n} bytes encoded, over result_bytes="
                           f"{limits.result_bytes}")
            if run.oom_killed():  # a process of the solution was killed, even if the call came back
                self._fail(f"{_text(what)}: memory limit ({limits.memory_mb} MB in total): a process was killed by "
                           "the kernel's OOM killer")
            try:
                reply = plain.unframe(self._reply.take())
            except ValueError as e:
                self._fail(f"{_text(what)}: an unreadable reply ({e})")
            if type(reply) is not tuple or not reply:
                self._fail(f"{_text(what)}: an unexpected reply")
            return reply
        if stopped == "until":  # the reply pipe closed: the process is ending (or closed the pipe itself)
            stopped = run.pump(deadline, cpu_limit)
        code, reason = run.finish(stopped)  # kills it unless it ended; SandboxUnavailable if it never started
        if stopped == "wall" and run.started():
            reason = (f"time limit (wall {limits.call_wall_s:g} s per call)" if call_deadline <= deadline else
                      f"time limit (wall {limits.wall_s:g} s in total)")
        elif stopped == "cpu":
            reason = (f"cpu limit ({limits.call_cpu_s:g} s per call)" if cpu_per_call <= cpu_limit else
                      f"cpu limit ({limits.cpu_s:g} s in total)")
        elif stopped == "eof" and (reason is None or reason.startswith(("exit code", "killed"))):
            reason = f"the solution's process ended: {reason or f'exit code {code}'}"
        self._fail(f"{_text(what)}: {reason}")

    def close(self) -> None:
        """Kill the sandbox and clean up (idempotent)."""
        if self._run is not None:
            self._run.close()
            self._run = None
        if self._reply_r >= 0:
            os.close(self._reply_r)
            self._reply_r = -1
