"""Generative rewards (reward.name: judge): a model served by an engine pool (pools.<name>, megarl.rollout.pools) reads
the prompt and the policy's response and writes a judgement whose score is the reward.

Per response: the template (reward.judge.template) is rendered and wrapped in the judge model's own chat template
(transformers' apply_chat_template of its tokenizer, generation prompt added), n judgements are sampled (each with a
seed derived from the response's own, so reruns draw the same ones), each is parsed to a number (the last match of a
regex, by default the last \\boxed{x} or "Score: x", or a "package.module:function"), and the n numbers are reduced
by mean or majority. A judgement that does not parse is never an error: it is counted (reward/judge_parse_errors) and
scored by reward.judge.on_parse_error (`score`: as parse_error_score; `skip`: left out of the reduction).

Verifier + meta-verifier (reward.judge.meta_verifier), after DeepSeekMath-V2 (Shao et al. 2025, "DeepSeekMath-V2:
Towards Self-Verifiable Mathematical Reasoning", arXiv:2511.22570, sec. 2.1): the verifier writes an analysis of the
proof ending in a score s in {0, 0.5, 1}; the meta-verifier reads (problem, proof, analysis) and scores whether the
issues the analysis claims are real and its score justified, a quality q in [0, 1]. The paper makes q a factor of the
verification's reward, R = R_format * R_score * R_meta (an analysis whose claims are not real earns nothing, whatever
its score). megarl applies the same multiplicative rule to each verification of a response: its value is s_k * q_k,
where q_k reduces the meta-verifier's judgements of analysis k; unparseable analyses take the on_parse_error rule (they
have no claims to check, so they are not sent to the meta-verifier); the response's score reduces the values over its
n analyses. Both models' texts are kept per sample (Sample.extra["judge"], so they land in the rollout dumps).

Self-verification (reward.judge.self_verification), DeepSeekMath-V2 sec. 2.2.2: the generator writes a solution Y,
then, after a marker, its own analysis Z of Y ending in a self-score s'. The verifier (and meta-verifier, as above)
judges Y alone, giving s = R_Y; the meta-verifier, when configured, also scores Z's faithfulness, R_meta(Z) (1 without
one). The reward is R = R_format(Y, Z) * (alpha * R_Y + beta * R_Z) with R_Z = R_score(s', s) * R_meta(Z),
R_score(s', s) = 1 - |s' - s|, and R_format = 0 when the marker or a parseable s' is missing (paper: alpha = 0.76,
beta = 0.24): the generator gains by a better solution and by an honest assessment of its own.

Judging runs in the rollout's chunk threads (megarl.trainer.rollout.Rollout.generate): each chunk's responses are
judged as soon as the chunk returns, while later chunks still generate.
"""
from __future__ import annotations

import math
import re
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from ..data.chat import stop_token_ids
from ..errors import UserError
from ..rollout.server import EngineError
from .functions import register_reward

if TYPE_CHECKING:
    from ..trainer.config import JudgeConfig, JudgeStage, PoolConfig, RewardConfig

VERIFIER_TEMPLATE = ("Problem:\n{prompt}\n\nReference answer: {answer}\n\nSolution:\n{response}\n\nIs the solution "
                     "correct? Explain briefly, then end with \\boxed{1} (correct), \\boxed{0.5} (partly correct) or "
                     "\\boxed{0} (wrong).")
META_TEMPLATE = ("Problem:\n{prompt}\n\nSolution:\n{response}\n\nA grader's analysis of the solution:\n{analysis}\n\n"
                 "Are the issues the analysis claims real, and is its score justified? Explain briefly, then end with "
                 "\\boxed{1} (faithful), \\boxed{0.5} (partly) or \\boxed{0} (not faithful).")

