"""reasoning-gym as a data source and reward, and Hugging Face dataset folders with column mappings."""
import json

import pytest

from megarl.config import ConfigError
from megarl.data import DataError, load_prompts, load_sft_samples, prompt_source, read_records
from megarl.data.reasoning_gym import problem_splits
from megarl.rewards import RewardPool
from megarl.rewards.reasoning_gym import reasoning_gym_reward
from megarl.trainer.config import DataConfig, ReasoningGymConfig, load_train_config

pytestmark = pytest.mark.unit


def _data(**rg) -> DataConfig:
    return DataConfig(train="reasoning_gym", reasoning_gym=ReasoningGymConfig(**rg))


def test_splits_are_reasoning_gyms_problems_and_disjoint():
    import reasoning_gym

    cfg = ReasoningGymConfig(task="basic_arithmetic", config={"min_terms": 2, "max_terms": 2, "min_digits": 1,
                                                             "max_digits": 1}, size=150, eval_size=40, seed=3)
    train, held_out = problem_splits(cfg)
    assert len(train) == 150 and len(held_out) == 40
    # the same problems reasoning-gym itself generates for this config and seed
    ref = reasoning_gym.create_dataset("basic_arithmetic", min_terms=2, max_terms=2, min_digits=1, max_digits=1,
                                       seed=3, size=150)
    assert [e["question"] for _, _, e in train] == [ref[i]["question"] for i in range(150)]
    # 2 one-digit terms and 2 operators: a small space, so the eval seed draws training questions, which are skipped
    train_q = {e["question"] for _, _, e in train}
    assert not train_q & {e["question"] for _, _, e in held_out}
    assert held_out[-1][1] >= 40  # some candidates were skipped: the check is not vacuous here
    assert len({e["question"] for _, _, e in held_out}) <= 40


def test_too_small_task_space_is_one_line():
    cfg = ReasoningGymConfig(task="count_bits", config={"min_n": 1, "max_n": 20}, size=100, eval_size=5)
    with pytest.raises(ConfigError, match=r"data.reasoning_gym.eval_size=5: only 0 of 20 .*Fix: lower eval_size"):
        problem_splits(cfg)


def test_unknown_task_lists_close_names_and_bad_config_names_the_field():
    with pytest.raises(ConfigError, match=r"task='leg_countin' is not a reasoning-gym task; did you mean "
                                          r"leg_counting"):
        problem_splits(ReasoningGymConfig(task="leg_countin"))
    with pytest.raises(ConfigError, match=r"tasks\[1\].name='sodoku'.*did you mean .*sudoku"):
        problem_splits(ReasoningGymConfig(tasks=[{"name": "leg_counting"}, {"name": "sodoku"}]))
    with pytest.raises(ConfigError, match=r"data.reasoning_gym.config: reasoning-gym refused it \(TypeError"):
        problem_splits(ReasoningGymConfig(task="leg_counting", config={"max_animalz": 3}))
    with pytest.raises(ConfigError, match="either task"):
        problem_splits(ReasoningGymConfig())


def test_prompts_render_the_system_prompt_and_score_with_the_tasks_scorer(tok):
    from reasoning_gym.utils import SYSTEM_PROMPTS

    data = _data(task="leg_counting", config={"min_animals": 1, "max_animals": 2}, size=20, eval_size=10)
    records = load_prompts("reasoning_gym", tok, data, "train")
    held = load_prompts("reasoning_gym", tok, data, "eval")
    assert len(records) == 20 and len(held) == 10
    assert tok.tok.decode(records[0].prompt_ids).startswith(tok.render([{"role": "system",
                                                                         "content": SYSTEM_PROMPTS["default"]}])[:40])
    train, _ = problem_splits(data.reasoning_gym)
    for record, (_, _, entry) in zip(records, train):
        assert record.text == entry["question"]
        right = f"I count. <answer>{entry['answer']}</answer>"
        wrong = f"<answer>{int(entry['answer']) + 1}</answer>"
        assert reasoning_gym_reward(right, record.answer) == 1.0
        assert reasoning_gym_reward(wrong, record.answer) == 0.0
        assert reasoning_gym_reward(entry["answer"], record.answer) == 0.0  # no answer tag: not what was asked
        assert reasoning_gym_reward(wrong, record.answer, format_weight=0.1) == pytest.approx(0.1)
        assert reasoning_gym_reward(right, record.answer, format_weight=0.1) == pytest.approx(1.0)


