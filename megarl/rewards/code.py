"""Reward for code generation: the dataset's tests run here (trusted), the solution in the sandbox.

The solution is the response's last ```python (or bare ```) block, or the whole response when it has none.

Test programs (formats asserts, mbpp, humaneval, call) run in this process with the real `assert` semantics. The
solution is loaded once per sample in a megarl.sandbox.Session (its state persists across the sample's calls and is
gone after it). Each name the tests read without defining it is a proxy for the solution's function of that name
(except builtins, which stay the builtins, and a few stdlib modules, _MODULES, imported here): a call sends the
arguments into the sandbox and returns the result, both as plain data (megarl.sandbox.plain: exact builtin types;
anything else, e.g. an always-equal object, an int subclass or a generator, fails the solution with the reason).
Nothing the solution makes is executed or compared as an object here and the expected values never enter the sandbox,
so the verdict cannot be forged: patched builtins or math, always-equal objects, printed or forged results, early
exits and reading the tests gain nothing, and even `assert True` or `assert f(x)` is decided here. Judging by value
means: arguments are passed by value (mutations are not seen), methods of returned objects cannot be called, and a
helper the tests call without defining it is the solution's (HumanEval/32's poly: give the prompt, which then defines
it here). The overall limit on the test program is RewardPool's reward.timeout_s, which kills the per-response child
it runs in (called directly, nothing bounds it).

`answer` is a dict (or its JSON) with "format", one of:

- "asserts": {"tests": test code}: any Python (asserts, loops, helpers, isclose, `is True`...), run here;
- "mbpp": {"test_list": [assert lines], "test_setup_code": code, "test_imports": [import lines]} (both optional,
  run here and, before the solution, in the sandbox);
- "humaneval": {"test": code defining check(candidate), "entry_point": name, "prompt": the prompt (optional, run here
  first: its helpers are the tests')}: runs prompt, test, then check(<the solution's entry point>);
- "call": {"fn_name", "inputs": [[args...], ...], "outputs": [value, ...]}: each call's result, tuples read as lists,
  must equal the JSON output; an input given as a string is LiveCodeBench's functional style (newline-separated JSON
  arguments, the output JSON text too); a class Solution with that method (LeetCode style) is called too;
- "stdio": {"inputs": [stdin, ...], "outputs": [stdout, ...]} (APPS/TACO/CodeContests): one sandbox run per case,
  outputs compared line by line after dropping trailing whitespace of each line and trailing blank lines.

Or, as before, a string: assert test code (format asserts), or JSON cases {"inputs", "outputs"} (stdio; with "fn_name":
call). Unknown formats and malformed answers raise ValueError naming the field.

All tests passing scores 1.0; anything else raises CodeRewardFailure with the reason (the failing test line and
exception, the last call to the solution and what it returned, or the limit it hit), which RewardPool turns into reward
0.0 with the reason logged and counted. SandboxUnavailable is not a failure of the response and propagates (fail
closed).

Limits come from the reward kwargs (reward.kwargs in config), see SandboxLimits: cpu_s, wall_s, memory_mb, file_mb,
processes, disk_mb, output_bytes per sandbox run (a stdio case, or one sample's whole session), and per call of a
session: call_cpu_s, call_wall_s, result_bytes.
"""
from __future__ import annotations

import ast
import builtins
import contextlib
import dataclasses
import importlib
import json
import threading
import traceback

from .functions import register_reward
from ..sandbox import SandboxLimits, Session, SessionFailed, run_python
from ..sandbox.session import show

_PYTHON_TAGS = {"", "python", "py", "python3"}
_LIMIT_FIELDS = {f.name for f in dataclasses.fields(SandboxLimits)}
FORMATS = ("asserts", "call", "humaneval", "mbpp", "stdio")
# stdlib modules a test may use without importing them (its dataset's solutions import them): imported here, never
# the solution's. A fixed list, so that nothing the response says decides what is imported here.
_MODULES = frozenset({"bisect", "cmath", "collections", "copy", "datetime", "decimal", "fractions", "functools",
                      "hashlib", "heapq", "itertools", "json", "math", "operator", "random", "re", "statistics",
                      "string", "sys", "typing"})
_REQUIRED = object()


class CodeRewardFailure(ValueError):
    """The response's code did not pass the tests; the message is why."""