# training a verifier (reward.name: verifier_agreement): the policy's prompt is the verification request (problem and
# proof), its response the analysis
META_TRAINING_TEMPLATE = ("A grader was asked:\n{prompt}\n\nThe grader's analysis:\n{analysis}\n\nAre the issues the "
                          "analysis claims real, and is its score justified? Explain briefly, then end with \\boxed{1} "
                          "(faithful), \\boxed{0.5} (partly) or \\boxed{0} (not faithful).")

# the last \boxed{x} or "Score: x" (x a plain decimal number)
DEFAULT_PATTERN = r"\\boxed\{\s*([-+]?\d*\.?\d+)\s*\}|Score:\s*([-+]?\d*\.?\d+)"
_DEFAULT_REGEX = re.compile(DEFAULT_PATTERN)
_PLACEHOLDER = re.compile(r"\{(prompt|response|answer|analysis)\}")


@register_reward("judge")
def judge(response: str, answer, **_) -> float:
    """The name reward.name: judge resolves to. A generative reward is scored by the rollout through its judge pool
    (Judge below), never in a reward process: reaching here is a wiring error."""
    raise RuntimeError("reward.name=judge is scored by the rollout's Judge (megarl.rewards.judge), not by RewardPool")


@register_reward("verifier_agreement")
def verifier_agreement(response: str, answer, **_) -> float:
    """Training a verifier (DeepSeekMath-V2 sec. 2.1.1): the policy is the verifier, its prompt a verification request
    for a (problem, solution) pair, its answer the pair's labelled score s. The response is an analysis ending in a
    score s' (the last \\boxed{x} or "Score: x"); R = R_format * R_score = 1 - |s' - s|, and 0 when no score in [0, 1]
    parses (R_format)."""
    label = _number(answer)
    if label is None or not 0.0 <= label <= 1.0:
        raise ValueError(f"verifier_agreement: the answer must be the labelled score in [0, 1], got {answer!r}. Fix: "
                         "each data row's answer is the (problem, solution)'s score, e.g. 0, 0.5 or 1")
    score = parse_score(response, _DEFAULT_REGEX)
    if score is None or not 0.0 <= score <= 1.0:
        return 0.0
    return 1.0 - abs(score - label)


# ------------------------------------------------------------------------------------------------- pure functions
def render(template: str, **fields) -> str:
    """The template with {prompt}, {response}, {answer} and {analysis} replaced (None: ""); other braces kept."""
    return _PLACEHOLDER.sub(lambda m: "" if fields.get(m.group(1)) is None else str(fields[m.group(1)]), template)


