"""Multi-turn tool use without the engine: tools, the tool-call environment (SGLang's parser), the chat template's
tool syntax, observation tokens that continue the engine's ids, tool-use SFT masks, and multi-turn loss masks in the
training batch."""
import json

import pytest
import torch

from megarl.config import ConfigError
from megarl.data import ChatTokenizer, DataError, load_responses, load_sft_samples
from megarl.data.synthetic import tool_use_demonstrations
from megarl.envs import EnvStep, ToolEnv, calculator, make_env
from megarl.envs.episode import observation_ids
from megarl.trainer.batching import Sample, token_batch
from megarl.trainer.config import DataConfig, SyntheticConfig, load_train_config

pytestmark = pytest.mark.unit

CALL = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "37*58"}}}
CONVERSATION = [{"role": "user", "content": "37*58="}, {"role": "assistant", "content": "", "tool_calls": [CALL]},
                {"role": "tool", "name": "calculator", "content": "2146"}, {"role": "assistant", "content": "2146"}]
TURN = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "37*58"}}\n</tool_call>'


@pytest.fixture(scope="module", params=["char", "bpe"])
def tok(request, tmp_path_factory):
    from megarl.models.tiny import TOKENIZERS

    path = tmp_path_factory.mktemp(f"tok-{request.param}")
    TOKENIZERS[request.param](str(path))
    return ChatTokenizer.from_pretrained(str(path))


def test_calculator_is_exact_and_runs_nothing_but_arithmetic():
    assert calculator("37*58") == "2146" and calculator("(1+2)**3 - 7//2") == "24" and calculator("1/4") == "0.25"
    assert calculator("10/2") == "5" and calculator("-3 % 5") == "2"
    for bad, why in [("1/0", "division by zero"), ("__import__('os').system('id')", "unsupported"),
                     ("x + 1", "unsupported"), ("9**99999", "exponent too large"), ("1+", "error")]:
        assert calculator(bad).startswith("error:") and why in calculator(bad), bad


def test_tool_env_runs_parsed_calls_and_ends_on_an_answer():
    env = make_env("tool", tools=["calculator"])
    assert isinstance(env, ToolEnv)
    env.reset(None)
    step = env.step(TURN)
    assert not step.done and step.observation == [{"role": "tool", "name": "calculator", "content": "2146"}]
    assert step.info == {"tool_calls": 1, "tool_errors": 0}
    assert env.step("2146").done
    broken = env.step('<tool_call>\n{"name": "calculator", "arguments": {"expres\n</tool_call>')
    assert not broken.done and broken.info["bad_tool_calls"] == 1 and "could not be parsed" in \
        broken.observation[0]["content"]
    unknown = env.step('<tool_call>\n{"name": "search", "arguments": {"q": "x"}}\n</tool_call>')
    assert unknown.info.get("bad_tool_calls") == 1  # SGLang's parser keeps only known tools
    wrong_args = env.step('<tool_call>\n{"name": "calculator", "arguments": {"expr": "1"}}\n</tool_call>')
    assert wrong_args.info == {"tool_calls": 1, "tool_errors": 1} and "unexpected keyword" in \
        wrong_args.observation[0]["content"]


def test_python_tool_runs_in_the_sandbox():
    env = make_env("tool", tools=["python"])
    env.reset(None)

    def call(code):
        args = json.dumps({"name": "python", "arguments": {"code": code}})
        return env.step(f"<tool_call>\n{args}\n</tool_call>")

    assert call("print(6*7)").observation[0]["content"].strip() == "42"
    blocked = call("import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=2)")
    assert not blocked.done and blocked.info["tool_errors"] == 1 and "Network is unreachable" in \
        blocked.observation[0]["content"]


def test_template_renders_plain_chat_unchanged_and_tool_turns_like_qwen25(tok):
    plain = [{"role": "system", "content": "s"}, {"role": "user", "content": "1+1="}]
    assert tok.render(plain, add_generation_prompt=True) == \
        "<|im_start|>system\ns<|im_end|>\n<|im_start|>user\n1+1=<|im_end|>\n<|im_start|>assistant\n"
    text = tok.render(CONVERSATION)
    assert f"<|im_start|>assistant\n{TURN}<|im_end|>\n" in text
    assert "<|im_start|>user\n<tool_response>\n2146\n</tool_response><|im_end|>\n" in text
    with_tools = tok.render(plain, add_generation_prompt=True, tools=[make_schema()])
    assert with_tools.startswith("<|im_start|>system\ns\n\n# Tools\n<tools>\n{") and '"calculator"' in with_tools


def make_schema():
    from megarl.envs import TOOLS

    return TOOLS["calculator"].schema()


def test_observation_ids_continue_the_engine_tokens_into_the_templates_conversation(tok):
    """prompt ids + the model's turn (as the engine would return it, ending with <|im_end|>) + observation ids
    decodes to exactly what the chat template renders for the whole conversation so far."""
    prompt = tok.prompt_ids(CONVERSATION[:1])
    turn = tok.encode(TURN) + [tok.tok.convert_tokens_to_ids("<|im_end|>")]
    obs = observation_ids(tok, [CONVERSATION[2]])
    assert tok.decode(prompt + turn + obs, skip_special_tokens=False) == \
        tok.render(CONVERSATION[:3], add_generation_prompt=True)
    assert observation_ids(tok, "2146") == obs  # text: one tool message
    assert observation_ids(tok, [5, 6, 7]) == [5, 6, 7]  # token ids: appended as they are


