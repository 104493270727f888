"""Generative rewards (reward.name: judge) over engine pools (pools.<name>).

Without an engine: the score parser on hand-written judgements (unparseable ones included), mean / majority, the
parse-error rules, the verifier x meta-verifier composition on scripted judgements, the judge prompt equal to the judge
tokenizer's apply_chat_template, the config's one-line errors, and the pools' server configs (GPUs after the policy
engines and the teacher, own log folders). With the session's real SGLang server as the judge: a rollout whose rewards,
recomputed from the judge texts kept in each sample, equal the samples' scores, whose judge requests are exactly the
chat-template renderings, and whose parse errors are counted; and `megarl train` for one step with the policy engine
(a tiny model this run starts) and two judge pools (verifier and meta-verifier, at the session server: another
model): the judge texts are in the rollout dumps, reward/judge_parse_errors is in the metrics, and only the policy
engine received weights."""
import json
import os
import subprocess
import sys

import pytest

from megarl.errors import UserError
from megarl.rewards.judge import (META_TEMPLATE, META_TRAINING_TEMPLATE, VERIFIER_TEMPLATE, Judge, JudgeModel,
                                  VerificationQuality, chat_prompt_ids, make_parser, reduce_judgements, reduce_scores,
                                  render, scored, self_verification_reward, split_self_analysis, weighted)
from megarl.rollout.client import Completion
from megarl.testing import tiny_model_dir

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/<package>/ -> repo
DEFAULT = make_parser()  # reward.judge.pattern unset


# --------------------------------------------------------------------------------- parsers used by the configs below
def verdict_by_length(text: str):
    """A judge parser for a random tiny model's texts: unparseable when the length is a multiple of 3, else 1 or 0."""
    return None if len(text) % 3 == 0 else float(len(text) % 2)


def quality_by_length(text: str):
    """The meta-verifier's: unparseable when the length is a multiple of 4, else 0.5 or 1."""
    return None if len(text) % 4 == 0 else 0.5 + 0.5 * (len(text) % 2)


def raises(text: str):
    raise RuntimeError("a broken user parser")


# ------------------------------------------------------------------------------------------------- pure functions
@pytest.mark.unit
@pytest.mark.parametrize("text,expected", [
    ("The steps are right.\n\\boxed{1}", 1.0),
    ("Score: 0.5", 0.5),
    ("I first thought \\boxed{0}, but on reflection \\boxed{ 0.5 }", 0.5),  # the last verdict counts
    ("\\boxed{1} ... after all, Score: 0", 0.0),  # the last of either form
    ("no verdict here", None),
    ("\\boxed{\\text{correct}}", None),
    ("\\boxed{}", None),
    ("Score: high", None),
    ("", None),
])
def test_default_parser_on_hand_written_judgements(text, expected):
    assert DEFAULT(text) == expected


@pytest.mark.unit
def test_other_parsers_never_crash():
    assert make_parser(r"Grade: (\d+)/10")("Grade: 7/10 ... Grade: 9/10") == 9.0
    assert make_parser(r"-?\d+")("between 3 and 12") == 12.0  # no group: the whole match
    assert make_parser(r"Grade: ([A-F])")("Grade: B") is None  # not a number: unparseable
    assert make_parser(r"(\d+)")("1" * 400) is None  # inf: unparseable
    fn = make_parser("", "test_judge:verdict_by_length")
    assert (fn("abc"), fn("abcd"), fn("abcde")) == (None, 0.0, 1.0)
    assert make_parser("", "test_judge:raises")("anything") is None
    for bad in ("nomodule_xyz:f", "test_judge:missing", "test_judge"):
        with pytest.raises(ValueError):
            make_parser("", bad)
    with pytest.raises(ValueError, match="not a regular expression"):
        make_parser("(")


@pytest.mark.unit
def test_reductions_and_parse_error_rules():
    assert reduce_scores([1.0, 0.0, 1.0, 0.5], "mean") == pytest.approx(0.625)
    assert reduce_scores([1.0, 0.0, 1.0, 0.5], "majority") == 1.0
    assert reduce_scores([1.0, 0.0, 0.5], "majority") == 0.0  # a tie: the lowest
    parsed = [1.0, None, 0.5, None]
    assert reduce_judgements(parsed, "mean", "score", 0.25) == pytest.approx((1 + 0.25 + 0.5 + 0.25) / 4)
    assert reduce_judgements(parsed, "mean", "skip", 0.25) == pytest.approx(0.75)
    assert reduce_judgements(parsed, "majority", "score", 0.25) == 0.25
    assert reduce_judgements([None, None], "mean", "skip", -1.0) == -1.0  # nothing parsed: the configured score