def chat_prompt_ids(tokenizer, user: str, system: str | None = None) -> list[int]:
    """The judge's request: the user message (after an optional system message) through the judge tokenizer's chat
    template with the generation prompt, as token ids."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _number(value) -> float | None:
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def parse_score(text: str, pattern: re.Pattern) -> float | None:
    """The number in the last match of `pattern` (its first non-empty group, or the whole match without groups);
    None when nothing matches or the match is not a finite number."""
    last = None
    for last in pattern.finditer(text):
        pass
    if last is None:
        return None
    groups = [g for g in last.groups() if g]
    return _number(groups[0] if groups else last.group(0))


def make_parser(pattern: str | None = None, parser: str | None = None) -> Callable[[str], float | None]:
    """text -> score or None: `parser` ("package.module:function", returning a number or None) when given, else the
    regex `pattern` (parse_score; None: DEFAULT_PATTERN). A parser that raises or returns a non-number counts as unparseable. Raises
    ValueError for a pattern that does not compile or a parser that does not import."""
    if parser:
        import importlib

        module, _, attr = parser.partition(":")
        try:
            fn = getattr(importlib.import_module(module), attr) if module and attr else None
        except (ImportError, AttributeError) as e:
            raise ValueError(f"cannot import {attr!r} from {module!r} ({e}). Fix: a \"package.module:function\" "
                             "taking the judge's text and returning a number or None") from None
        if not callable(fn):
            raise ValueError(f"{parser!r} is not a callable \"package.module:function\". Fix: e.g. "
                             "\"my_pkg.judging:score\"")

        def parse(text: str) -> float | None:
            try:
                return _number(fn(text))
            except Exception:  # a user parser's failure is a parse error, never a crash
                return None
        return parse
    pattern = DEFAULT_PATTERN if pattern is None else pattern
    try:
        regex = re.compile(pattern)
    except re.error as e:
        raise ValueError(f"{pattern!r} is not a regular expression ({e}). Fix: e.g. the default, the last "
                         r"\boxed{x} or 'Score: x'") from None
    return lambda text: parse_score(text, regex)


def reduce_scores(scores: list[float], how: str) -> float:
    """mean, or majority: the most frequent value (ties: the lowest, a conservative judge)."""
    if not scores:
        raise ValueError("reduce_scores needs at least one score")
    if how == "mean":
        return sum(scores) / len(scores)
    if how == "majority":
        counts = Counter(scores)
        top = max(counts.values())
        return min(v for v, c in counts.items() if c == top)
    raise ValueError(f"unknown reduction {how!r}; choose mean or majority")


def reduce_judgements(parsed: list[float | None], how: str, on_parse_error: str, parse_error_score: float) -> float:
    """One score from n parsed judgements (None: unparseable): `score` counts those as parse_error_score, `skip` leaves
    them out; with nothing left, parse_error_score."""
    if on_parse_error == "skip":
        kept = [p for p in parsed if p is not None]
    else:
        kept = [parse_error_score if p is None else p for p in parsed]
    return reduce_scores(kept, how) if kept else parse_error_score


def split_self_analysis(response: str, marker: str) -> tuple[str, str | None]:
    """(solution Y, self-analysis Z) split at the last `marker` (which belongs to neither); Z is None without one."""
    at = response.rfind(marker)
    if at < 0:
        return response, None
    return response[:at].rstrip(), response[at + len(marker):].strip()


def self_verification_reward(proof_score: float, self_score: float | None, meta_quality: float = 1.0,
                             alpha: float = 0.76, beta: float = 0.24) -> float:
    """DeepSeekMath-V2's generator reward: alpha * s + beta * (1 - |s' - s|) * R_meta(Z), with s the verifier's score of
    the solution and s' the generator's own; 0 (R_format) when s' is None (no self-analysis or no parseable score)."""
    if self_score is None:
        return 0.0
    return alpha * proof_score + beta * (1.0 - abs(self_score - proof_score)) * meta_quality


# ------------------------------------------------------------------------------------------------ judging
@dataclass
class Verdict:
    """The judging of one response: its score and everything behind it (JSON-ready, for the rollout dumps)."""
    score: float
    texts: list[str]  # the verifier's n judgements
    scores: list[float | None]  # each parsed (None: unparseable)
    meta_texts: list[list[str]] | None = None  # per verifier judgement: the meta-verifier's (empty when unparsed)
    meta_scores: list[list[float | None]] | None = None
    parse_errors: int = 0  # unparseable judgements, the meta-verifier's included
    # self-verification: {"proof_score", "analysis", "self_score", "format_ok", "meta_texts", "meta_scores"}
    self_verification: dict | None = None

    def info(self) -> dict:
        """For Sample.extra: {"judge": {...}, "judge_parse_errors": n, "judged": 1} (the last two are summed into
        reward/judge_parse_errors by megarl.trainer.rollout.rollout_metrics; with self-verification also
        "self_verified", "self_format_ok" and "proof_score", summed into reward/self_format_frac and
        reward/proof_score_mean)."""
        judged = {"score": self.score, "texts": self.texts, "scores": self.scores}
        if self.meta_texts is not None:
            judged.update(meta_texts=self.meta_texts, meta_scores=self.meta_scores)
        info = {"judge": judged, "judge_parse_errors": self.parse_errors, "judged": 1}
        if self.self_verification is not None:
            judged["self_verification"] = self.self_verification
            info.update(self_verified=1, self_format_ok=int(self.self_verification["format_ok"]),
                        proof_score=self.self_verification["proof_score"])
        return info