def extract_code(response: str) -> str:
    """The last Python (or untagged) fenced block, else the whole response. One pass over the lines (linear time, on
    any input): a line containing ``` opens a block (the word after it is the language tag); the next line
    containing ``` closes it (its text before the fence belongs to the block); an unclosed block runs to the end."""
    blocks, body, tag = [], None, ""
    for line in response.split("\n"):
        at = line.find("```")
        if body is None:
            if at >= 0:
                words = line[at + 3:].split(maxsplit=1)
                tag, body = (words[0] if words else "").lower(), []
        elif at >= 0:
            body.append(line[:at])
            blocks.append((tag, "\n".join(body).rstrip("\n") + "\n" if any(body) else ""))
            body = None
        else:
            body.append(line)
    if body is not None:
        blocks.append((tag, "\n".join(body)))
    python = [text for tag, text in blocks if tag in _PYTHON_TAGS]
    return python[-1] if python else response


def limits_from(kwargs: dict) -> SandboxLimits:
    unknown = sorted(set(kwargs) - _LIMIT_FIELDS)
    if unknown:
        raise ValueError(f"reward code: unknown reward.kwargs {unknown}; accepted: {sorted(_LIMIT_FIELDS)}")
    return SandboxLimits(**kwargs)


# ------------------------------------------------------------------------------------------------- answer formats


def parse_answer(answer) -> tuple[str, dict]:
    """(format, fields) of `answer`: a dict or JSON object with "format", or today's strings (assert test code; JSON
    {"inputs", "outputs"} cases, with "fn_name" function calls)."""
    if isinstance(answer, str):
        if not answer.lstrip().startswith("{"):
            return "asserts", {"tests": answer}
        try:
            answer = json.loads(answer)
        except json.JSONDecodeError as e:
            raise ValueError(f"reward code: the answer starts with '{{' but is not valid JSON ({e})") from None
    if not isinstance(answer, dict):
        raise ValueError(f"reward code: the answer must be a dict (or its JSON) or assert test code, not "
                         f"{type(answer).__name__}")
    fmt = answer.get("format")
    if fmt is None and {"inputs", "outputs"} <= set(answer):
        fmt = "call" if "fn_name" in answer else "stdio"
    if fmt not in FORMATS:
        raise ValueError(f"reward code: the answer's 'format' is {fmt!r}; accepted: {', '.join(FORMATS)} (or, "
                         "without 'format', JSON cases with 'inputs' and 'outputs')")
    return fmt, answer


def _field(answer: dict, fmt: str, name: str, kind: type, default=_REQUIRED):
    value = answer.get(name, default)
    if value is _REQUIRED:
        raise ValueError(f"reward code: format {fmt!r} needs the field {name!r}")
    if not isinstance(value, kind) or kind is list and not all(isinstance(v, str) for v in value):
        raise ValueError(f"reward code: format {fmt!r}: the field {name!r} must be a "
                         f"{'list of strings' if kind is list else kind.__name__}, not {show(value)}")
    return value


def _cases(answer: dict, fmt: str) -> tuple[list, list]:
    inputs, outputs = answer.get("inputs"), answer.get("outputs")
    if not (isinstance(inputs, list) and isinstance(outputs, list) and inputs and len(inputs) == len(outputs)):
        raise ValueError(f"reward code: format {fmt!r}: the fields 'inputs' and 'outputs' must be non-empty lists of "
                         "the same length")
    return inputs, outputs


def _identifier(answer: dict, fmt: str, name: str) -> str:
    value = _field(answer, fmt, name, str)
    if not value.isidentifier():
        raise ValueError(f"reward code: format {fmt!r}: the field {name!r} must be a Python identifier, not "
                         f"{value!r}")
    return value


# ------------------------------------------------------------------------------------------- trusted test programs


class _Function:
    """One of the solution's functions as the tests see it: a call runs it in the sandbox, arguments in and result
    out as plain data."""

    def __init__(self, session: Session, name: str):
        self._session, self.__name__ = session, name

    def __call__(self, *args, **kwargs):
        return self._session.call(self.__name__, args, kwargs)

    def __repr__(self) -> str:
        return f"<the solution's {self.__name__}>"


def _free_names(trees: list[ast.AST]) -> set[str]:
    """Names the test code reads, other than builtins (some are its own: those it binds replace the proxies)."""
    return {node.id for tree in trees for node in ast.walk(tree)
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and not hasattr(builtins, node.id)}


