"""Reward for code generation, judged outside the judged process.

The response's last ```python (or bare ```) block is the solution, or the whole response when it has none. It runs
in megarl.sandbox; what comes back out is plain data (text, or values encoded as JSON by exact type), and the
comparison with the expected results happens here, in the trusted reward process. The expected results never enter
the sandbox, so nothing the solution can read (its source, its code objects, the harness), print, return (objects
that claim to equal anything) or exit with can forge a pass: it has to produce the right values.

`answer` (the prompt's tests) takes one of three forms, those of public code-RL datasets:

- assert-based test code (MBPP style), e.g. "assert add(1, 2) == 3". Each top-level `assert EXPR == LITERAL` (or
  `LITERAL == EXPR`), `assert EXPR`, `assert not EXPR` and `assert math.isclose(EXPR, LITERAL, ...)` becomes one
  check: only EXPR is evaluated in the sandbox, the LITERAL stays here (a LITERAL may also be a numeric constant
  expression such as `4 * math.pi`, computed here). Other top-level statements (imports, helper definitions,
  assignments) run in the sandbox before the checks. An assert of any other shape cannot be judged outside the
  sandbox and is rejected with a ValueError naming its line (rewrite it as EXPR == LITERAL).
  A check whose expected value can be guessed (`assert EXPR`, `assert not EXPR`, `== True / False / None`) is only
  accepted when EXPR is a call of a function the solution defines (`assert is_prime(7)`): in any other expression
  (`all(a == b for ...)`, `isinstance(...)`, `math.isclose(x, y)` with a computed y, a helper of the test code) the
  verdict would be computed in the sandbox by code the solution can patch (builtins, math, always-equal objects),
  and printing the guessable result line and exiting would forge it;
- stdin/stdout cases (APPS/TACO/CodeContests style): JSON {"inputs": [stdin, ...], "outputs": [stdout, ...]}: one
  sandbox run per case, stopping at the first failure; outputs compare line by line with trailing whitespace and
  trailing blank lines ignored;
- function-call cases: the same with "fn_name": inputs[i] is the list of arguments, outputs[i] the expected return
  value (JSON; tuples in the return value compare as lists).

Passing every check scores 1.0; anything else raises CodeRewardFailure naming the first failed check or the
sandbox's reason, which RewardPool turns into reward 0.0 with the reason logged and counted. SandboxUnavailable is
not a failure of the response and propagates (fail closed).

Limits come from the reward kwargs (reward.kwargs in config): cpu_s, wall_s, memory_mb, file_mb, processes, disk_mb,
output_bytes (see SandboxLimits), per sandbox run.
"""
from __future__ import annotations

import ast
import builtins
import dataclasses
import json
import math

from .functions import register_reward
from ..sandbox import SandboxLimits, run_python

_PYTHON_TAGS = {"", "python", "py", "python3"}
_LIMIT_FIELDS = {f.name for f in dataclasses.fields(SandboxLimits)}
_SOLUTION = "solution.py"
_SHOW = 120  # characters of a value shown in a failure reason


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


# ------------------------------------------------------------------------------------------------- the test spec


@dataclasses.dataclass
class Check:
    expr: str                 # source evaluated in the sandbox
    kind: str                 # "eq", "true", "false", "close"
    expected: object = None   # stays outside the sandbox
    options: dict = dataclasses.field(default_factory=dict)  # isclose's rel_tol / abs_tol
    line: int = 0


_MATH_CONSTANTS = {"pi": math.pi, "e": math.e, "tau": math.tau, "inf": math.inf}
_MATH_FUNCTIONS = {name: getattr(math, name) for name in ("sqrt", "exp", "log", "log2", "log10", "sin", "cos", "tan",
                                                          "asin", "acos", "atan", "atan2", "hypot", "pow", "fabs")}
_ARITHMETIC = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
               ast.Div: lambda a, b: a / b, ast.FloorDiv: lambda a, b: a // b, ast.Mod: lambda a, b: a % b,
               ast.Pow: lambda a, b: a ** b}
_GUESSABLE = (True, False, None)  # expected values a forger would try first