class JudgeModel:
    """One stage (the verifier, or the meta-verifier): its settings (a JudgeStage), the router of its pool and the
    tokenizer whose chat template renders its prompts."""

    def __init__(self, stage, router, tokenizer, default_template: str, deterministic: bool = True,
                 field: str = "reward.judge"):
        self.stage, self.router, self.tok, self.deterministic = stage, router, tokenizer, deterministic
        self.field = field  # the config section, for errors
        self.template = stage.template or default_template
        self._number = make_parser(stage.pattern, stage.parser)
        self.stop_ids = stop_token_ids(tokenizer)  # the judge's turn ends at its chat end token, not only at EOS

    def parse(self, text: str) -> float | None:
        """The judgement's score; a number outside the judge's scale (stage.score_range) is a malformed judgement
        ("Score: 12" on a 0..1 scale), unparseable like text without a score."""
        x = self._number(text)
        low, high = self.stage.score_range
        return x if x is not None and low <= x <= high else None

    def prompt_ids(self, **fields) -> list[int]:
        return chat_prompt_ids(self.tok, render(self.template, **fields), self.stage.system)

    def sample(self, items: list[dict], seeds: list[int | None]) -> list[list[str]]:
        """n judgements (decoded texts) for each item (the template's fields), in one batched request to the pool."""
        s, n = self.stage, self.stage.n
        prompts = [self.prompt_ids(**item) for item in items]
        params = []
        for seed in seeds:
            for k in range(n):
                p = {"max_new_tokens": s.max_new_tokens, "temperature": s.temperature, "top_p": s.top_p,
                     "stop_token_ids": self.stop_ids}
                if seed is not None and self.deterministic:
                    p["sampling_seed"] = (seed * 1_000_003 + k) % (1 << 63)
                params.append(p)
        if not prompts:
            return []
        try:
            done = self.router.generate([p for p in prompts for _ in range(n)], params, return_logprob=False)
        except EngineError as e:
            if "(HTTP 4" not in str(e):  # the engine itself failed: its own error
                raise
            longest = max(map(len, prompts))
            raise UserError(f"{self.field}: the judge engine refused a request (longest prompt {longest} tokens + "
                            f"max_new_tokens={s.max_new_tokens}): {str(e).splitlines()[0][:300]}. Fix: a shorter "
                            f"{self.field}.template, a smaller {self.field}.max_new_tokens, or a judge model with a "
                            "longer context") from None
        texts = [self.tok.decode(c.output_ids, skip_special_tokens=True) for c in done]
        return [texts[i * n:(i + 1) * n] for i in range(len(items))]