class _Tests:
    """One sample's trusted test program: `sources` (file name -> code, parsed as `trees`) run in one namespace, where
    each name the code reads without binding it is a _MODULES module or a proxy for the solution's function."""

    def __init__(self, session: Session, sources: dict[str, str], trees: dict[str, ast.AST]):
        self.session, self.sources = session, sources
        # optimize=0: the asserts stay even when the trainer runs with python -O (which would make every test pass)
        with _AST_LOCK:
            self.code = {name: compile(tree, name, "exec", optimize=0) for name, tree in trees.items()}
        self.namespace = {"__name__": "__main__"}
        for name in _free_names(list(trees.values())):
            self.namespace[name] = importlib.import_module(name) if name in _MODULES else _Function(session, name)

    def run(self, name: str) -> None:
        exec(self.code[name], self.namespace)

    def reason(self, e: BaseException) -> str:
        """Why the test program failed: the test line and the exception, and the solution's last call."""
        if self.session.failure is not None:
            return self.session.failure
        frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename in self.sources]
        where = ""
        if frames:
            lines = self.sources[frames[-1].filename].splitlines()
            line = lines[frames[-1].lineno - 1].strip() if 0 < frames[-1].lineno <= len(lines) else ""
            where = f"{frames[-1].filename[1:-1]} line {frames[-1].lineno} `{line[:100]}`: "
        what = "assertion failed" if type(e) is AssertionError and not e.args else f"{type(e).__name__}: {e}"[:300]
        last = self.session.last_call()
        return where + what + (f" (last call: {last})" if last else "")


# CPython 3.11's AST <-> Python object conversion keeps its recursion depth in the ast module's state, shared by all
# threads (CPython gh-106905): ast.parse / compile(tree) in two reward threads at once can fail with "SystemError: AST
# constructor recursion depth mismatch" (seen in tests/rewards/test_code_reward.py's 164 HumanEval problems).
_AST_LOCK = threading.Lock()


def _parse(source: str, name: str, fmt: str) -> ast.AST:
    try:
        with _AST_LOCK:
            return ast.parse(source, name)
    except SyntaxError as e:
        raise ValueError(f"reward code: format {fmt!r}: {name[1:-1]} does not parse (line {e.lineno}: {e.msg})") \
            from None


@contextlib.contextmanager
def _session(solution: str, limits: SandboxLimits, setup: str = ""):
    """The solution loaded in a sandboxed Session; a failure to load it (it raised, a limit) is the solution's."""
    try:
        session = Session(solution, limits, setup)
    except SessionFailed as e:
        raise CodeRewardFailure(str(e)) from None
    try:
        yield session
    finally:
        session.close()


def _judge_tests(solution: str, limits: SandboxLimits, fmt: str, sources: dict[str, str], program=None,
                 setup: str = "") -> None:
    """Run the trusted test program (`program(tests)`, by default each source in order) against the solution."""
    trees = {name: _parse(source, name, fmt) for name, source in sources.items()}  # malformed: before anything runs
    with _session(solution, limits, setup) as session:
        tests = _Tests(session, sources, trees)
        try:
            if program is not None:
                program(tests)
            else:
                for name in sources:
                    tests.run(name)
        except (Exception, SessionFailed, SystemExit) as e:  # SystemExit: a test that calls sys.exit()
            raise CodeRewardFailure(tests.reason(e)) from None
        if session.failure is not None:  # the test code caught the failure (a bare except): still a failure
            raise CodeRewardFailure(session.failure)


def _judge_asserts(solution: str, answer: dict, limits: SandboxLimits) -> None:
    _judge_tests(solution, limits, "asserts", {"<test>": _field(answer, "asserts", "tests", str)})


def _judge_mbpp(solution: str, answer: dict, limits: SandboxLimits) -> None:
    asserts = _field(answer, "mbpp", "test_list", list)
    setup = "\n".join(_field(answer, "mbpp", "test_imports", list, [])) + "\n" + \
        _field(answer, "mbpp", "test_setup_code", str, "")
    # The setup code (and the imports) defines what the asserts use, so it runs here, with them: what decides the
    # verdict must not be the solution's to patch. It also runs in the sandbox before the solution, as in MBPP's own
    # harness (one namespace), because solutions may use what it defines. Objects of classes it defines cannot
    # cross between the two (not plain data): such tests fail with that reason.
    _judge_tests(solution, limits, "mbpp", {"<setup>": setup, "<test>": "\n".join(asserts)}, setup=setup)