def _numeric(node: ast.AST):
    """A numeric constant expression over numbers, + - * / // % ** (exponent at most 64), math.pi / e / tau / inf and
    math functions of constants, evaluated here (never in the sandbox)."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _numeric(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _ARITHMETIC:
        left, right = _numeric(node.left), _numeric(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:
            raise ValueError("exponent too large")
        return _ARITHMETIC[type(node.op)](left, right)
    if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "math"
            and node.attr in _MATH_CONSTANTS):
        return _MATH_CONSTANTS[node.attr]
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "math" and node.func.attr in _MATH_FUNCTIONS and not node.keywords):
        return _MATH_FUNCTIONS[node.func.attr](*map(_numeric, node.args))
    raise ValueError("not a numeric constant expression")


def _literal(node: ast.AST):
    """(True, value) for a literal or a numeric constant expression, else (False, None)."""
    try:
        return True, ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        pass
    try:
        return True, _numeric(node)
    except (ValueError, TypeError, ArithmeticError, RecursionError):
        return False, None


def _bound_names(setup: list[ast.stmt]) -> set[str]:
    """The names the test code's own statements bind (imports, definitions, assignments)."""
    names = set()
    for stmt in setup:
        for node in ast.walk(stmt):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
    return names


def _calls_the_solution(expr: ast.AST, test_names: set[str]) -> bool:
    """EXPR is a call of a plain name that is neither a builtin nor bound by the test code: the solution's function,
    whose return value (plain data, judged here) is the solution's own answer."""
    return (isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name)
            and expr.func.id not in test_names and not hasattr(builtins, expr.func.id))


def _is_isclose(func: ast.AST) -> bool:
    return (isinstance(func, ast.Name) and func.id == "isclose" or
            isinstance(func, ast.Attribute) and func.attr == "isclose")


def _check(test: ast.Assert, source: str, test_names: set[str]) -> Check:
    cond, line = test.test, test.lineno
    shown = ast.get_source_segment(source, test)[:100]
    check, expr = None, None  # the Check, and the AST of the expression evaluated in the sandbox
    if isinstance(cond, ast.Compare) and len(cond.ops) == 1 and isinstance(cond.ops[0], ast.Eq):
        left, right = cond.left, cond.comparators[0]
        sides = [(side, _literal(other)) for side, other in ((left, right), (right, left))]
        expr, value = next(((side, value) for side, (ok, value) in sides if ok), (None, None))
        if expr is not None:
            check = Check(ast.get_source_segment(source, expr), "eq", value, line=line)
    elif isinstance(cond, ast.Call) and _is_isclose(cond.func):
        ok, value = _literal(cond.args[1]) if len(cond.args) == 2 else (False, None)
        options = {k.arg: _literal(k.value) for k in cond.keywords}
        if not (ok and all(k in ("rel_tol", "abs_tol") and good for k, (good, _) in options.items())):
            raise ValueError(f"reward code: test line {line} `{shown}`: isclose needs (EXPR, LITERAL) with a literal "
                             "or numeric constant (e.g. 4 * math.pi) as the expected value and literal rel_tol / "
                             "abs_tol, so that the comparison happens outside the sandbox")
        expr = cond.args[0]
        check = Check(ast.get_source_segment(source, expr), "close", value, {k: v for k, (_, v) in options.items()},
                      line=line)
    elif isinstance(cond, ast.UnaryOp) and isinstance(cond.op, ast.Not):
        expr = cond.operand
        check = Check(ast.get_source_segment(source, expr), "false", line=line)
    elif not isinstance(cond, (ast.Compare, ast.BoolOp)):
        expr = cond
        check = Check(ast.get_source_segment(source, expr), "true", line=line)
    if check is None:
        raise ValueError(f"reward code: test line {line} `{shown}` cannot be judged outside the sandbox; write it as "
                         "`assert EXPR == LITERAL` (or use stdin/stdout or function-call cases)")
    guessable = check.kind in ("true", "false") or (check.kind == "eq" and any(
        type(check.expected) is type(g) and check.expected == g for g in _GUESSABLE))
    if guessable and not _calls_the_solution(expr, test_names):
        raise ValueError(f"reward code: test line {line} `{shown}` expects a true / false / None result of "
                         f"`{check.expr[:60]}`, which would be computed in the sandbox by code the solution can "
                         "patch; such a check must call the solution's own function (`assert is_prime(7)`), or "
                         "compare with a literal result (`assert sorted_list(x) == [1, 2]`)")
    return check