class Judge:
    """reward.name: judge. score(...) judges a chunk of responses; with a meta-verifier, as DeepSeekMath-V2 composes
    them (module docstring)."""

    def __init__(self, verifier: JudgeModel, meta: JudgeModel | None = None, self_verification=None):
        self.verifier, self.meta = verifier, meta
        self.self_verification = self_verification  # a SelfVerificationConfig, or None
        if self_verification is not None:
            self.parse_self_score = make_parser(self_verification.pattern)

    @classmethod
    def from_config(cls, judge: JudgeConfig, pools: dict[str, PoolConfig], routers: dict,
                    deterministic: bool = True) -> "Judge":
        """From reward.judge, the pools' settings (pools:) and their routers (megarl.rollout.pools.EnginePools)."""
        meta = judge_model(judge.meta_verifier, pools, routers, META_TEMPLATE, "reward.judge.meta_verifier",
                           deterministic) if judge.meta_verifier else None
        return cls(judge_model(judge, pools, routers, VERIFIER_TEMPLATE, "reward.judge", deterministic), meta,
                   judge.self_verification)

    def score(self, prompts: list[str], responses: list[str], answers: list, seeds: list[int | None]) -> list[Verdict]:
        """One Verdict per response (its score is the reward)."""
        if self.self_verification is None:
            return self._judge(prompts, responses, answers, seeds)
        sv = self.self_verification
        split = [split_self_analysis(r, sv.marker) for r in responses]
        verdicts = self._judge(prompts, [y for y, _ in split], answers, seeds)  # the verifier sees the solution only
        self_scores = [None if z is None else self.parse_self_score(z) for _, z in split]
        # R_meta(Z): the meta-verifier reads the self-analysis as it reads a verifier's analysis (one batched request)
        asks = [i for i, s in enumerate(self_scores) if s is not None] if self.meta is not None else []
        meta_texts = self.meta.sample([{"prompt": prompts[i], "response": split[i][0], "answer": answers[i],
                                        "analysis": split[i][1]} for i in asks],
                                      [None if seeds[i] is None else seeds[i] + 104_729 for i in asks]) if asks else []
        by_response = dict(zip(asks, meta_texts))
        m = self.meta.stage if self.meta is not None else None
        for i, (verdict, (_, analysis), self_score) in enumerate(zip(verdicts, split, self_scores)):
            texts = by_response.get(i, [])
            parsed = [self.meta.parse(t) for t in texts]
            quality = reduce_judgements(parsed, m.reduce, m.on_parse_error, m.parse_error_score) if texts else 1.0
            proof_score = verdict.score
            verdict.score = self_verification_reward(proof_score, self_score, quality, sv.alpha, sv.beta)
            verdict.parse_errors += sum(p is None for p in parsed)
            verdict.self_verification = {"proof_score": proof_score, "analysis": analysis, "self_score": self_score,
                                         "format_ok": self_score is not None, "meta_texts": texts,
                                         "meta_scores": parsed}
        return verdicts

    def _judge(self, prompts: list[str], responses: list[str], answers: list, seeds: list[int | None]) -> list[Verdict]:
        v = self.verifier.stage
        items = [{"prompt": p, "response": r, "answer": a} for p, r, a in zip(prompts, responses, answers)]
        texts = self.verifier.sample(items, seeds)
        parsed = [[self.verifier.parse(t) for t in group] for group in texts]
        if self.meta is None:
            return [Verdict(reduce_judgements(ps, v.reduce, v.on_parse_error, v.parse_error_score), ts, ps,
                            parse_errors=sum(p is None for p in ps)) for ts, ps in zip(texts, parsed)]
        m = self.meta.stage
        # the meta-verifier judges every parsed analysis (one batched request for the chunk)
        asks = [(i, k) for i, ps in enumerate(parsed) for k, p in enumerate(ps) if p is not None]
        # one seed per (response, analysis k), apart from the verifier's (which sample() spreads over the n samples)
        meta_texts = self.meta.sample([dict(items[i], analysis=texts[i][k]) for i, k in asks],
                                      [None if seeds[i] is None else seeds[i] + 7919 * (k + 1) for i, k in asks])
        by_analysis = dict(zip(asks, meta_texts))
        verdicts = []
        for i, (ts, ps) in enumerate(zip(texts, parsed)):
            mt = [by_analysis.get((i, k), []) for k in range(len(ts))]
            mp = [[self.meta.parse(t) for t in group] for group in mt]
            values = [None if p is None else p * reduce_judgements(q, m.reduce, m.on_parse_error, m.parse_error_score)
                      for p, q in zip(ps, mp)]
            errors = sum(p is None for p in ps) + sum(q is None for group in mp for q in group)
            verdicts.append(Verdict(reduce_judgements(values, v.reduce, v.on_parse_error, v.parse_error_score), ts, ps,
                                    meta_texts=mt, meta_scores=mp, parse_errors=errors))
        return verdicts


