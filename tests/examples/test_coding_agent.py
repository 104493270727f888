"""The coding-agent example's data: MBPP-format tasks whose reference solutions pass their hidden tests, and SFT
trajectories (draft -> run -> fix -> submit) whose tool outputs are what the sandboxed tool prints, trained on the
model's turns only."""
import json

import pytest

from megarl.data import ChatTokenizer, load_prompts, load_sft_samples
from megarl.examples.coding_agent import write
from megarl.rewards.code import code_reward
from megarl.trainer.config import DataConfig

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write(str(tmp_path_factory.mktemp("coding-agent")), tasks=12, held_out=4, seed=3)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from megarl.models.tiny import write_char_tokenizer

    path = tmp_path_factory.mktemp("tok")
    write_char_tokenizer(str(path))
    return ChatTokenizer.from_pretrained(str(path))


def _rows(path):
    return [json.loads(line) for line in open(path)]


def test_tasks_are_mbpp_records_the_code_reward_judges(data, tok):
    train, held_out = _rows(data["train"]), _rows(data["eval"])
    assert len(train) == 12 and len(held_out) == 4
    assert not {r["text"] for r in train} & {r["text"] for r in held_out}
    records = load_prompts(data["eval"], tok, DataConfig(prompt_key="text", answer_format="mbpp"))
    for row, record in zip(held_out, records):
        assert code_reward(f"```python\n{row['code']}```", record.answer) == 1.0
        wrong = row["code"].replace("return ", "return 1 + ")
        assert _fails(wrong, record.answer)


def _fails(solution, answer) -> bool:
    from megarl.rewards.code import CodeRewardFailure

    with pytest.raises(CodeRewardFailure):
        code_reward(f"```python\n{solution}```", answer)
    return True


def test_trajectories_run_fix_submit_with_real_tool_outputs(data, tok):
    trajectories = [r["messages"] for r in _rows(data["sft"])]
    fixed = 0
    for messages, task in zip(trajectories, _rows(data["train"])):
        calls = [m for m in messages if m.get("tool_calls")]
        outputs = [m["content"] for m in messages if m["role"] == "tool"]
        assert len(calls) == len(outputs) in (1, 2)
        f = {}
        exec(task["code"], f)  # noqa: S102 - our own generated reference solution
        expected = " ".join(str(f["f"](x)) for x in (1, 2, 12)) + "\n"
        assert outputs[-1] == expected  # the last run is the reference solution's, printed by the sandbox
        if len(outputs) == 2:
            assert outputs[0] != expected  # the draft was wrong, and the run showed it
            fixed += 1
        assert messages[-1] == {"role": "assistant", "content": f"```python\n{task['code']}```"}
    assert 0 < fixed < len(trajectories)
    samples = load_sft_samples(data["sft"], tok, DataConfig())
    for sample, messages in zip(samples, trajectories):
        trained = tok.tok.decode([t for t, m in zip(sample.input_ids, sample.loss_mask) if m])
        assert messages[-1]["content"] in trained
        for m in messages:
            if m["role"] == "tool":
                assert m["content"].strip() not in trained  # observations carry no loss


def test_too_many_tasks_is_an_error_not_a_hang(tmp_path):
    with pytest.raises(ValueError, match=r"distinct tasks exist, fewer than --tasks 5000"):
        write(str(tmp_path), tasks=5000, held_out=40)