def _judge_humaneval(solution: str, answer: dict, limits: SandboxLimits) -> None:
    test, entry = _field(answer, "humaneval", "test", str), _identifier(answer, "humaneval", "entry_point")
    if not any(isinstance(node, ast.FunctionDef) and node.name == "check"
               for node in _parse(test, "<test>", "humaneval").body):
        raise ValueError("reward code: format 'humaneval': the field 'test' must define check(candidate)")

    def program(tests: _Tests) -> None:
        tests.run("<prompt>")  # its helpers (poly, encode_cyclic...) are the tests', and a stub of the entry point
        tests.namespace[entry] = candidate = _Function(tests.session, entry)  # the solution's, whatever the prompt's
        tests.run("<test>")
        tests.namespace["check"](candidate)

    _judge_tests(solution, limits, "humaneval", {"<prompt>": _field(answer, "humaneval", "prompt", str, ""),
                                                 "<test>": test}, program)


def _call_case(args, want) -> tuple[list, object]:
    """(arguments, expected value) of one function-call case; a string input is LiveCodeBench's functional style."""
    if isinstance(args, list):
        return args, want
    if not isinstance(args, str) or not isinstance(want, str):
        raise ValueError("reward code: format 'call': each input must be a list of arguments, or (LiveCodeBench) a "
                         "string of newline-separated JSON arguments with a JSON string as its output")
    try:
        return [json.loads(line) for line in args.split("\n") if line.strip()], json.loads(want)
    except json.JSONDecodeError as e:
        raise ValueError(f"reward code: format 'call': a LiveCodeBench case is not JSON ({e})") from None


def _as_json(v):
    """Tuples as lists (the expected values come from JSON)."""
    if isinstance(v, (list, tuple)):
        return [_as_json(x) for x in v]
    if isinstance(v, dict):
        return {k: _as_json(x) for k, x in v.items()}
    return v


def _judge_calls(solution: str, answer: dict, limits: SandboxLimits) -> None:
    name = _identifier(answer, "call", "fn_name")
    cases = [_call_case(args, want) for args, want in zip(*_cases(answer, "call"))]
    with _session(solution, limits) as session:
        for i, (args, want) in enumerate(cases):
            where = f"case {i + 1} of {len(cases)}"
            try:
                value = session.call(name, args)
            except (Exception, SessionFailed) as e:
                raise CodeRewardFailure(f"{where}: {session.failure or f'{name} raised {type(e).__name__}: {e}'}") \
                    from None
            if _as_json(value) != want:
                raise CodeRewardFailure(f"{where}: {name} returned {show(value)}, expected {show(want)}")


def _normalise_output(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _text(case) -> str:
    """A stdio case's text: APPS / TACO store some as lists of lines (their harness joins them with newlines)."""
    return "\n".join(map(str, case)) if isinstance(case, list) else str(case)


def _judge_stdio(solution: str, answer: dict, limits: SandboxLimits) -> None:
    inputs, outputs = _cases(answer, "stdio")
    for i, (stdin, want) in enumerate(zip(inputs, outputs)):
        stdin, want = _text(stdin), _text(want)
        result = run_python(solution, stdin=stdin, limits=limits)
        if not result.ok:
            raise CodeRewardFailure(f"case {i + 1} of {len(inputs)}: {result.reason}")
        if _normalise_output(result.stdout) != _normalise_output(want):
            raise CodeRewardFailure(f"case {i + 1} of {len(inputs)}: wrong output {show(result.stdout)}, expected "
                                    f"{show(want)}")


_JUDGES = {"asserts": _judge_asserts, "call": _judge_calls, "humaneval": _judge_humaneval, "mbpp": _judge_mbpp,
           "stdio": _judge_stdio}


@register_reward("code")
def code_reward(response: str, answer, **kwargs) -> float:
    """1.0 when the response's code passes every test of `answer`; otherwise raises CodeRewardFailure."""
    if answer is None:
        raise ValueError("reward code needs tests as the answer for every prompt (data.answer_key)")
    limits = limits_from(kwargs)
    fmt, fields = parse_answer(answer)
    _JUDGES[fmt](extract_code(response), fields, limits)
    return 1.0


code_reward.requires_sandbox = True  # RewardPool probes the sandbox at start-up (fail closed)