@pytest.mark.unit
def test_template_rendering_equals_apply_chat_template():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir("qwen2"))
    user = render("Q: {prompt}\nA: {response}\nRef: {answer} {unknown} \\boxed{x}", prompt="1+2=", response="3",
                  answer=None)
    assert user == "Q: 1+2=\nA: 3\nRef:  {unknown} \\boxed{x}"  # other braces are kept as written
    for system in (None, "You grade solutions."):
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
        expected = tok.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
        assert chat_prompt_ids(tok, user, system) == list(expected)
    assert "{response}" in VERIFIER_TEMPLATE and "{analysis}" in META_TEMPLATE


class ScriptedRouter:
    """Stands in for a pool's EngineRouter: answers each request with the next scripted text; records the requests."""

    def __init__(self, tok, texts):
        self.tok, self.texts, self.requests = tok, list(texts), []

    def generate(self, prompts, params, **kwargs):
        self.requests += list(zip(prompts, params))
        out = []
        for p in prompts:
            ids = self.tok(self.texts.pop(0), add_special_tokens=False)["input_ids"]
            out.append(Completion(list(p), ids, [], "stop", None))
        return out


def _stage(**kw):
    from megarl.trainer.config import JudgeStage

    return JudgeStage(**kw)


@pytest.mark.unit
def test_verifier_times_meta_verifier_and_parse_errors_on_scripted_judgements():
    """Two responses, n=2 verifications each, n=2 meta judgements per parsed verification: value_k = s_k x mean(q),
    an unparseable verification scores by the rule without a meta request, unparseable meta judgements too."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir("qwen2"))
    verifier = ScriptedRouter(tok, ["fine \\boxed{1}", "Score: 0.5", "hmm", "\\boxed{0}"])
    meta = ScriptedRouter(tok, ["\\boxed{1}", "\\boxed{0.5}", "no idea", "\\boxed{1}", "\\boxed{1}", "\\boxed{1}"])
    judge = Judge(JudgeModel(_stage(n=2, parse_error_score=0.2), verifier, tok, VERIFIER_TEMPLATE),
                  JudgeModel(_stage(n=2, on_parse_error="skip"), meta, tok, META_TEMPLATE))
    verdicts = judge.score(["1+1=", "2+2="], ["2", "5"], ["2", "4"], [11, 12])
    a, b = verdicts
    assert a.scores == [1.0, 0.5] and a.meta_scores == [[1.0, 0.5], [None, 1.0]]
    assert a.score == pytest.approx((1.0 * 0.75 + 0.5 * 1.0) / 2) and a.parse_errors == 1
    assert b.scores == [None, 0.0] and b.meta_texts[0] == [] and b.meta_scores == [[], [1.0, 1.0]]
    assert b.score == pytest.approx((0.2 + 0.0) / 2) and b.parse_errors == 1
    assert len(verifier.requests) == 4 and len(meta.requests) == 6  # no meta request for the unparsed analysis
    # the meta-verifier saw the analysis it judges, in its chat template
    assert meta.requests[4][0] == chat_prompt_ids(tok, render(META_TEMPLATE, prompt="2+2=", response="5",
                                                              analysis="\\boxed{0}"))
    assert all(p["sampling_seed"] != q["sampling_seed"] for (_, p), (_, q) in zip(verifier.requests[::2],
                                                                                 verifier.requests[1::2]))
    info = a.info()
    assert info["judge"]["texts"] == ["fine \\boxed{1}", "Score: 0.5"] and info["judge_parse_errors"] == 1
    json.dumps(info)  # goes into the rollout dumps as is


@pytest.mark.unit
def test_judge_scale_and_end_of_turn():
    """A number outside reward.judge.score_range is a malformed judgement (a parse error, scored by the rule), and
    every judge request stops at the judge's chat end token as well as its EOS (a ChatML model whose EOS is not
    <|im_end|> would otherwise write past its verdict: "Score: 1" then "2..." parses as 12)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir("qwen2"))
    texts = ["Score: 12", "Score: 1", "Score: -0.5", "Score: 7"]
    judge = Judge(JudgeModel(_stage(parse_error_score=0.0), ScriptedRouter(tok, texts[:3]), tok, VERIFIER_TEMPLATE))
    verdicts = judge.score(["1+1="] * 3, ["2"] * 3, ["2"] * 3, [1, 2, 3])
    assert [v.scores for v in verdicts] == [[None], [1.0], [None]] and [v.parse_errors for v in verdicts] == [1, 0, 1]
    ten = ScriptedRouter(tok, texts[3:])
    assert Judge(JudgeModel(_stage(score_range=[1, 10]), ten, tok, VERIFIER_TEMPLATE)).score(
        ["1+1="], ["2"], ["2"], [4])[0].score == 7.0
    stops = ten.requests[0][1]["stop_token_ids"]
    assert tok.convert_tokens_to_ids("<|im_end|>") in stops and tok.eos_token_id in stops


