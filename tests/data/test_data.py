"""Datasets (JSONL / Parquet / synthetic), chat tokenisation with assistant-only masks, packing and the label shift."""
import json

import pytest
import torch

from megarl.data import DataError, load_prompts, load_sft_samples, pack_samples
from megarl.data.chat import SFTSample, rows_to_tensors
from megarl.data.synthetic import synthetic_splits
from megarl.trainer.config import DataConfig, SyntheticConfig

pytestmark = pytest.mark.unit


def test_synthetic_splits_are_disjoint_and_correct():
    train, held_out = synthetic_splits(SyntheticConfig(digits=2, ops=["+", "-", "*"], num_train=2000, num_eval=300))
    assert len(train) == 2000 and len(held_out) == 300
    assert not {p["prompt"] for p in train} & {p["prompt"] for p in held_out}
    for p in train[:200]:
        assert str(eval(p["prompt"][:-1])) == p["answer"]  # noqa: S307 - our own generated arithmetic


def test_multi_turn_masks_exactly_the_assistant_tokens(tok):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+1="},
                {"role": "assistant", "content": "2"}, {"role": "user", "content": "and 2+2?"},
                {"role": "assistant", "content": "4, easy"}]
    sample = tok.sft_sample(messages)
    trained = tok.tok.decode([t for t, m in zip(sample.input_ids, sample.loss_mask) if m])
    assert trained == "2<|im_end|>4, easy<|im_end|>"  # content + end-of-turn of each assistant turn, nothing else
    assert tok.tok.decode(sample.input_ids) == tok.render(messages)  # one tokenisation of the whole conversation


def test_rows_to_tensors_shift_and_segments():
    a = SFTSample([10, 11, 12, 13], [0, 0, 1, 1])
    b = SFTSample([20, 21, 22], [0, 1, 1])
    ids, targets, mask, seg = rows_to_tensors([[a, b]], pad_id=0, seq_len=9)
    assert ids[0].tolist() == [10, 11, 12, 13, 20, 21, 22, 0, 0]
    assert targets[0, :-1].tolist() == ids[0, 1:].tolist()
    # position t trains target t+1 when that token is an assistant token of the same sample
    assert mask[0].tolist() == [0, 1, 1, 0, 1, 1, 0, 0, 0]
    assert seg[0].tolist() == [1, 1, 1, 1, 2, 2, 2, 0, 0]


def test_packing_fits_and_keeps_every_sample():
    samples = [SFTSample(list(range(n)), [1] * n) for n in (50, 30, 30, 20, 70, 10)]
    rows = pack_samples(samples, max_seq_len=100)
    assert all(sum(len(s.input_ids) for s in row) <= 100 for row in rows)
    assert sorted(len(s.input_ids) for row in rows for s in row) == sorted(len(s.input_ids) for s in samples)
    assert len(rows) == 3
    assert len(pack_samples(samples, 100, pack=False)) == 6


def test_prompt_files_validate_with_line_numbers(tmp_path, tok):
    good = tmp_path / "p.jsonl"
    good.write_text(json.dumps({"prompt": "2+2=", "answer": 4}) + "\n\n" +
                    json.dumps({"messages": [{"role": "user", "content": "3+3="}], "answer": "6"}) + "\n")
    records = load_prompts(str(good), tok, DataConfig())
    assert [r.answer for r in records] == ["4", "6"] and records[1].text == "3+3="
    assert records[0].prompt_ids == tok.prompt_ids([{"role": "user", "content": "2+2="}])
    cases = {"{not json": r"bad.jsonl:line 2: not valid JSON",
             json.dumps({"question": "x"}): r"line 2: has neither 'prompt'.*keys are \['question'\]",
             json.dumps({"prompt": ""}): r"line 2: field 'prompt' must be a non-empty string",
             json.dumps({"messages": [{"role": "robot", "content": "x"}]}): r"line 2: messages\[0\].role='robot'"}
    for line, message in cases.items():
        bad = tmp_path / "bad.jsonl"
        bad.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n" + line + "\n")
        with pytest.raises(DataError, match=message):
            load_prompts(str(bad), tok, DataConfig())
    with pytest.raises(DataError, match="max_prompt_tokens=4"):
        load_prompts(str(good), tok, DataConfig(max_prompt_tokens=4))


