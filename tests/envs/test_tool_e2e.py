"""Multi-turn tool use end to end under torchrun (2 ranks, DP=2) with the real SGLang engine on CPU: a tiny model
cold-started on calculator demonstrations, then GRPO on episodes where its tool calls run and the results are
appended token-in/token-out; then `megarl eval` (pass@k, PPL under trainer, engine and transformers)."""
import json
import math
import os
import re
import subprocess
import sys

import pytest
import yaml

from megarl.testing.fixtures import early_run_engine
from megarl.trainer.rl import dumped_samples

pytestmark = pytest.mark.e2e

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/<package>/ -> repo
TINY = {"family": "qwen2", "tokenizer": "char",
        "overrides": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                      "num_key_value_heads": 2, "vocab_size": 384, "max_position_embeddings": 256}}
STEPS = 2


def _config(tmp) -> str:
    cfg = {"run_dir": str(tmp / "run"), "seed": 5, "model": {"tiny": TINY, "load": "sft"},
           "data": {"train": "synthetic", "max_prompt_tokens": 64,
                    "synthetic": {"max_operand": 9, "ops": ["*"], "num_train": 60, "num_eval": 6,
                                  "sft_tool_share": 1.0}},
           "sft": {"steps": 200, "batch_size": 32, "lr": 3.0e-3, "warmup_steps": 5, "max_seq_len": 256},
           "env": {"name": "tool", "tools": ["calculator"], "tools_in_prompt": False, "max_turns": 3,
                   "max_response_tokens": 160},
           "rollout": {"prompts_per_step": 4, "n_samples": 4, "max_new_tokens": 80, "request_size": 2,
                       "engine": {"max_total_tokens": 8192}},
           "reward": {"name": "exact_match", "workers": 1},
           "optim": {"lr": 1.0e-3},
           # the RL-dynamics metrics: update sparsity at DP=2, the forgetting KL on multi-turn episodes (tool output
           # tokens are not the policy's: masked)
           "rl": {"steps": STEPS, "eval_samples": 4, "dump_rollouts": True, "log_update_sparsity": True,
                  "forgetting_kl": True},
           "reshard": {"bucket_mb": 1},
           "logging": {"wandb": "disabled", "progress": False}}
    path = tmp / "tool.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _model(_=None) -> str:
    from megarl.testing import tiny_model_dir

    return tiny_model_dir(TINY["family"], tokenizer=TINY["tokenizer"], **TINY["overrides"])


# the engine the run would start itself, launched ahead (a start costs ~25 s): the run (after its SFT) and `megarl
# eval` each push their weights into it first (verified)
engine = early_run_engine(lambda folder, _: _config(folder), _model)


def _torchrun(args: list[str], nproc: int, log: str, timeout: float = 900) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    with open(log, "w") as out:
        rc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                             "--standalone", "-m", "megarl.cli", *args], cwd=ROOT, env=env, stdout=out,
                            stderr=subprocess.STDOUT, timeout=timeout).returncode
    assert rc == 0, f"megarl {args[0]} failed ({rc}); log tail:\n" + open(log).read()[-4000:]


@pytest.fixture(scope="module")
def run(tmp_path_factory, engine):
    tmp = tmp_path_factory.mktemp("tool")
    config = _config(tmp)
    _torchrun(["run", config, f"rollout.engine.urls=[{engine.url}]"], 2, str(tmp / "run.log"))
    return tmp, config, engine.url


def _metrics(run_dir) -> dict:
    by_step: dict = {}
    for line in open(os.path.join(run_dir, "metrics.jsonl")):
        row = json.loads(line)
        by_step.setdefault(row["step"], {}).update(row)
    return by_step


def _tokenizer(run_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.join(run_dir, "base-model"))


BLOCK = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.S)


def expected_tool_answer(turn_text: str) -> str | None:
    """What the calculator environment must answer to this turn, worked out independently of megarl: the first
    <tool_call> block's JSON, a product of two integers; None when the call is something else (not checked)."""
    block = BLOCK.search(turn_text)
    try:
        call = json.loads(block[1]) if block else None
    except json.JSONDecodeError:
        call = None
    if not isinstance(call, dict) or call.get("name") != "calculator" or not isinstance(call.get("arguments"), dict):
        return "error: the tool call could not be parsed"
    product = re.fullmatch(r"\s*(\d+)\s*\*\s*(\d+)\s*", str(call["arguments"].get("expression")))
    return str(int(product[1]) * int(product[2])) if product else None