@pytest.mark.unit
def test_self_verification_reward_is_deepseekmath_v2s_rule():
    """R = R_format * (alpha * s + beta * (1 - |s' - s|) * R_meta(Z)), the paper's alpha = 0.76, beta = 0.24."""
    assert self_verification_reward(1.0, 1.0) == pytest.approx(1.0)
    assert self_verification_reward(0.0, 0.0) == pytest.approx(0.24)  # a wrong solution, honestly assessed
    assert self_verification_reward(0.0, 1.0) == pytest.approx(0.0)  # a wrong solution claimed right
    assert self_verification_reward(0.5, 1.0, 0.5) == pytest.approx(0.76 * 0.5 + 0.24 * 0.5 * 0.5)
    assert self_verification_reward(1.0, None) == 0.0  # no self-assessment: no reward, however good the solution
    assert self_verification_reward(1.0, 0.0, alpha=0.5, beta=0.5) == pytest.approx(0.5)
    assert split_self_analysis("x = 2\nSelf-evaluation: fine \\boxed{1}", "Self-evaluation:") == \
        ("x = 2", "fine \\boxed{1}")
    assert split_self_analysis("x = 2", "Self-evaluation:") == ("x = 2", None)


@pytest.mark.unit
def test_verifier_agreement_rewards_the_verifier_for_matching_the_label():
    """Training a verifier: R = R_format * (1 - |s' - s|), s the label, s' the policy's last boxed score."""
    from megarl.rewards import resolve_reward

    reward = resolve_reward("verifier_agreement")
    assert reward("step 2 is wrong. \\boxed{0}", "0") == 1.0
    assert reward("minor gap \\boxed{0.5}", "1") == 0.5
    assert reward("\\boxed{1} ... on reflection Score: 0", "1") == 0.0  # the last score counts
    assert reward("looks fine", "1") == 0.0 and reward("\\boxed{3}", "1") == 0.0  # no score in [0, 1]: format 0
    with pytest.raises(ValueError, match="labelled score"):
        reward("\\boxed{1}", "correct")


@pytest.mark.unit
def test_verifier_training_reward_weighted_by_the_meta_verifier():
    """Training a verifier with a meta-verifier (DeepSeekMath-V2 sec. 2.1.2): R = R_format * R_score * q, q the
    meta-verifier's quality of the policy's analysis, which it reads with the verification request."""
    from concurrent.futures import Future

    from transformers import AutoTokenizer

    from megarl.rewards import resolve_reward

    tok = AutoTokenizer.from_pretrained(tiny_model_dir("qwen2"))
    meta = ScriptedRouter(tok, ["\\boxed{1}", "\\boxed{0}", "made up \\boxed{0.5}", "no verdict", "\\boxed{1}",
                                "\\boxed{1}"])
    quality = VerificationQuality(JudgeModel(_stage(n=2, on_parse_error="skip"), meta, tok, META_TRAINING_TEMPLATE))
    requests = ["Problem: 1+1=\nProof: 2", "Problem: 2+2=\nProof: 5", "Problem: 3+3=\nProof: 6"]
    analyses = ["fine \\boxed{1}", "step 1 is wrong \\boxed{0}", "looks fine \\boxed{1}"]
    labels = ["1", "0", "1"]
    infos = quality.judge(requests, analyses, labels, [1, 2, None])
    assert [i["meta_verifier"]["quality"] for i in infos] == [0.5, 0.5, 1.0]
    assert [i["judge_parse_errors"] for i in infos] == [0, 1, 0]
    assert meta.requests[2][0] == chat_prompt_ids(tok, render(META_TRAINING_TEMPLATE, prompt=requests[1],
                                                              analysis=analyses[1]))
    assert "sampling_seed" not in meta.requests[4][1]  # no seed, no sampling_seed
    rule = resolve_reward("verifier_agreement")
    pool: Future = Future()
    out = weighted(pool, [i["meta_verifier"]["quality"] for i in infos])
    pool.set_result([(rule(a, y), None) for a, y in zip(analyses, labels)])
    assert out.result() == [(0.5, None), (0.5, None), (1.0, None)]
    failing: Future = Future()
    broken = weighted(failing, [1.0])
    failing.set_exception(RuntimeError("reward worker died"))
    with pytest.raises(RuntimeError, match="reward worker died"):
        broken.result()
    assert weighted(scored([0.5]), [0.5]).result() == [(0.25, None)]
    json.dumps(infos)