def parse_tests(tests: str) -> tuple[str, list[Check]]:
    """Assert-based test code -> (setup code run in the sandbox, checks judged here)."""
    try:
        tree = ast.parse(tests)
    except SyntaxError as e:
        raise ValueError(f"reward code: the test code does not parse (line {e.lineno}: {e.msg})") from None
    setup = [stmt for stmt in tree.body if not isinstance(stmt, ast.Assert)]
    test_names = _bound_names(setup)
    checks = [_check(stmt, tests, test_names) for stmt in tree.body if isinstance(stmt, ast.Assert)]
    if not checks:
        raise ValueError("reward code: the test code has no top-level assert to check")
    return "\n".join(ast.get_source_segment(tests, stmt) for stmt in setup), checks


def parse_cases(answer) -> dict | None:
    """The {"inputs", "outputs"[, "fn_name"]} cases in `answer` (a dict or its JSON), or None for test code."""
    if isinstance(answer, str):
        if not answer.lstrip().startswith("{"):
            return None
        try:
            answer = json.loads(answer)
        except json.JSONDecodeError as e:
            raise ValueError(f"reward code: the answer starts with '{{' but is not valid JSON cases ({e})") from None
    if not isinstance(answer, dict) or not {"inputs", "outputs"} <= set(answer):
        raise ValueError("reward code: the answer must be assert-based test code or a JSON object with 'inputs' and "
                         "'outputs' (and 'fn_name' for function-call cases)")
    if len(answer["inputs"]) != len(answer["outputs"]) or not answer["inputs"]:
        raise ValueError("reward code: 'inputs' and 'outputs' must be non-empty lists of the same length")
    return answer


# ------------------------------------------------------------------------------------ plain data across the boundary

# Runs in the sandbox after the solution: evaluates each expression and prints the values, encoded by exact type
# (subclasses and other objects are refused), as one JSON line. Values only: whatever this prints is compared here
# with results the sandbox never sees, so tampering with it gains nothing.
_HARNESS = r'''
import json, sys
def encode(v):
    t = type(v)
    if v is None or t in (bool, int, str):
        return v
    if t is float:
        return {"f": repr(v)}
    if t is list:
        return [encode(x) for x in v]
    if t is tuple:
        return {"t": [encode(x) for x in v]}
    if t in (set, frozenset):
        return {"s": [encode(x) for x in v]}
    if t is dict:
        return {"d": [[encode(k), encode(x)] for k, x in v.items()]}
    if t is bytes:
        return {"b": v.hex()}
    raise TypeError("a %s is not plain data (None, bool, int, float, str, bytes, list, tuple, set, dict)" % t.__name__)
stdout, sys.stdout = sys.stdout, sys.stderr  # the solution's own prints go to stderr
namespace = {"__name__": "__main__", "__file__": SOLUTION, "__builtins__": __builtins__, "json": json}
exec(compile(open(SOLUTION, encoding="utf-8").read(), SOLUTION, "exec"), namespace)
exec(compile(SETUP, "tests.py", "exec"), namespace)
results = []
for expr in EXPRS:
    try:
        results.append({"v": encode(eval(expr, namespace))})
    except BaseException as e:
        results.append({"e": ("%s: %s" % (type(e).__name__, e))[:300]})
stdout.write("\n" + json.dumps({"results": results}) + "\n")
stdout.flush()
'''


def _decode(v):
    if isinstance(v, list):
        return [_decode(x) for x in v]
    if isinstance(v, dict):
        (tag, x), = v.items()
        return {"f": lambda: float(x), "t": lambda: tuple(map(_decode, x)), "s": lambda: set(map(_decode, x)),
                "d": lambda: {_decode(k): _decode(y) for k, y in x}, "b": lambda: bytes.fromhex(x)}[tag]()
    if v is None or type(v) in (bool, int, str):
        return v
    raise ValueError(f"not an encoded value: {v!r}")


def _as_json(v):
    """Tuples as lists (function-call cases: expected values come from JSON)."""
    if isinstance(v, (list, tuple)):
        return [_as_json(x) for x in v]
    if isinstance(v, dict):
        return {k: _as_json(x) for k, x in v.items()}
    return v


def _show(v) -> str:
    text = repr(v)
    return text if len(text) <= _SHOW else text[:_SHOW] + "..."