def test_tool_episodes_train_exactly_the_engine_tokens_of_the_model_turns(run):
    tmp = run[0]
    run_dir = tmp / "run"
    tok = _tokenizer(run_dir)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    multi_turn = 0
    for step in range(1, STEPS + 1):
        samples = dumped_samples(run_dir, step)
        rows = {r["sample"]: r for dp in (0, 1)
                for r in map(json.loads, open(run_dir / "rollouts" / f"step_{step:06d}.dp{dp}.train.jsonl"))}
        assert sorted(rows) == list(range(len(samples)))
        for index, s in enumerate(samples):
            response, mask = s["response_ids"], s["loss_mask"]
            assert len(mask) == len(response) == len(s["rollout_log_probs"])
            # the row trained is the engine's ids verbatim, and exactly the model's own tokens are targets
            assert rows[index]["input_ids"] == s["prompt_ids"] + response
            assert rows[index]["trained"] == [t for t, m in zip(response, mask) if m]
            # segments: model turn (1s), observation (0s), model turn ...; each model turn ends with <|im_end|>
            # unless the budget cut it, and each observation is the template's tool block for that turn's call
            segments, start = [], 0
            for i in range(1, len(mask) + 1):
                if i == len(mask) or mask[i] != mask[start]:
                    segments.append((mask[start], response[start:i]))
                    start = i
            assert segments[0][0] == 1 and [m for m, _ in segments] == [1, 0] * (len(segments) // 2) + \
                [1] * (len(segments) % 2)
            assert len(segments) == 2 * s["extra"]["turns"] - 1 or s["finish_reason"] != "stop"
            for (_, turn), (_, observation) in zip(segments[0::2], segments[1::2]):
                assert turn[-1] == im_end
                text = tok.decode(turn)
                obs = tok.decode(observation)
                result = expected_tool_answer(text)
                if result is not None:
                    assert obs == f"\n<|im_start|>user\n<tool_response>\n{result}\n</tool_response><|im_end|>\n" \
                                  "<|im_start|>assistant\n", (text, obs)
                    multi_turn += 1
            if s["finish_reason"] == "stop":  # the final answer is what was scored
                final = tok.decode(segments[-1][1], skip_special_tokens=True)
                assert final == s["extra"]["final_text"]
    assert multi_turn >= 4, "the cold-started model should call the calculator in several episodes"


def test_tool_run_metrics(run):
    tmp = run[0]
    metrics = _metrics(tmp / "run")
    for step in range(1, STEPS + 1):
        m = metrics[step]
        # trainer and engine agree on the model tokens' log-probs in multi-turn context
        assert m["mismatch/logprob_abs_diff"] < 1e-4 and m["mismatch/logprob_abs_diff_max"] < 1e-3
        assert m["tool/call_rate"] > 0 and m["rollout/turns_mean"] > 1 and 0 < m["rollout/observation_token_frac"] < 1
        assert 0 < m["dynamics/update_changed_frac"] <= 1  # rl.log_update_sparsity: the step changed parameters
    # rl.forgetting_kl: KL(policy || the SFT model RL started from) is 0 before RL, positive once the policy moved
    assert metrics[0]["eval/kl_to_initial"] == 0 == metrics[0]["eval/kl_to_initial_k1"]
    assert metrics[STEPS]["eval/kl_to_initial"] > 0
    for step in (0, STEPS):
        m = metrics[step]
        curve = [m[f"eval/pass_at_{k}"] for k in (1, 2, 4)]
        assert curve == sorted(curve) and 0 <= curve[0] <= 100 and "eval/maj_at_4" in m
        assert 0 <= m["eval/tool_call_rate"] <= 1
    curves = json.load(open(tmp / "run" / "pass_at_k.json"))
    assert set(curves) == {"before", "after"} and len(curves["after"]) == 4
    assert abs(curves["before"]["1"] * 100 - metrics[0]["eval/pass_at_1"]) < 1e-9
    assert open(tmp / "run" / "pass_at_k.png", "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_megarl_eval_perplexity_matches_transformers_and_engine(run):
    import torch
    from transformers import AutoModelForCausalLM

    tmp, config, url = run
    responses = tmp / "responses.jsonl"
    pairs = [("3*4=", "12"), ("7*8=", "56"), ("9*9=", "The answer is 81.")]
    responses.write_text("".join(json.dumps({"prompt": p, "response": r}) + "\n" for p, r in pairs))
    _torchrun(["eval", config, "--samples", "4", "--responses", str(responses), "--out", str(tmp / "eval"),
               "rl.forgetting_kl=false", f"rollout.engine.urls=[{url}]"], 1, str(tmp / "eval.log"))  # the run's test covers it; no reference here
    result = json.load(open(tmp / "eval" / "eval.json"))
    assert result["step"] == STEPS and len(result["pass_at_k_curve"]) == 4
    assert os.path.getsize(tmp / "eval" / "pass_at_k.png") > 1000

    # independent reference: transformers on the exported HF folder (the same weights as the last checkpoint)
    tok = _tokenizer(tmp / "run")
    model = AutoModelForCausalLM.from_pretrained(tmp / "run" / "hf", torch_dtype=torch.float32).eval()
    total, count, entropy = 0.0, 0, 0.0
    for prompt, response in pairs:
        messages = [{"role": "user", "content": prompt}]
        prompt_ids = tok(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                         add_special_tokens=False)["input_ids"]
        response_ids = tok(response, add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids("<|im_end|>")]
        ids = torch.tensor([prompt_ids + response_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, :-1].double(), -1)
        positions = range(len(prompt_ids) - 1, ids.shape[1] - 1)
        total += sum(float(logp[p, ids[0, p + 1]]) for p in positions)
        entropy += sum(float(-(logp[p].exp() * logp[p]).sum()) for p in positions)
        count += len(response_ids)
    assert result["responses/tokens"] == count
    assert math.isclose(result["responses/trainer_ppl"], math.exp(-total / count), rel_tol=1e-4)
    assert math.isclose(result["responses/trainer_entropy"], entropy / count, rel_tol=1e-4)
    assert result["responses/ppl_rel_diff"] < 1e-3