@pytest.mark.unit
def test_self_verification_judges_the_solution_alone_and_the_self_analysis_by_the_meta_verifier():
    """Three responses: solution + self-analysis with a score; no self-analysis; a self-analysis without a score.
    The verifier sees each solution without its self-analysis; the meta-verifier judges the verifier's analyses and
    then the one parseable self-analysis; the rewards follow the rule above."""
    from transformers import AutoTokenizer

    from megarl.trainer.config import SelfVerificationConfig

    tok = AutoTokenizer.from_pretrained(tiny_model_dir("qwen2"))
    verifier = ScriptedRouter(tok, ["\\boxed{0.5}", "\\boxed{0}", "\\boxed{1}"])
    meta = ScriptedRouter(tok, ["\\boxed{1}", "\\boxed{1}", "\\boxed{1}", "\\boxed{0.5}"])
    judge = Judge(JudgeModel(_stage(), verifier, tok, VERIFIER_TEMPLATE),
                  JudgeModel(_stage(), meta, tok, META_TEMPLATE), SelfVerificationConfig())
    responses = ["x = 2\nSelf-evaluation: correct \\boxed{1}", "x = 5", "x = 4 Self-evaluation: no idea"]
    a, b, c = judge.score(["1+1=", "2+3=", "2+2="], responses, ["2", "5", "4"], [1, 2, 3])
    assert verifier.requests[0][0] == chat_prompt_ids(tok, render(VERIFIER_TEMPLATE, prompt="1+1=", response="x = 2",
                                                                  answer="2"))
    assert len(meta.requests) == 4 and meta.requests[3][0] == chat_prompt_ids(
        tok, render(META_TEMPLATE, prompt="1+1=", response="x = 2", analysis="correct \\boxed{1}"))
    assert a.score == pytest.approx(0.76 * 0.5 + 0.24 * 0.5 * 0.5)
    assert a.self_verification == {"proof_score": 0.5, "analysis": "correct \\boxed{1}", "self_score": 1.0,
                                   "format_ok": True, "meta_texts": ["\\boxed{0.5}"], "meta_scores": [0.5]}
    assert b.score == 0.0 and b.self_verification["analysis"] is None and b.self_verification["proof_score"] == 0.0
    assert c.score == 0.0 and c.self_verification["proof_score"] == 1.0 and not c.self_verification["format_ok"]
    info = a.info()
    assert (info["self_verified"], info["self_format_ok"], info["proof_score"]) == (1, 1, 0.5)
    json.dumps(info)
    from megarl.trainer.batching import Sample
    from megarl.trainer.rollout import rollout_metrics

    metrics = rollout_metrics([Sample(0, i, [1], [2], [-0.1], "stop", reward=v.score, extra=v.info())
                               for i, v in enumerate((a, b, c))])
    assert metrics["reward/self_format_frac"] == pytest.approx(1 / 3)
    assert metrics["reward/proof_score_mean"] == pytest.approx(0.5)  # (0.5 + 0 + 1) / 3


# ------------------------------------------------------------------------------------------------------ config
def _cfg(*overrides):
    from megarl.trainer import load_train_config

    return load_train_config(None, [f"model.path={tiny_model_dir('qwen2')}", *overrides])


JUDGE = ["reward.name=judge", "pools.judge.urls=[http://j:1]"]


@pytest.mark.unit
@pytest.mark.parametrize("overrides,field", [
    (["reward.name=judge"], "reward.judge.pool"),
    (["pools.judge.modle=/m"], "unknown config key 'pools.judge.modle'"),
    (["pools.judge.model=/m", "pools.judge.urls=[http://x:1]"], "pools.judge.model"),
    (["pools.judge.tp_size=1"], "pools.judge"),
    (["pools.judge.model=/m", "pools.judge.dtype=fp8"], "pools.judge.dtype"),
    (["pools.judge.model=/m", "pools.judge.num_engines=0"], "pools.judge.num_engines"),
    (["pools.teacher.model=/m"], "pools.teacher"),
    (["algorithm.advantage_estimator=opd", "teacher.model=/m", "teacher.num_engines=2"], "teacher.num_engines"),
    (JUDGE + ["reward.judge.reduce=median"], "reward.judge.reduce"),
    (JUDGE + ["reward.judge.n=0"], "reward.judge.n"),
    (JUDGE + ["reward.judge.on_parse_error=crash"], "reward.judge.on_parse_error"),
    (JUDGE + ["reward.judge.template=Rate it"], "reward.judge.template"),
    (JUDGE + ["reward.judge.pattern=("], "reward.judge.pattern"),
    (JUDGE + ["reward.judge.parser=nomodule_xyz:score"], "reward.judge.parser"),
    (JUDGE + ["reward.judge.meta_verifier.pool=meta"], "reward.judge.meta_verifier.pool"),
    (JUDGE + ["reward.judge.meta_verifier.template=Check {response}"], "reward.judge.meta_verifier.template"),
    (JUDGE + ["reward.judge.self_verification.beta=-1"], "reward.judge.self_verification"),
    (JUDGE + ["reward.judge.self_verification.pattern=("], "reward.judge.self_verification.pattern"),
    (["reward.name=verifier_agreement", "reward.judge.meta_verifier.pool=meta"], "reward.judge.meta_verifier.pool"),
    (JUDGE + ["reward.eval_name=judge"], "reward.eval_name"),
    (JUDGE + ["reward.judge.score_range=[1, 0]"], "reward.judge.score_range"),
    (JUDGE + ["reward.eval_name=exact_mtch"], "reward.eval_name"),
    (["reward.name=verifier_agreement", "pools.meta.urls=[http://m:1]", "reward.judge.meta_verifier.pool=meta",
      "reward.judge.meta_verifier.template=Judge {prompt}"], "reward.judge.meta_verifier.template"),
])
def test_config_errors_are_one_line_naming_the_field(overrides, field):
    with pytest.raises(UserError) as info:
        _cfg(*overrides)
    message = str(info.value)
    assert "\n" not in message and message.startswith(field), message
    assert "Fix:" in message or "choose one of" in message or "Did you mean" in message, message


