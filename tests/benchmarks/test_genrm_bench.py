"""benchmarks/genrm.py without running anything: the verifier's data (labels right, wrong answers really wrong, the
held-out requests only about held-out problems, the demonstrations' analysis ending in the label), the steps-to-target
rule, and every run's overrides accepted by the trainer's config validation."""
import importlib.util
import json
import os
import random
import sys

import pytest

from megarl.config import load_config
from megarl.trainer import load_train_config
from megarl.trainer.config import TrainConfig

pytestmark = pytest.mark.unit

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/<package>/ -> repo


@pytest.fixture(scope="module")
def genrm():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    spec = importlib.util.spec_from_file_location("bench_genrm", os.path.join(ROOT, "benchmarks", "genrm.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_verifier_data_is_labelled_by_the_exact_sum(genrm, tmp_path):
    rng = random.Random(0)
    for right in (0, 5, 99, 198):
        for _ in range(200):
            wrong = genrm.wrong_answer(right, rng)
            assert wrong != right and wrong >= 0
    synthetic = load_config(TrainConfig, os.path.join(ROOT, "configs", "quickstart.yaml"), []).data.synthetic
    paths, meta_paths = genrm.write_verifier_data(str(tmp_path), synthetic)
    rows = {k: [json.loads(line) for line in open(p)] for k, p in paths.items()}
    meta = {k: [json.loads(line) for line in open(p)] for k, p in meta_paths.items()}
    from megarl.data.synthetic import synthetic_splits

    train, held_out = synthetic_splits(synthetic)
    held_prompts = {p["prompt"] for p in held_out}
    for name in ("train", "heldout"):
        labels = []
        for r in rows[name]:
            problem, shown = r["prompt"].split("=")
            a, b = map(int, problem.split("+"))
            assert r["answer"] == str(int(a + b == int(shown)))
            assert (problem + "=" in held_prompts) == (name == "heldout")
            labels.append(int(r["answer"]))
        assert 0.4 < sum(labels) / len(labels) < 0.6  # about half right, half wrong
    for demo, request in zip(rows["sft"], rows["train"]):
        user, assistant = demo["messages"]
        assert user["content"] == request["prompt"]
        a, b = map(int, user["content"].split("=")[0].split("+"))
        assert assistant["content"] == f"{a + b} vs {user['content'].split('=')[1]} Score: {request['answer']}"
    # the meta-verifier's: an analysis (whose score always follows from its own sum) is faithful (label 1) exactly
    # when its sum is the true sum
    for name in ("train", "heldout"):
        labels = []
        for r in meta[name]:
            request, analysis = r["prompt"].split("|")
            problem, shown = request.split("=")
            a, b = map(int, problem.split("+"))
            own, _, answer, _, score = analysis.split()
            assert answer == shown and score == str(int(own == shown))
            assert r["answer"] == str(int(int(own) == a + b))
            labels.append(int(r["answer"]))
        assert 0.4 < sum(labels) / len(labels) < 0.6
    for demo, request in zip(meta["sft"], meta["train"]):
        a, b = map(int, request["prompt"].split("=")[0].split("+"))
        own = request["prompt"].split("|")[1].split()[0]
        assert demo["messages"][1]["content"] == f"{a + b} vs {own} Score: {request['answer']}"


def test_steps_to_the_target(genrm):
    curve = {0: {"eval/pass_at_1": 10.0}, 10: {"eval/pass_at_1": 41.0}, 20: {"eval/pass_at_1": 39.0}}
    assert genrm.steps_to(curve, 40.0) == 10 and genrm.steps_to(curve, 41.5) is None and genrm.steps_to(curve, 5) == 0


def test_the_runs_configs_pass_validation(genrm, tmp_path):
    """The overrides each stage hands `megarl train` (quickstart + stage), as the trainer validates them."""
    quickstart = os.path.join(ROOT, "configs", "quickstart.yaml")
    cfg = load_train_config(quickstart, [f"run_dir={tmp_path}", *genrm.judge_overrides("/models/verifier")])
    assert cfg.reward.judge.template == "{prompt}{response}" and cfg.reward.eval_name == "exact_match"
    assert cfg.pools["verifier"].model == "/models/verifier" and cfg.reward.judge.temperature == 0.0
    cfg = load_train_config(quickstart, [f"run_dir={tmp_path}", *genrm.judge_overrides("/models/v", "/models/m")])
    assert cfg.reward.judge.meta_verifier.template == "{prompt}{response}|{analysis}"
    assert cfg.pools["meta"].model == "/models/m" and cfg.reward.judge.meta_verifier.pool == "meta"
    cfg = load_train_config(quickstart, [f"run_dir={tmp_path}", *genrm.opd_overrides("/models/teacher")])
    assert cfg.teacher.model == "/models/teacher" and cfg.algorithm.advantage_estimator == "opd"