def test_composite_of_two_tasks_and_exported_entries():
    leg_config = {"min_animals": 1, "max_animals": 2}
    cfg = ReasoningGymConfig(tasks=[{"name": "leg_counting", "weight": 1, "config": leg_config},
                                    {"name": "basic_arithmetic", "weight": 1}], size=60, eval_size=10)
    records = prompt_source("reasoning_gym", DataConfig(reasoning_gym=cfg), "train")
    train, _ = problem_splits(cfg)
    sources = {e["metadata"]["source_dataset"] for _, _, e in train}
    assert sources == {"leg_counting", "basic_arithmetic"}
    for (_, r), (_, _, e) in zip(records, train):
        assert reasoning_gym_reward(f"<answer>{e['answer']}</answer>", r["answer"]) == 1.0
        # the same problem exported as a plain entry (e.g. a JSONL written from reasoning-gym) scores the same
        exported = json.dumps({"question": e["question"], "answer": e["answer"], "metadata": e["metadata"]})
        assert reasoning_gym_reward(f"<answer>{e['answer']}</answer>", exported) == 1.0
        assert reasoning_gym_reward("<answer>nope</answer>", exported) < 0.5
    with pytest.raises(ValueError, match="must be a reasoning-gym problem"):
        reasoning_gym_reward("<answer>1</answer>", "42")


def test_reward_runs_in_the_pool_with_its_kwargs():
    cfg = ReasoningGymConfig(task="leg_counting", size=8, eval_size=2)
    records = prompt_source("reasoning_gym", DataConfig(reasoning_gym=cfg), "train")
    train, _ = problem_splits(cfg)
    pool = RewardPool("reasoning_gym", workers=1, timeout_s=30, kwargs={"format_weight": 0.2})
    try:
        items = [(f"<answer>{e['answer']}</answer>", r["answer"]) for (_, r), (_, _, e) in zip(records, train)]
        items += [("<answer>-1</answer>", records[0][1]["answer"]), ("no tag", records[0][1]["answer"])]
        assert pool.score(items) == pytest.approx([1.0] * 8 + [0.2, 0.0])
    finally:
        pool.close()


def test_sft_demonstrations_are_the_reference_answers(tok):
    data = _data(task="leg_counting", size=5, eval_size=2)
    samples = load_sft_samples("reasoning_gym", tok, data)
    train, _ = problem_splits(data.reasoning_gym)
    for sample, (_, _, entry) in zip(samples, train):
        trained = tok.tok.decode([t for t, m in zip(sample.input_ids, sample.loss_mask) if m])
        assert trained == f"<answer>{entry['answer']}</answer><|im_end|>"


def test_config_refuses_a_reward_that_cannot_read_the_problems():
    base = ["model.tiny={}", "data.train=reasoning_gym", "data.reasoning_gym.task=leg_counting"]
    with pytest.raises(ConfigError, match="reward.name=math: the answers of reasoning_gym.*Fix: "
                                          "reward.name=reasoning_gym"):
        load_train_config(None, base)
    with pytest.raises(ConfigError, match="reward.eval_name=exact_match.*Fix: reward.eval_name=reasoning_gym"):
        load_train_config(None, base + ["reward.name=reasoning_gym", "reward.eval_name=exact_match"])
    cfg = load_train_config(None, base + ["reward.name=reasoning_gym", "data.reasoning_gym.config={max_animals: 4}"])
    assert cfg.data.reasoning_gym.config == {"max_animals": 4}


# ------------------------------------------------------------------------------------- Hugging Face dataset folders
def test_saved_hf_dataset_with_column_mapping(tmp_path, tok):
    import datasets

    rows = {"question": ["1+1=", "2+3="], "solution": ["2", "5"]}
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows),
                          "test": datasets.Dataset.from_dict(rows)}).save_to_disk(str(tmp_path / "dd"))
    data = DataConfig(prompt_key="question", answer_key="solution")
    records = load_prompts(str(tmp_path / "dd" / "train"), tok, data)
    assert [(r.text, r.answer) for r in records] == [("1+1=", "2"), ("2+3=", "5")]
    with pytest.raises(DataError, match=r"DatasetDict with splits \['test', 'train'\]; name one. Fix: e.g. "):
        load_prompts(str(tmp_path / "dd"), tok, data)
    with pytest.raises(DataError, match=r"dd/test:row 0: has neither 'prompt'"):
        load_prompts(str(tmp_path / "dd" / "test"), tok, DataConfig())