@pytest.mark.unit
def test_pool_servers_follow_the_policy_engines_and_the_teacher(monkeypatch, tmp_path):
    from megarl.rollout.fleet import launch_teacher
    from megarl.rollout.pools import EnginePools
    from megarl.rollout.server import SGLangServer
    from megarl.trainer.config import fleet_spec

    monkeypatch.setattr(SGLangServer, "launch", lambda self: self)  # the configs only: no process
    cfg = _cfg(f"run_dir={tmp_path}", "rollout.engine.num_engines=2", "rollout.return_routed_experts=true",
               "algorithm.advantage_estimator=opd", "teacher.model=/teacher", "teacher.tp_size=2",
               "pools.judge.model=/judge", "pools.judge.num_engines=2", "pools.judge.tp_size=2",
               "pools.judge.dtype=bfloat16", "pools.judge.max_total_tokens=1000", "pools.meta.urls=[http://m:1]",
               "pools.meta.router_policy=round_robin")
    fleet = fleet_spec(cfg)
    teacher = launch_teacher(fleet, 0, now=True).cfg
    assert (teacher.model_path, teacher.base_gpu_id, teacher.log_dir) == ("/teacher", 2, str(tmp_path / "engine" /
                                                                                            "teacher"))
    pools = EnginePools(fleet, rank=0).launch(now=True)
    judge = [s.cfg for s in pools.servers["judge"]]
    assert [(c.model_path, c.tp_size, c.dtype, c.max_total_tokens, c.base_gpu_id) for c in judge] == \
        [("/judge", 2, "bfloat16", 1000, 4), ("/judge", 2, "bfloat16", 1000, 6)]  # GPUs 0-1 policy, 2-3 teacher
    assert all(c.log_dir == str(tmp_path / "engine" / "judge") and "--enable-return-routed-experts" not in c.extra_args
               for c in judge)
    assert set(pools.servers) == {"judge"} and not EnginePools(fleet, rank=1).launch(now=True).servers
    routers = pools.routers({"judge": [], "meta": ["http://m:1"]})
    assert [c.server for c in routers["judge"].clients] == pools.servers["judge"]
    assert [c.url for c in routers["meta"].clients] == ["http://m:1"] and routers["meta"].policy == "round_robin"


# ------------------------------------------------------------------------------------------ with a real engine
# short templates: the tiny judge model's context is 256 tokens
VERIFY, META = "P: {prompt} R: {response} A: {answer}", "P: {prompt} R: {response} V: {analysis}"
JUDGE_SETTINGS = [f"reward.judge.template='{VERIFY}'", f"reward.judge.meta_verifier.template='{META}'",
                  "reward.judge.n=2", "reward.judge.max_new_tokens=8", "reward.judge.temperature=1.0",
                  "reward.judge.parser=test_judge:verdict_by_length", "reward.judge.parse_error_score=0.25"]


def _expected(extra) -> float:
    """A sample's score recomputed from the judge texts it keeps: the parsers and rules written out by hand."""
    values = []
    for k, text in enumerate(extra["judge"]["texts"]):
        s = verdict_by_length(text)
        if s is None:
            values.append(0.25)
            continue
        qs = [quality_by_length(t) for t in extra["judge"]["meta_texts"][k]]
        qs = [q for q in qs if q is not None]  # meta on_parse_error: skip
        values.append(s * (sum(qs) / len(qs) if qs else 0.0))
    return sum(values) / len(values)