def judge_model(stage: JudgeStage, pools: dict[str, PoolConfig], routers: dict, default_template: str, field: str,
                deterministic: bool) -> JudgeModel:
    """The JudgeModel of one stage: its pool's router (from megarl.rollout.pools.EnginePools) and tokenizer (from the
    pool's settings, pools.<stage.pool>)."""
    from transformers import AutoTokenizer

    from ..rollout.pools import pool_tokenizer_path

    if stage.pool not in routers:
        raise ValueError(f"{field}.pool={stage.pool!r}: no router for that pool was handed to the rollout "
                         f"(have {sorted(routers)})")
    path = pool_tokenizer_path(pools[stage.pool], routers[stage.pool].clients[0], f"pools.{stage.pool}")
    return JudgeModel(stage, routers[stage.pool], AutoTokenizer.from_pretrained(path), default_template,
                      deterministic, field)


class VerificationQuality:
    """Training a verifier with a meta-verifier (reward.name: verifier_agreement + reward.judge.meta_verifier),
    DeepSeekMath-V2 sec. 2.1.2: the meta-verifier reads the verification request and the policy's analysis and scores
    whether the issues it claims are real, q in [0, 1] (n judgements reduced, unparseable ones by the stage's rule);
    the verifier's reward R_format * R_score becomes R_format * R_score * q (`weighted`), so a right score reached by
    a made-up analysis earns nothing."""

    def __init__(self, meta: JudgeModel):
        self.meta = meta

    @classmethod
    def from_config(cls, meta_verifier: JudgeStage, pools: dict[str, PoolConfig], routers: dict,
                    deterministic: bool = True) -> "VerificationQuality":
        """From reward.judge.meta_verifier, the pools' settings (pools:) and their routers."""
        return cls(judge_model(meta_verifier, pools, routers, META_TRAINING_TEMPLATE, "reward.judge.meta_verifier",
                               deterministic))

    def judge(self, prompts: list[str], analyses: list[str], answers: list, seeds: list[int | None]) -> list[dict]:
        """Per response, the info for Sample.extra: {"meta_verifier": {"quality", "texts", "scores"},
        "judge_parse_errors", "judged"} (the quality is the reward's factor)."""
        m = self.meta.stage
        texts = self.meta.sample([{"prompt": p, "response": "", "answer": a, "analysis": z}
                                  for p, z, a in zip(prompts, analyses, answers)],
                                 [None if s is None else s + 104_729 for s in seeds])
        out = []
        for ts in texts:
            ps = [self.meta.parse(t) for t in ts]
            quality = reduce_judgements(ps, m.reduce, m.on_parse_error, m.parse_error_score)
            out.append({"meta_verifier": {"quality": quality, "texts": ts, "scores": ps},
                        "judge_parse_errors": sum(p is None for p in ps), "judged": 1})
        return out


def reward_judges(reward: RewardConfig, pools: dict[str, PoolConfig], routers: dict,
                  deterministic: bool = True) -> tuple[Judge | None, VerificationQuality | None]:
    """The models reward.name has the rollout ask, over the pools' routers: a Judge (reward.name: judge, its score
    is the reward), a VerificationQuality (verifier_agreement with reward.judge.meta_verifier, its quality weights
    the reward); None for each the reward does not use."""
    judge = Judge.from_config(reward.judge, pools, routers, deterministic) if reward.name == "judge" else None
    quality = VerificationQuality.from_config(reward.judge.meta_verifier, pools, routers, deterministic) \
        if reward.name == "verifier_agreement" and reward.judge.meta_verifier is not None else None
    return judge, quality


def weighted(future: Future, weights: list[float]) -> Future:
    """A reward pool's Future of [(score, error)] with each score multiplied by its weight (errors kept as they are)."""
    out: Future = Future()

    def done(f: Future) -> None:
        try:
            out.set_result([(score * w, error) for (score, error), w in zip(f.result(), weights)])
        except Exception as e:  # the pool's failure reaches whoever waits on the weighted scores
            out.set_exception(e)
    future.add_done_callback(done)
    return out


def scored(values: list[float]) -> Future:
    """Scores already computed, in RewardPool.submit's form (a Future of [(score, error)]), so the rollout collects a
    generative reward's scores as it collects a reward pool's."""
    future: Future = Future()
    future.set_result([(float(v), None) for v in values])
    return future