def test_tool_use_sft_sample_trains_the_assistant_turns_and_tool_calls_only(tok):
    sample = tok.sft_sample(CONVERSATION)
    trained = tok.tok.decode([t for t, m in zip(sample.input_ids, sample.loss_mask) if m])
    assert trained == f"{TURN}<|im_end|>2146<|im_end|>"  # the tool result and role headers carry no loss
    assert tok.tok.decode(sample.input_ids) == tok.render(CONVERSATION)


def test_synthetic_tool_demonstrations(tok):
    problems = [{"prompt": f"{a}*7=", "answer": "0", "answer_true": str(a * 7)} for a in range(400)]
    conversations = tool_use_demonstrations(problems, 0.25, seed=0)
    with_tool = [c for c in conversations if len(c) == 4]
    assert 70 <= len(with_tool) <= 130
    for c in with_tool:
        assert c[1]["tool_calls"][0]["function"]["arguments"]["expression"] == c[0]["content"][:-1]
        assert c[2]["content"] == c[3]["content"] == str(eval(c[0]["content"][:-1]))  # noqa: S307 - our data
    assert all(c[1]["content"] == "0" for c in conversations if len(c) == 2)  # direct answers keep their (noisy) one
    cfg = DataConfig(synthetic=SyntheticConfig(ops=["*"], num_train=50, num_eval=5, sft_tool_share=1.0))
    samples = load_sft_samples("synthetic", tok, cfg)
    assert len(samples) == 50 and all("<tool_call>" in tok.tok.decode(s.input_ids) for s in samples)


def test_multi_turn_loss_mask_reaches_the_token_batch():
    prompt, response = [1, 2, 3], [10, 11, 12, 20, 21, 13, 14]
    mask = [1, 1, 1, 0, 0, 1, 1]  # model turn, observation, model turn
    s = Sample(0, 0, prompt, response, [-0.5] * 7, "stop", loss_mask=mask)
    single = Sample(1, 1, [4, 5], [30, 31], [-0.1, -0.2], "stop")
    batch = token_batch([s, single], rows=3, seq_len=12, pad_id=0)
    assert batch.targets[0][batch.loss_mask[0] > 0].tolist() == [10, 11, 12, 13, 14]
    assert batch.targets[1][batch.loss_mask[1] > 0].tolist() == [30, 31] and batch.loss_mask[2].sum() == 0
    assert torch.equal(batch.rollout_log_probs[0][batch.loss_mask[0] > 0], torch.full((5,), -0.5))
    assert batch.rollout_log_probs[0].sum() == pytest.approx(-2.5)  # observation log-probs never enter the loss


class GuessEnv:
    """A user's environment, written against megarl.envs.base.Env only: the model guesses a number in up to three
    turns; each wrong guess is told higher or lower."""

    def __init__(self, target: int = 7, **_):
        self.target = target

    def reset(self, record) -> None:
        self.turns = 0

    def step(self, turn_text: str) -> EnvStep:
        self.turns += 1
        guess = int(turn_text.strip())
        if guess == self.target:
            return EnvStep(observation=None, reward=1.0, done=True)
        return EnvStep(observation="higher" if guess < self.target else "lower", done=self.turns >= 3,
                       info={"wrong_guesses": 1})


def test_a_users_environment_by_dotted_path():
    """env.name: package.module:Class builds the user's Env with the rollout's arguments and env.kwargs."""
    cfg = load_train_config(None, ['model.tiny={"family": "qwen2"}', "env.name=test_envs:GuessEnv",
                                   "env.kwargs={target: 5}"])
    env = make_env(cfg.env.name, tools=list(cfg.env.tools), tool_call_format=cfg.env.tool_call_format,
                   **cfg.env.kwargs)
    env.reset(None)
    assert env.step("3") == EnvStep("higher", 0.0, False, {"wrong_guesses": 1})
    assert env.step("5") == EnvStep(None, 1.0, True, {})
    with pytest.raises(ValueError, match="env.name='nope' is unknown; choose one of .*'tool'.*package.module:attr"):
        make_env("nope")


def test_env_config_errors_name_the_field(tmp_path):
    base = ['model.tiny={"family": "qwen2"}', f"run_dir={tmp_path}"]
    with pytest.raises(ConfigError, match="env.name='chess' is unknown"):
        load_train_config(None, base + ["env.name=chess"])
    with pytest.raises(ConfigError, match=r"env.tools: unknown tool\(s\) \['search'\]"):
        load_train_config(None, base + ["env.name=tool", "env.tools=[search]"])
    assert load_train_config("configs/tool_quickstart.yaml", []).env.name == "tool"


def test_response_files_for_perplexity(tmp_path, tok):
    path = tmp_path / "responses.jsonl"
    path.write_text(json.dumps({"prompt": "2+2=", "response": "4"}) + "\n" + json.dumps({"prompt": "x"}) + "\n")
    with pytest.raises(DataError, match=r"responses.jsonl:line 2: field 'response' must be a non-empty string"):
        load_responses(str(path), tok, DataConfig())
    path.write_text(json.dumps({"prompt": "2+2=", "response": "4"}) + "\n")
    [(prompt, response)] = load_responses(str(path), tok, DataConfig())
    assert tok.decode(prompt + response, skip_special_tokens=False) == \
        tok.render([{"role": "user", "content": "2+2="}, {"role": "assistant", "content": "4"}]).rstrip("\n")


def test_sandbox_unavailable_stops_scoring_instead_of_scoring_zero():
    from megarl.rewards.pool import _score
    from megarl.sandbox import SandboxUnavailable

    with pytest.raises(SandboxUnavailable):
        _score("reward_fns:needs_missing_sandbox", {}, [("x", None)])