def _parse_errors(extra) -> int:
    return sum(verdict_by_length(t) is None for t in extra["judge"]["texts"]) + \
        sum(quality_by_length(t) is None for group in extra["judge"]["meta_texts"] for t in group)


@pytest.mark.engine
def test_rollout_judged_by_a_real_engine(tiny_qwen2_engine, tmp_path):
    from transformers import AutoTokenizer

    from megarl.data import ChatTokenizer, load_prompts
    from megarl.rewards import RewardPool
    from megarl.rollout import EngineClient, EngineRouter
    from megarl.trainer.config import rollout_inputs
    from megarl.trainer.rollout import PromptStream, rollout_metrics
    from megarl.trainer.workers import build_rollout

    path, url = tiny_model_dir("qwen2"), tiny_qwen2_engine.url
    cfg = _cfg(f"run_dir={tmp_path}", "rollout.n_samples=2", "rollout.prompts_per_step=3", "rollout.request_size=2",
               "rollout.max_new_tokens=6", "data.synthetic.num_train=20", "logging.progress=false",
               "reward.name=judge", "reward.workers=1", f"pools.judge.urls=[{url}]", f"pools.meta.urls=[{url}]",
               *JUDGE_SETTINGS, "reward.judge.meta_verifier.pool=meta", "reward.judge.meta_verifier.n=2",
               "reward.judge.meta_verifier.max_new_tokens=8", "reward.judge.meta_verifier.on_parse_error=skip",
               "reward.judge.meta_verifier.parser=test_judge:quality_by_length")
    tok = ChatTokenizer.from_pretrained(path)
    judge_tok = AutoTokenizer.from_pretrained(path)

    class Recording(EngineRouter):
        requests = []

        def generate(self, prompts, params, **kwargs):
            done = super().generate(prompts, params, **kwargs)
            Recording.requests += [(p, q, len(c.output_ids)) for p, q, c in zip(prompts, params, done)]
            return done

    rewards = RewardPool(cfg.reward.name, cfg.reward.workers)
    rollout = build_rollout(rollout_inputs(cfg), tok, EngineRouter([EngineClient(url)]), rewards,
                            pool_routers={"judge": Recording([EngineClient(url)]),
                                          "meta": EngineRouter([EngineClient(url)])})
    try:
        stream = PromptStream(load_prompts("synthetic", tok, cfg.data), seed=0)
        records = {r.index: r for r in stream.records}
        samples, _ = rollout.collect(stream, step=1)
    finally:
        rollout.close()
        rewards.close()
    assert len(samples) == 6
    expected_requests = []
    for s in samples:
        judged = s.extra["judge"]
        assert len(judged["texts"]) == 2 and len(judged["meta_texts"]) == 2
        assert s.reward == pytest.approx(_expected(s.extra), abs=1e-9)
        assert s.extra["judge_parse_errors"] == _parse_errors(s.extra)
        user = render(VERIFY, prompt=records[s.prompt_index].text, response=s.extra["final_text"],
                      answer=records[s.prompt_index].answer)
        expected_requests.append(judge_tok.apply_chat_template([{"role": "user", "content": user}],
                                                               add_generation_prompt=True)["input_ids"])
    # the verifier pool got exactly the chat-template renderings, n=2 each, with the configured sampling settings
    sent = sorted(list(p) for p, _, _ in Recording.requests)
    assert sent == sorted(list(p) for p in expected_requests for _ in range(2))
    assert all(q["max_new_tokens"] == 8 and q["temperature"] == 1.0 and n <= 8 for _, q, n in Recording.requests)
    metrics = rollout_metrics(samples)
    assert metrics["reward/judge_parse_errors"] == sum(_parse_errors(s.extra) for s in samples)