def test_folder_of_shards_in_name_order_and_bad_rows_named(tmp_path, tok):
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "shards"
    folder.mkdir()
    pq.write_table(pa.table({"prompt": ["a", "b"], "answer": ["1", "2"]}), folder / "part-000.parquet")
    (folder / "part-001.jsonl").write_text('{"prompt": "c", "answer": "3"}\n{"prompt": "d"}\n')
    (folder / "README.md").write_text("not data")
    (folder / "dataset_info.json").write_text("{}")  # metadata, not a shard
    records = read_records(str(folder))
    assert [r["prompt"] for _, r in records] == ["a", "b", "c", "d"]
    assert [w.rsplit("/", 1)[-1] for w, _ in records] == ["part-000.parquet:row 0", "part-000.parquet:row 1",
                                                        "part-001.jsonl:line 1", "part-001.jsonl:line 2"]
    assert len(read_records(str(folder), limit=3)) == 3
    (folder / "part-002.jsonl").write_text('{"prompt": "e", "answer": [1]}\n')
    with pytest.raises(DataError, match=r"part-002.jsonl:line 1: field 'answer' must be a string, number or object"):
        load_prompts(str(folder), tok, DataConfig())
    (folder / "test-000.jsonl").write_text('{"prompt": "z", "answer": "9"}\n')
    (folder / "train-000.jsonl").write_text('{"prompt": "y", "answer": "8"}\n')
    with pytest.raises(DataError, match=r"holds the shards of several splits \(test, train\).*Fix: point at one"):
        read_records(str(folder))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match="holds neither a saved Hugging Face dataset"):
        read_records(str(empty))


def test_structured_answers_with_a_format_travel_as_json(tmp_path, tok):
    path = tmp_path / "code.jsonl"
    path.write_text(json.dumps({"prompt": "write f", "answer": {"test": "def check(c): pass", "entry_point": "f"},
                                "format": "humaneval"}) + "\n")
    record, = load_prompts(str(path), tok, DataConfig())
    assert json.loads(record.answer) == {"test": "def check(c): pass", "entry_point": "f", "format": "humaneval"}
    # beside a string answer a "format" column is some other field of the dataset: the answer stays as written
    path.write_text(json.dumps({"prompt": "pick one", "answer": "B", "format": "multiple_choice"}) + "\n")
    assert load_prompts(str(path), tok, DataConfig())[0].answer == "B"
    path.write_text(json.dumps({"prompt": "write f", "answer": {"tests": "assert f() == 1"}, "format": 3}) + "\n")
    with pytest.raises(DataError, match=r"code.jsonl:line 1: field 'format'=3 must be a format name"):
        load_prompts(str(path), tok, DataConfig())


def test_seed_ranges_and_configs_that_would_mix_the_splits_are_refused():
    with pytest.raises(ConfigError, match=r"eval_seed=1: problem i is generated from seed \+ i.*Fix: an eval_seed "
                                          r"outside \[-39, 99\]"):
        problem_splits(ReasoningGymConfig(task="leg_counting", size=100, eval_size=10, eval_seed=1))
    train, held_out = problem_splits(ReasoningGymConfig(task="leg_counting", size=100, eval_size=10, eval_seed=100))
    assert len(held_out) == 10
    with pytest.raises(ConfigError, match=r"data.reasoning_gym.config sets seed or size"):
        problem_splits(ReasoningGymConfig(task="leg_counting", config={"seed": 3}))
    with pytest.raises(ConfigError, match=r"tasks\[0\].config sets seed or size"):
        problem_splits(ReasoningGymConfig(tasks=[{"name": "leg_counting", "config": {"size": 3}}]))
    with pytest.raises(ConfigError, match=r"config is for one task.*Fix: move it into tasks\[i\].config"):
        problem_splits(ReasoningGymConfig(tasks=[{"name": "leg_counting"}], config={"max_animals": 3}))


def test_each_split_is_paired_with_the_reward_that_scores_it():
    base = ["model.tiny={}", "data.train=reasoning_gym", "data.reasoning_gym.task=leg_counting",
            "reward.name=reasoning_gym"]
    # held-out prompts from a file of another kind, scored by their own checker: fine
    assert load_train_config(None, base + ["data.eval=gsm8k.jsonl", "reward.eval_name=math"]).reward.eval_name == "math"
    with pytest.raises(ConfigError, match=r"reward.eval_name=math: the answers of reasoning_gym"):
        load_train_config(None, base + ["reward.eval_name=math"])  # held-out split: reasoning_gym's own
