"""The code reward's trusted-tests design: the dataset's test program runs in the reward process with real assert
semantics, the solution is loaded once per sample in the sandbox and its functions are called by name with plain data
in and out. HumanEval's 164 problems in their own format, each answer format, what a solution may return, per-call
limits, state within and across samples, and the ways a solution could try to decide its own verdict."""
import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest

from megarl.rewards.code import CodeRewardFailure, code_reward
from megarl.sandbox import cgroups

pytestmark = pytest.mark.unit

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/<package>/ -> repo
SLACK_S = 5  # start-up, kill and clean-up on a loaded 2-core machine
TESTS = "assert add(1, 2) == 3\nassert add(-1, 1) == 0"
GOOD = "def add(a, b):\n    return a + b"


def _solution(code: str) -> str:
    return f"Here it is:\n```python\n{code}\n```"


def _fails(code: str, answer, reason: str, **limits) -> str:
    """The code scores 0: CodeRewardFailure whose message matches `reason`; returns the message."""
    with pytest.raises(CodeRewardFailure, match=reason) as raised:
        code_reward(_solution(code), answer, **limits)
    return str(raised.value)


@pytest.fixture(scope="module")
def bench():
    """benchmarks/sandbox.py, whose HumanEval helpers (problems, perturbation, original harness) the test shares."""
    spec = importlib.util.spec_from_file_location("bench_sandbox", os.path.join(ROOT, "benchmarks", "sandbox.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------------------------------------------ HumanEval


def test_humaneval_all_164_problems_in_their_own_format(bench):
    """Every canonical solution scores 1 with the problem's own test, check(candidate) and entry point (before this
    design every one was refused); every perturbed solution (its entry point's results changed) scores 0 exactly
    where the original harness (solution + test + check(entry_point) in one process, run in the sandbox) fails it."""
    problems = bench.humaneval_problems()
    assert len(problems) == 164
    check = bench.humaneval_check(problems)
    assert check["canonical_failed"] == {}
    assert check["perturbed_failed_by_original"], "the perturbation must be caught somewhere to test anything"
    assert check["perturbed_scored_0"] == check["perturbed_failed_by_original"]


HUMANEVAL_POLY = {
    "format": "humaneval", "entry_point": "find_zero",
    "prompt": "def poly(xs, x):\n    return sum(c * x ** i for i, c in enumerate(xs))\n\n\n"
              "def find_zero(xs):\n    \"\"\"A zero of the polynomial.\"\"\"\n",
    "test": "METADATA = {}\n\n\ndef check(candidate):\n    import math\n    for xs in ([1, 2], [-6, 11, -6, 1]):\n"
            "        assert math.fabs(poly(xs, candidate(xs))) < 1e-4\n",
}


def test_humaneval_helpers_of_the_prompt_are_the_tests_not_the_solutions():
    """HumanEval/32's shape: the test judges with the prompt's poly. The prompt runs on the trusted side, so a
    solution that redefines poly to vanish everywhere cannot pass with a wrong root."""
    honest = ("def poly(xs, x):\n    return sum(c * x ** i for i, c in enumerate(xs))\n\n"
              "def find_zero(xs):\n    lo, hi = -10.0, 10.0\n    while hi - lo > 1e-10:\n"
              "        mid = (lo + hi) / 2\n        if poly(xs, lo) * poly(xs, mid) <= 0:\n            hi = mid\n"
              "        else:\n            lo = mid\n    return lo")
    assert code_reward(_solution(honest), HUMANEVAL_POLY) == 1.0
    forger = "def poly(xs, x):\n    return 0\n\ndef find_zero(xs):\n    return 123.0"
    _fails(forger, HUMANEVAL_POLY, r"test line 7 .*assertion failed \(last call: find_zero\(\[1, 2\]\) returned 123.0")
    # the entry point is the solution's even where the test calls it by name (HumanEval/33) and the prompt has a stub
    by_name = {"format": "humaneval", "entry_point": "inc", "prompt": "def inc(x):\n    \"\"\"x + 1\"\"\"\n",
               "test": "def check(candidate):\n    assert inc(1) == 2 and candidate(2) == 3\n"}
    assert code_reward(_solution("def inc(x):\n    return x + 1"), by_name) == 1.0


# ---------------------------------------------------------------------------------------------------- the formats

ASSERTS = ("import math\n"
           "assert abs(area(2) - 4 * math.pi) < 1e-6\n"
           "assert True\n"
           "assert tuple(pair()) == tuple([1, 2])\n"
           "assert is_even(2) is True and is_even(3) is False\n"
           "for n in range(5):\n    assert is_even(2 * n), n\n"
           "def is_sorted(xs):\n    return all(a <= b for a, b in zip(xs, xs[1:]))\n"
           "assert is_sorted(sort_list([3, 1, 2])) and isinstance(sort_list([]), list)\n"
           "assert all(a == b for a, b in zip(sort_list([2, 1]), [1, 2]))\n"
           "assert area(1) > 3 and math.isclose(area(1), math.pi)\n")
ASSERTS_GOOD = ("import math\ndef area(r):\n    return math.pi * r * r\ndef pair():\n    return (1, 2)\n"
                "def is_even(n):\n    return n % 2 == 0\ndef sort_list(xs):\n    return sorted(xs)")
FORMATS = {
    "asserts": ({"format": "asserts", "tests": ASSERTS}, ASSERTS_GOOD,
                ASSERTS_GOOD.replace("n % 2 == 0", "n % 2 == 0 or n == 3")),
    "mbpp": ({"format": "mbpp", "test_imports": ["import math"], "test_setup_code": "def square(x):\n    return x * x",
              "test_list": ["assert hyp(3, 4) == 5.0", "assert square(hyp(6, 8)) == 100.0"]},
             "def hyp(a, b):\n    return math.sqrt(square(a) + square(b))",  # uses the setup's import and helper
             "def hyp(a, b):\n    return float(a + b)"),
    "humaneval": ({"format": "humaneval", "entry_point": "total", "prompt": "def total(xs):\n    \"\"\"Sum.\"\"\"\n",
                   "test": "METADATA = {'author': 'x'}\n\ndef check(candidate):\n    assert candidate([1, 2]) == 3\n"
                           "    assert candidate([]) == 0\n"},
                  "def total(xs):\n    return sum(xs)", "def total(xs):\n    return sum(xs) or 1"),
    "call": ({"format": "call", "fn_name": "f", "inputs": [[1, 2], [3, 4]], "outputs": [[3, [1, 2]], [7, [3, 4]]]},
             "def f(a, b):\n    return [a + b, (a, b)]", "def f(a, b):\n    return [a + b, (b, a)]"),
    "call (LiveCodeBench functional)": (
        {"format": "call", "fn_name": "twoSum", "inputs": ["[2, 7, 11]\n9", "[3, 3]\n6"],
         "outputs": ["[0, 1]", "[0, 1]"]},
        "class Solution:\n    def twoSum(self, nums, target):\n        seen = {}\n"
        "        for i, x in enumerate(nums):\n            if target - x in seen:\n"
        "                return [seen[target - x], i]\n            seen[x] = i",
        "class Solution:\n    def twoSum(self, nums, target):\n        return [1, 0]"),
    "stdio": ({"format": "stdio", "inputs": ["1 2\n", "3 4\n"], "outputs": ["3\n", "7"]},
              "import sys\nprint(sum(map(int, sys.stdin.read().split())), '  ')\nprint()",  # trailing blanks: ignored
              "import sys\nprint(sum(map(int, sys.stdin.read().split())))\nprint('extra')"),
}


@pytest.mark.parametrize("name", list(FORMATS))
def test_each_format_scores_a_correct_solution_1_and_a_wrong_one_0(name):
    answer, good, wrong = FORMATS[name]
    assert code_reward(_solution(good), answer) == 1.0
    assert code_reward(_solution(good), json.dumps(answer)) == 1.0  # the dict's JSON is the same answer
    with pytest.raises(CodeRewardFailure):
        code_reward(_solution(wrong), answer)


def test_todays_string_answers_still_work():
    assert code_reward(_solution(GOOD), TESTS) == 1.0  # assert test code
    stdio = {k: v for k, v in FORMATS["stdio"][0].items() if k != "format"}
    assert code_reward(_solution(FORMATS["stdio"][1]), json.dumps(stdio)) == 1.0
    calls = {k: v for k, v in FORMATS["call"][0].items() if k != "format"}
    assert code_reward(_solution(FORMATS["call"][1]), json.dumps(calls)) == 1.0
    _fails(FORMATS["call"][2], json.dumps(calls), r"case 1 of 2: f returned \[3, \(2, 1\)\], expected \[3, \[1, 2\]\]")
    _fails(FORMATS["stdio"][2], json.dumps(stdio), "case 1 of 2: wrong output")
    _fails(FORMATS["stdio"][1] + "\nraise SystemExit(3)", json.dumps(stdio), "case 1 of 2: exit code 3")


@pytest.mark.parametrize("answer, message", [
    ({"format": "junit", "tests": "assert True"},
     "the answer's 'format' is 'junit'; accepted: asserts, call, humaneval, mbpp, stdio"),
    ({"tests": "assert True"}, "the answer's 'format' is None; accepted"),
    ({"format": "humaneval", "test": "def check(candidate):\n    pass"}, "format 'humaneval' needs the field "
                                                                        "'entry_point'"),
    ({"format": "humaneval", "test": "assert True", "entry_point": "f"}, "must define check"),
    ({"format": "humaneval", "test": "def check(c):\n    pass", "entry_point": "not a name"}, "Python identifier"),
    ({"format": "mbpp", "test_list": "assert f() == 1"}, "'test_list' must be a list of strings"),
    ({"format": "asserts", "tests": "assert f(("}, "format 'asserts': test does not parse"),
    ({"format": "stdio", "inputs": ["1"], "outputs": []}, "non-empty lists of the same length"),
    ({"format": "call", "fn_name": "f", "inputs": [3], "outputs": [3]}, "each input must be a list of arguments"),
    ("{not json", "not valid JSON"),
    (["assert True"], "must be a dict"),
])
def test_unknown_formats_and_malformed_answers_are_value_errors(answer, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")) as raised:
        code_reward(_solution(GOOD), answer)
    assert not isinstance(raised.value, CodeRewardFailure)  # the dataset's fault, not the solution's


# --------------------------------------------------------------------------------- what crosses the boundary back


@pytest.mark.parametrize("code, reason", [
    ("class Any:\n    def __eq__(self, other):\n        return True\ndef add(a, b):\n    return Any()",
     r"add\(1, 2\) returned a Any, which is not plain data"),
    ("class I(int):\n    pass\ndef add(a, b):\n    return I(a + b)", "returned a I, which is not plain data"),
    ("class S(str):\n    def __eq__(self, other):\n        return True\ndef add(a, b):\n    return S('3')",
     "returned a S, which is not plain data"),
    ("class L(list):\n    pass\ndef add(a, b):\n    return [L([a + b])]", "returned a L, which is not plain data"),
    ("def add(a, b):\n    yield a + b", "returned a generator, which is not plain data"),
    ("def add(a, b):\n    return add", "returned a function, which is not plain data"),
    ("def add(a, b):\n    x = [a + b]\n    x.append(x)\n    return x", "returned a recursive list"),
    ("def add(a, b):\n    return 'x' * (2 << 20)", r"its result is \d+ bytes encoded, over result_bytes=1048576"),
])
def test_only_plain_data_comes_back(code, reason):
    _fails(code, TESTS, reason)


def test_exact_types_are_kept_both_ways():
    tests = ("assert echo((1, 2)) == (1, 2) and echo([1, 2]) == [1, 2] and echo((1, 2)) != [1, 2]\n"
             "assert echo(True) is True and type(echo(1)) is int and echo(b'\\x00') == b'\\x00'\n"
             "assert echo({1: {2, 3}, 'k': frozenset([4])}) == {1: {2, 3}, 'k': frozenset([4])}\n"
             "import math\nassert math.isnan(echo(float('nan'))) and echo(-math.inf) == -math.inf\n"
             "assert echo(10 ** 30) == 10 ** 30 and echo('\\udc80') == '\\udc80'")
    assert code_reward(_solution("def echo(x):\n    return x"), tests) == 1.0
    assert code_reward(_solution("def add(a, b):\n    return float(a + b)"), TESTS) == 1.0  # 3.0 == 3, as in Python
    _fails("def echo(x):\n    return list(x) if type(x) is tuple else x", tests,
           r"line 1 .*assertion failed \(last call: echo\(\(1, 2\)\) returned \[1, 2\]\)")
    _fails("def echo(x):\n    return 1 if x is True else x", tests, "line 2")


def test_printing_the_expected_value_does_not_reach_the_judge():
    code = ("import sys, json\ndef add(a, b):\n    print(3)\n    sys.__stdout__.write('3\\n')\n"
            "    print(json.dumps({'v': 3}), file=sys.stderr)\n    return 0")
    _fails(code, TESTS,
           r"test line 1 `assert add\(1, 2\) == 3`: assertion failed \(last call: add\(1, 2\) returned 0\)")


def test_asserts_hold_under_python_dash_o():
    """python -O strips asserts from code compiled with the defaults, which would pass every test: the trusted test
    program is compiled to keep them."""
    code = ("from megarl.rewards.code import CodeRewardFailure, code_reward\n"
            "try:\n    code_reward('def add(a, b):\\n    return 0', 'assert add(1, 2) == 3')\n"
            "except CodeRewardFailure as e:\n    print('failed:', e)\n")
    out = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.stdout.startswith("failed: test line 1 `assert add(1, 2) == 3`: assertion failed"), out


def test_builtins_the_tests_judge_with_are_never_the_solutions():
    code = "def abs(x):\n    return 0\ndef all(x):\n    return True\ndef add(a, b):\n    return 0"
    _fails(code, {"format": "asserts", "tests": "assert abs(add(1, 2) - 3) < 1e-9"}, "assertion failed")
    _fails(code, {"format": "asserts", "tests": "assert all([add(1, 2) == 3])"}, "assertion failed")


# ------------------------------------------------------------------------------------------ exceptions and exits


def test_exceptions_the_tests_expect_and_those_they_do_not():
    tests = ("try:\n    div(1, 0)\nexcept ZeroDivisionError:\n    pass\nelse:\n    raise AssertionError('no error')\n"
             "assert div(6, 3) == 2")
    assert code_reward(_solution("def div(a, b):\n    return a // b"), tests) == 1.0
    _fails("def div(a, b):\n    return a // b if b else 0", tests, "AssertionError: no error")
    _fails("class Oops(Exception):\n    pass\ndef add(a, b):\n    raise Oops('no')", TESTS,
           r"SolutionError: Oops: no \(last call: add\(1, 2\) raised Oops\)")


def test_control_flow_exceptions_and_unencodable_arguments_cannot_decide_the_verdict():
    """A StopIteration raised into the trusted test would end the iteration that called the solution (all(...) True,
    sum(...) 0); a non-plain argument's TypeError would be one the test may expect from the solution."""
    tests = "assert all(map(is_odd, [1, 3, 5]))\nassert sum(map(is_odd, [2, 4])) == 0"
    assert code_reward(_solution("def is_odd(n):\n    return n % 2 == 1"), tests) == 1.0
    _fails("def is_odd(n):\n    raise StopIteration", tests, "SolutionError: StopIteration")
    _fails("def is_odd(n):\n    raise StopAsyncIteration", tests, "SolutionError: StopAsyncIteration")
    expects_type_error = "try:\n    add(object(), 1)\nexcept TypeError:\n    pass\nelse:\n    assert False"
    _fails(GOOD, expects_type_error, r"add\(\.\.\.\): the test passed a object, which is not plain data")
    _fails(GOOD, "import sys\nsys.exit(0)", "SystemExit")


def test_stdio_cases_written_as_lists_of_lines():
    answer = {"format": "stdio", "inputs": [["2", "3 4"]], "outputs": [["7"]]}  # APPS / TACO store some like this
    solution = "input()\nprint(sum(map(int, input().split())))"
    assert code_reward(_solution(solution), answer) == 1.0
    _fails("input()\nprint(0)", answer, "wrong output")


@pytest.mark.parametrize("code, reason", [
    ("raise ImportError('no such thing')", "loading the solution raised ImportError: no such thing"),
    ("import sys\nsys.exit(0)", "loading the solution raised SystemExit: 0"),
    ("import os\nos._exit(0)", "loading the solution: the solution's process ended: exit code 0"),
    ("import sys\ndef add(a, b):\n    sys.exit(0)", r"SolutionError: SystemExit: 0 \(last call: add\(1, 2\) raised"),
    ("import os\ndef add(a, b):\n    os._exit(0)", r"add\(1, 2\): the solution's process ended: exit code 0"),
    ("import os, signal\ndef add(a, b):\n    os.kill(os.getpid(), signal.SIGKILL)",
     r"add\(1, 2\): the solution's process ended: killed by signal 9"),
    ("if __name__ == '__main__':\n    def add(a, b):\n        return a + b",  # loaded as a module, not run as main
     "NameError: the solution defines no 'add'"),
    ("import threading\ndef define():\n    global add\n    add = lambda a, b: a + b\n"
     "threading.Timer(30, define).start()",  # 30 s: after the session's whole wall clock (10 s)
     "NameError: the solution defines no 'add'"),
])
def test_early_exits_and_failed_loading_score_0(code, reason):
    _fails(code, TESTS, reason)
    _fails(code, {"format": "humaneval", "entry_point": "add",
                  "test": "def check(candidate):\n    assert candidate(1, 2) == 3\n"}, reason)


def test_a_test_that_swallows_the_failure_still_fails():
    tests = "try:\n    add(1, 2)\nexcept BaseException:\n    pass\nassert True"
    assert code_reward(_solution(GOOD), tests) == 1.0
    _fails("def add(a, b):\n    yield 3", tests, "returned a generator")
    _fails("import time\ndef add(a, b):\n    time.sleep(1000)", tests, r"time limit \(wall 1 s per call\)",
           call_wall_s=1)


# ---------------------------------------------------------------------------------------------- limits and state


def test_a_call_that_sleeps_forever_hits_the_per_call_wall_limit():
    start = time.monotonic()
    _fails("import time\ndef add(a, b):\n    time.sleep(1000)", TESTS, r"add\(1, 2\): time limit \(wall 1 s per call\)",
           call_wall_s=1)
    assert time.monotonic() - start < 1 + SLACK_S
    _fails("import time\ntime.sleep(1000)", TESTS, r"loading the solution: time limit \(wall 1 s per call\)",
           call_wall_s=1)
    # many calls, each within its limit: the session's whole wall clock
    _fails("import time\ndef add(a, b):\n    time.sleep(0.5)\n    return a + b",
           "for _ in range(20):\n    assert add(1, 2) == 3", r"time limit \(wall 3 s in total\)", wall_s=3)


def test_a_call_that_burns_cpu_hits_the_per_call_cpu_limit():
    # with a cgroup the call's own CPU time is watched; without one the session's RLIMIT_CPU stops it
    reason = r"add\(1, 2\): cpu limit \(1 s per call\)" if cgroups.available() else r"cpu limit \(3 s\)"
    start = time.monotonic()
    message = _fails("def add(a, b):\n    while True:\n        pass", TESTS, reason, call_cpu_s=1, cpu_s=3,
                     call_wall_s=60, wall_s=60)
    assert time.monotonic() - start < 3 + SLACK_S, message


def test_state_persists_across_the_calls_of_one_sample_and_not_across_samples():
    counter = ("import os\nn = int(open('/tmp/n').read()) if os.path.exists('/tmp/n') else 0\n"
               "def count():\n    global n\n    n += 1\n    open('/tmp/n', 'w').write(str(n))\n    return n")
    tests = "assert count() == 1\nassert count() == 2\nassert count() == 3"
    assert [code_reward(_solution(counter), tests) for _ in range(2)] == [1.0, 1.0]
    # a function that replaces itself after its first call: the second call is the replacement's
    _fails("def add(a, b):\n    global add\n    add = lambda a, b: a - b\n    return a + b", TESTS,
           r"test line 2 .*\(last call: add\(-1, 1\) returned -2\)")