@pytest.mark.engine
def test_held_out_evaluation_of_a_judged_run_uses_the_eval_checker(tiny_qwen2_engine, tmp_path):
    """reward.eval_name: held-out samples are scored by the checker (pass@1 is the exact checker's), the judge's score
    of each is kept beside it, and the two agreement metrics are counted from those pairs."""
    from megarl.data import ChatTokenizer, load_prompts
    from megarl.rewards import RewardPool, resolve_reward
    from megarl.rollout import EngineClient, EngineRouter
    from megarl.trainer.config import rollout_inputs
    from megarl.trainer.workers import build_rollout

    path, url = tiny_model_dir("qwen2"), tiny_qwen2_engine.url
    cfg = _cfg(f"run_dir={tmp_path}", "rollout.max_new_tokens=6", "data.synthetic.num_eval=6",
               "logging.progress=false", "reward.name=judge", "reward.eval_name=exact_match", "reward.workers=1",
               f"pools.judge.urls=[{url}]", *JUDGE_SETTINGS[:1], *JUDGE_SETTINGS[2:])
    tok = ChatTokenizer.from_pretrained(path)
    records = load_prompts("synthetic", tok, cfg.data, "eval")
    for r in records[::2]:  # half the answers replaced by what the policy answers: the checker then passes some
        r.answer = None
    rewards, checker = RewardPool(cfg.reward.name, 1), RewardPool("exact_match", 1)
    rollout = build_rollout(rollout_inputs(cfg), tok, EngineRouter([EngineClient(url)]), rewards,
                            pool_routers={"judge": EngineRouter([EngineClient(url)])}, eval_rewards=checker)
    try:
        first = rollout.generate(records[::2], 1, (0, "probe"), 0.0, 6)  # greedy: the eval's T=0 answers
        for r, s in zip(records[::2], first):
            r.answer = s.extra["final_text"]
        samples, generate = [], rollout.generate
        rollout.generate = lambda *a, **k: samples.extend(generate(*a, **k)) or samples  # keep what evaluate sees
        metrics, _ = rollout.evaluate(records, 2, 0.0, "after")
    finally:
        rollout.close()
        rewards.close()
        checker.close()
    exact = resolve_reward("exact_match")
    by_index = {r.index: r for r in records}
    truth = [exact(s.extra["final_text"], by_index[s.prompt_index].answer) for s in samples]
    judged = []
    for s in samples:  # the judge's score from the texts the sample keeps: n=2, parse errors score 0.25
        values = [verdict_by_length(t) for t in s.extra["judge"]["texts"]]
        judged.append(sum(0.25 if v is None else v for v in values) / len(values))
    assert len(samples) == 2 * len(records) == 12
    assert [s.reward for s in samples] == truth and 0 < sum(truth) < len(truth)
    assert [s.extra["train_reward"] for s in samples] == pytest.approx(judged, abs=1e-9)
    assert metrics["eval/pass_at_1"] == pytest.approx(100 * sum(truth) / len(truth))
    assert metrics["eval/train_reward_pass_at_1"] == pytest.approx(100 * sum(j > 0.5 for j in judged) / len(judged))
    assert metrics["eval/train_reward_false_pass"] == pytest.approx(
        100 * sum(j > 0.5 and not t for j, t in zip(judged, truth)) / len(judged))


@pytest.mark.engine
def test_verifier_training_rollout_weighted_by_a_real_meta_verifier(tiny_qwen2_engine, tmp_path):
    """reward.name: verifier_agreement with reward.judge.meta_verifier through the rollout, the meta-verifier at the
    session's real engine: each sample's reward is R_format * R_score (the rule on its own text and label) times the
    quality recomputed from the meta-verifier texts the sample keeps."""
    from megarl.data import ChatTokenizer, load_prompts
    from megarl.rewards import RewardPool, resolve_reward
    from megarl.rollout import EngineClient, EngineRouter
    from megarl.trainer.config import rollout_inputs
    from megarl.trainer.rollout import PromptStream, rollout_metrics
    from megarl.trainer.workers import build_rollout

    data = tmp_path / "verify.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Is {a}+{b}={c} right?", "answer": str(int(a + b == c))}) + "\n"
                            for a, b, c in [(1, 1, 2), (2, 2, 5), (3, 4, 7)]))
    path, url = tiny_model_dir("qwen2"), tiny_qwen2_engine.url
    cfg = _cfg(f"run_dir={tmp_path}", f"data.train={data}", "rollout.n_samples=2", "rollout.prompts_per_step=3",
               "rollout.request_size=2", "rollout.max_new_tokens=6", "logging.progress=false",
               "reward.name=verifier_agreement", "reward.workers=1", f"pools.meta.urls=[{url}]",
               "reward.judge.meta_verifier.pool=meta", "reward.judge.meta_verifier.n=2",
               "reward.judge.meta_verifier.max_new_tokens=8", "reward.judge.meta_verifier.on_parse_error=skip",
               "reward.judge.meta_verifier.template='Q: {prompt} V: {analysis}'",
               "reward.judge.meta_verifier.parser=test_judge:quality_by_length")
    tok = ChatTokenizer.from_pretrained(path)
    rewards = RewardPool(cfg.reward.name, cfg.reward.workers)
    rollout = build_rollout(rollout_inputs(cfg), tok, EngineRouter([EngineClient(url)]), rewards,
                            pool_routers={"meta": EngineRouter([EngineClient(url)])})
    try:
        stream = PromptStream(load_prompts(str(data), tok, cfg.data), seed=0)
        records = {r.index: r for r in stream.records}
        samples, _ = rollout.collect(stream, step=1)
    finally:
        rollout.close()
        rewards.close()
    rule = resolve_reward("verifier_agreement")
    assert len(samples) == 6
    for s in samples:
        judged = s.extra["meta_verifier"]
        assert len(judged["texts"]) == 2 and judged["scores"] == [quality_by_length(t) for t in judged["texts"]]
        kept = [q for q in judged["scores"] if q is not None]
        quality = sum(kept) / len(kept) if kept else 0.0
        assert judged["quality"] == pytest.approx(quality)
        assert s.reward == pytest.approx(rule(s.extra["final_text"], records[s.prompt_index].answer) * quality)
    assert rollout_metrics(samples)["reward/judge_parse_errors"] == \
        sum(q is None for s in samples for q in s.extra["meta_verifier"]["scores"])