def test_eval_fraction_holds_out_a_deterministic_disjoint_share_of_the_train_file(tmp_path, tok):
    """data.eval_fraction without data.eval: the held-out prompts are chosen by their text (the same split on every
    run, in any order, duplicates on one side), never trained on, and the held-out evaluation reads them."""
    from megarl.config import ConfigError
    from megarl.trainer.evaluate import held_out_prompts

    path = tmp_path / "own.jsonl"
    rows = [{"prompt": f"{a}+{a}=", "answer": 2 * a} for a in range(400)] + [{"prompt": "7+7=", "answer": 14}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = DataConfig(train=str(path), eval_fraction=0.1)
    train = [r.text for r in load_prompts(str(path), tok, data, "train")]
    held = [r.text for r in held_out_prompts(data, tok, None)]
    assert len(train) + len(held) == len(rows) and not set(train) & set(held)
    assert 20 <= len(held) <= 60  # ~10% of 400 distinct prompts
    assert train.count("7+7=") == 2 or held.count("7+7=") == 2  # the duplicate stays on one side
    path.write_text("".join(json.dumps(r) + "\n" for r in reversed(rows)))  # another order: the same split
    assert sorted(r.text for r in held_out_prompts(data, tok, None)) == sorted(held)
    assert held_out_prompts(DataConfig(train=str(path)), tok, None) == []  # no fraction, no data.eval: none
    for bad, message in [(dict(eval_fraction=1.0), r"data.eval_fraction=1.0 must be in \[0, 1\)"),
                         (dict(eval_fraction=0.1, eval="e.jsonl"), "data.eval='e.jsonl' is set too"),
                         (dict(eval_fraction=0.1, train="synthetic"), "has its own held-out split")]:
        with pytest.raises(ConfigError, match=message):
            DataConfig(**{"train": str(path), **bad})


def test_parquet_prompts_and_sft_errors(tmp_path, tok):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": ["1+2=", "5+5="], "answer": ["3", "10"]}), str(path))
    assert [r.answer for r in load_prompts(str(path), tok, DataConfig())] == ["3", "10"]
    pq.write_table(pa.table({"prompt": ["1+2=", ""], "answer": ["3", "10"]}), str(path))
    with pytest.raises(DataError, match=r"p.parquet:row 1: field 'prompt'"):
        load_prompts(str(path), tok, DataConfig())
    sft = tmp_path / "s.jsonl"
    sft.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(DataError, match="s.jsonl:line 1: no assistant message"):
        load_sft_samples(str(sft), tok, DataConfig())


def test_synthetic_sft_samples_train_only_the_answer(tok):
    cfg = DataConfig(synthetic=SyntheticConfig(num_train=5, num_eval=2))
    train, _ = synthetic_splits(cfg.synthetic)
    samples = load_sft_samples("synthetic", tok, cfg)
    for sample, problem in zip(samples, train):
        trained = tok.tok.decode([t for t, m in zip(sample.input_ids, sample.loss_mask) if m])
        assert trained == problem["answer"] + "<|im_end|>"


def test_sft_answer_noise_corrupts_the_requested_share(tok):
    from megarl.data.synthetic import noisy_answers

    train, _ = synthetic_splits(SyntheticConfig(num_train=2000, num_eval=10))
    noisy = noisy_answers(train, 0.3, seed=5)
    wrong = [int(a["answer"]) - int(b["answer"]) for a, b in zip(noisy, train) if a["answer"] != b["answer"]]
    assert 0.25 < len(wrong) / len(train) < 0.35 and all(1 <= abs(d) <= 3 for d in wrong)
    assert [p["prompt"] for p in noisy] == [p["prompt"] for p in train]
    assert noisy_answers(train, 0.0, seed=5) == train
    cfg = DataConfig(synthetic=SyntheticConfig(num_train=50, num_eval=5, sft_answer_noise=0.5))
    answers = [tok.tok.decode([t for t, m in zip(s.input_ids, s.loss_mask) if m]) for s in
               load_sft_samples("synthetic", tok, cfg)]
    truth, _ = synthetic_splits(cfg.synthetic)
    assert 10 < sum(a != t["answer"] + "<|im_end|>" for a, t in zip(answers, truth)) < 40