def _evaluate(solution: str, setup: str, exprs: list[str], limits: SandboxLimits) -> list:
    """Run the solution and evaluate `exprs` after it in the sandbox; the decoded values (or raises
    CodeRewardFailure)."""
    harness = f"SOLUTION = {_SOLUTION!r}\nSETUP = {setup!r}\nEXPRS = {exprs!r}\n{_HARNESS}"
    result = run_python(harness, limits=limits, files={_SOLUTION: solution})
    if not result.ok:
        raise CodeRewardFailure(result.reason)
    lines = result.stdout.rstrip("\n").rsplit("\n", 1)
    try:
        results = json.loads(lines[-1])["results"]
        if not isinstance(results, list) or len(results) != len(exprs):
            raise ValueError("wrong number of results")
        values = []
        for i, r in enumerate(results):
            if "e" in r:
                raise CodeRewardFailure(f"test {i + 1} of {len(exprs)} `{exprs[i][:80]}` raised {str(r['e'])[:300]}")
            values.append(_decode(r["v"]))
    except CodeRewardFailure:
        raise
    except Exception as e:  # anything the solution could have made the harness print
        raise CodeRewardFailure(f"the test harness produced no readable results ({type(e).__name__})") from None
    return values


def _passes(check: Check, value) -> bool:
    if check.kind == "eq":
        return value == check.expected
    if check.kind == "true":
        return bool(value)
    if check.kind == "false":
        return not value
    return (type(value) in (int, float) and type(check.expected) in (int, float)
            and math.isclose(value, check.expected, **check.options))


# ------------------------------------------------------------------------------------------------------- judging


def _judge_asserts(solution: str, tests: str, limits: SandboxLimits) -> None:
    setup, checks = parse_tests(tests)
    values = _evaluate(solution, setup, [c.expr for c in checks], limits)
    for i, (check, value) in enumerate(zip(checks, values)):
        if not _passes(check, value):
            want = {"eq": f"== {_show(check.expected)}", "true": "a true value", "false": "a false value",
                    "close": f"close to {_show(check.expected)}"}[check.kind]
            raise CodeRewardFailure(f"test {i + 1} of {len(checks)} (line {check.line}) `{check.expr[:80]}`: "
                                    f"got {_show(value)}, expected {want}")


def _judge_calls(solution: str, cases: dict, limits: SandboxLimits) -> None:
    name = cases["fn_name"]
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"reward code: fn_name {name!r} must be a Python identifier")
    if not all(isinstance(args, list) for args in cases["inputs"]):
        raise ValueError("reward code: with fn_name, each of 'inputs' must be the list of the call's arguments")
    exprs = [f"{name}(*json.loads({json.dumps(args)!r}))" for args in cases["inputs"]]
    values = _evaluate(solution, "", exprs, limits)
    for i, (value, want) in enumerate(zip(values, cases["outputs"])):
        if _as_json(value) != want:
            raise CodeRewardFailure(f"case {i + 1} of {len(values)}: {name} returned {_show(value)}, expected "
                                    f"{_show(want)}")


def _normalise_output(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _judge_stdio(solution: str, cases: dict, limits: SandboxLimits) -> None:
    n = len(cases["inputs"])
    for i, (stdin, want) in enumerate(zip(cases["inputs"], cases["outputs"])):
        result = run_python(solution, stdin=str(stdin), limits=limits)
        if not result.ok:
            raise CodeRewardFailure(f"case {i + 1} of {n}: {result.reason}")
        if _normalise_output(result.stdout) != _normalise_output(str(want)):
            raise CodeRewardFailure(f"case {i + 1} of {n}: wrong output {_show(result.stdout)}, expected "
                                    f"{_show(str(want))}")


@register_reward("code")
def code_reward(response: str, answer, **kwargs) -> float:
    """1.0 when the response's code passes every check of `answer` (judged here, outside the sandbox); otherwise
    raises CodeRewardFailure."""
    if answer is None:
        raise ValueError("reward code needs tests as the answer for every prompt (data.answer_key)")
    limits = limits_from(kwargs)
    solution = extract_code(response)
    cases = parse_cases(answer)
    if cases is None:
        _judge_asserts(solution, answer, limits)
    elif "fn_name" in cases:
        _judge_calls(solution, cases, limits)
    else:
        _judge_stdio(solution, cases, limits)
    return 1.0


code_reward.requires_sandbox = True  # RewardPool probes the sandbox at start-up (fail closed)