def _greedy(url):
    from megarl.rollout import EngineClient

    out = EngineClient(url).generate([[1, 2, 3, 4]], {"max_new_tokens": 6, "temperature": 0.0})[0]
    return out.output_ids, out.output_log_probs, out.weight_version


@pytest.mark.e2e
def test_train_with_judge_pools_syncs_only_the_policy(tiny_qwen2_engine, tmp_path):
    """`megarl train`, one step: the policy engine (a tiny model this run starts, the one that receives weights) and
    two more pools, the verifier and the meta-verifier, at the session server's URL (another model). The judge
    server's weights are untouched by the run's syncs; the dumps keep both judges' texts, and the step's
    reward/judge_parse_errors is their count of unparseable judgements. (A pool this run starts goes through the
    same EnginePools / ServerConfig path as the teacher: tested above without a process, to keep this test short.)"""
    from tiny_rl import write_config

    before = _greedy(tiny_qwen2_engine.url)
    config = write_config(
        tmp_path, "run", rl={"steps": 1, "dump_rollouts": True, "eval_samples": 1},
        data={"synthetic": {"num_eval": 2}},
        reward={"name": "judge", "judge": {
            "pool": "verifier", "template": VERIFY, "n": 2, "max_new_tokens": 8, "parse_error_score": 0.25,
            "parser": "test_judge:verdict_by_length",
            "meta_verifier": {"pool": "meta", "template": META, "n": 2, "max_new_tokens": 8,
                              "on_parse_error": "skip", "parser": "test_judge:quality_by_length"}}},
        pools={"verifier": {"urls": [tiny_qwen2_engine.url]},
               "meta": {"urls": [tiny_qwen2_engine.url], "router_policy": "round_robin"}})
    # the parsers above are "test_judge:..." (this file's folder) and the reward "reward_fns:..." (tests/)
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "tests"), here,
                                                       os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    log = tmp_path / "train.log"
    with open(log, "w") as out:
        rc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--standalone",
                             "-m", "megarl.cli", "train", config], cwd=ROOT, env=env, stdout=out,
                            stderr=subprocess.STDOUT, timeout=600).returncode
    assert rc == 0, f"megarl train failed ({rc}); log tail:\n" + log.read_text()[-4000:]

    from megarl.trainer.rl import dumped_samples

    run = tmp_path / "run"
    dumped = dumped_samples(str(run), 1)
    assert len(dumped) == 16
    for record in dumped:
        extra = record["extra"]
        assert len(extra["judge"]["texts"]) == 2 and len(extra["judge"]["meta_texts"]) == 2
        assert record["reward"] == pytest.approx(_expected(extra), abs=1e-9)
        assert extra["weight_version"] == "step-0"  # the policy engine was synced before the step
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    step = next(r for r in rows if r["step"] == 1 and "grad_norm" in r)
    assert step["reward/judge_parse_errors"] == sum(_parse_errors(r["extra"]) for r in dumped)
    # the judge server: the same greedy tokens, log-probs (to float noise: its prefix cache is warm now) and weight
    # version as before the run (the policy's weights, another shape, would not even load into it)
    ids, log_probs, version = _greedy(tiny_qwen2_engine.url)
    assert (ids, version) == (before[0], before[2]) and log_probs == pytest.approx(before[1], abs=1e-5)


@pytest.mark.engine
def test_a_prompt_too_long_for_the_judge_is_one_line_naming_the_section(tiny_qwen2_engine):
    from transformers import AutoTokenizer

    from megarl.rollout import EngineClient, EngineRouter

    tok = AutoTokenizer.from_pretrained(tiny_model_dir("qwen2"))  # a 256-token context
    model = JudgeModel(_stage(max_new_tokens=8), EngineRouter([EngineClient(tiny_qwen2_engine.url)]), tok,
                       VERIFIER_TEMPLATE, field="reward.judge.meta_verifier")
    with pytest.raises(UserError) as info:
        model.sample([{"prompt": "1+1=", "response": "2 " * 300, "answer": "2"}], [1])
    message = str(info.value)
    assert "\n" not in message and message.startswith("reward.judge.meta_verifier: the judge engine refused"), message
    assert "Fix: a shorter reward.judge.meta_verifier.template" in message
