"""Rollout on rank 0: prompts -> SGLang (n samples each, token ids + log-probs) -> rewards, with DAPO dynamic sampling
and overlong handling; the held-out evaluation uses the same path. With env.name set, each sample is a multi-turn
episode (megarl.envs.run_episodes: tool calls answered token-in/token-out, observations masked out of the loss).

Requests go to the engines in chunks of rollout.request_size prompts, concurrently; as each chunk returns, its
responses are handed to the reward pool, so scoring overlaps the rest of generation. Every request carries a
sampling seed derived from (run seed, step, round, prompt, sample), so a resumed run draws the same rollouts.
"""
from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from ..data import PromptRecord
from ..envs import Episode, make_env, run_episodes
from ..envs.episode import check_turn
from ..errors import PeerFailed, UserError
from ..evaluation import majority_at_n, normalise_answer, pass_at_k_curve
from ..rewards.judge import Judge, VerificationQuality, scored as judged, weighted
from ..rollout.teacher import TaughtResponse
from .async_rollout import token_versions
from .batching import Sample
from .config import EnvConfig, RolloutConfig


def request_seed(*parts) -> int:
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # a non-negative int64


class PromptStream:
    """The training prompts in a seeded order, epoch after epoch; the cursor (epoch, position) is checkpointed."""

    def __init__(self, records: list[PromptRecord], seed: int, shuffle: bool = True):
        if not records:
            raise ValueError("the training prompt set is empty")
        self.records, self.seed, self.shuffle = records, seed, shuffle
        self.epoch, self.position = 0, 0
        self._order = self._permutation()

    def _permutation(self) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.records)))
        return torch.randperm(len(self.records), generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()

    def take(self, n: int) -> list[PromptRecord]:
        out = []
        while len(out) < n:
            if self.position == len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation()
            out.append(self.records[self._order[self.position]])
            self.position += 1
        return out

    def state(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load(self, state: dict) -> None:
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._permutation()


@dataclass(frozen=True)
class Workers:
    """The ranks that run rollouts (rollout.workers): this one is number `index` of `count`; `group` spans them.

    Every worker keeps the same prompt stream and takes the same prompts; it generates and scores the groups at
    positions index, index + count, ... of each round, so the engine traffic and the reward scoring are split
    count ways. Dynamic sampling and the step's statistics are decided from sums over the workers (tensors)."""
    index: int = 0
    count: int = 1
    group: object = None  # ProcessGroup over the workers (None: one worker)

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        if self.count > 1:
            dist.all_reduce(values, group=self.group)
        return values

    def max(self, values: torch.Tensor) -> torch.Tensor:
        if self.count > 1:
            dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self.group)
        return values


class Rollout:
    """Generates and scores samples: the rollout section's sampling settings, the env's episodes (env.name), the
    reward pool's scores (or a judge's); seed: the run's, every request's sampling seed derives from it."""

    def __init__(self, rollout: RolloutConfig, env: EnvConfig, tokenizer, router, rewards, *, seed: int = 0,
                 partial: bool = False, greedy_baseline: bool = False, opd_top_k: int = 0, progress: bool = False,
                 judge: Judge | None = None, verification_quality: VerificationQuality | None = None,
                 tools: list[dict] | None = None, teacher=None, eval_rewards=None):
        self.config, self.env, self.tok, self.router, self.rewards = rollout, env, tokenizer, router, rewards
        self.seed, self.tools, self.progress = seed, tools, progress
        # reward.eval_name: the held-out evaluation's checker (a RewardPool); None: the training reward scores it too
        self.eval_rewards = eval_rewards
        self.teacher = teacher  # opd: megarl.rollout.teacher.Teacher, asked for each sample's response log-probs
        self.opd_top_k = opd_top_k  # opd: the teacher's top-k at each response position too (0: none)
        # reward.name: judge: a generative reward, its models reached through the pools' routers (megarl.rollout.pools),
        # asked in each chunk's thread as the chunk returns
        self.judge = judge
        # training a verifier (verifier_agreement) with a meta-verifier: its quality of each analysis weights the reward
        self.verification_quality = verification_quality
        # asynchronous RL with partial rollouts: a weight update aborts requests in flight; they continue under it
        self.partial = partial
        self.stop_ids = sorted(set(tokenizer.stop_ids) | set(rollout.stop_token_ids))
        # the estimator's baseline is a greedy rollout of each prompt (ReMax): collect() asks the engines for it
        self.greedy_baseline = greedy_baseline
        self._threads = ThreadPoolExecutor(max_workers=8)
        self._env_threads = ThreadPoolExecutor(max_workers=8)  # tool calls (separate: chunks run on _threads)

    def sampling_params(self, seed: int | None, temperature: float, max_new_tokens: int) -> dict:
        params = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": self.config.top_p,
                  "stop_token_ids": self.stop_ids, "skip_special_tokens": False, "no_stop_trim": True}
        if seed is not None and self.config.deterministic:
            params["sampling_seed"] = seed
        return params

    def _episodes(self, piece, seed_parts: tuple, temperature: float, max_new_tokens: int) -> list[Episode]:
        """One episode per request (record, sample index): a single engine turn, or a multi-turn env episode."""
        records = [r for _, r, _ in piece]
        env = self.env

        def generate(prompts, params):  # partial rollouts: requests a weight update aborted continue under it
            return self.router.generate(prompts, params, return_routed_experts=self.config.engine_routing,
                                        resume_aborted=self.partial)

        if env.name is None:
            params = [self.sampling_params(request_seed(*seed_parts, r.index, j), temperature, max_new_tokens)
                      for _, r, j in piece]
            completions = generate([r.prompt_ids for r in records], params)
            episodes = []
            for r, c in zip(records, completions):
                check_turn(c)
                episodes.append(Episode(list(r.prompt_ids), list(c.output_ids), [1] * len(c.output_ids),
                                        list(c.output_log_probs), c.finish_reason, 1, self.tok.decode(c.output_ids),
                                        weight_version=c.weight_version, routed_experts=c.routed_experts,
                                        segments=list(c.segments)))
            return episodes
        envs = [make_env(env.name, tools=list(env.tools), tool_call_format=env.tool_call_format, **env.kwargs)
                for _ in piece]

        def params(i: int, turn: int) -> dict:
            _, r, j = piece[i]
            return self.sampling_params(request_seed(*seed_parts, r.index, j, turn), temperature, max_new_tokens)

        return run_episodes(generate, self.tok, envs, records, params, env.max_turns, max_new_tokens,
                            env.max_response_tokens, tools=self.tools, threads=self._env_threads)

    def generate(self, records: list[PromptRecord], n: int, seed_parts: tuple, temperature: float,
                 max_new_tokens: int, greedy_baseline: bool = False, teacher: bool = False,
                 check: bool = False) -> list[Sample]:
        """n samples per record, rewarded; sample order = record order, then sample index. teacher (opd): each chunk's
        responses are sent to the teacher engine (one prefill request) as soon as the chunk returns, in the chunk's
        thread, while later chunks still generate and the reward pool scores; greedy_baseline (ReMax):
        also one temperature-0 rollout per record, requested alongside the samples, scored by the same reward and
        shaping, and not returned (never trained): its score becomes the `baseline` of the record's samples. check
        (held-out evaluation with reward.eval_name): the reward is the eval checker's, the training reward's score is
        kept in extra["train_reward"]."""
        requests = [(g, r, j) for g, r in enumerate(records) for j in range(n)]
        chunk = self.config.request_size * n
        pieces = [(requests[i:i + chunk], temperature) for i in range(0, len(requests), chunk)]
        if greedy_baseline:
            greedy = [(g, r, "greedy") for g, r in enumerate(records)]
            size = self.config.request_size
            pieces = [(greedy[i:i + size], 0.0) for i in range(0, len(greedy), size)] + pieces

        def run(item):
            piece, temp = item
            episodes = self._episodes(piece, seed_parts, temp, max_new_tokens)
            texts = [(e.final_text, r.answer) for e, (_, r, _) in zip(episodes, piece)]
            if self.judge is not None:  # judged here (HTTP to the judge pool) while later chunks generate
                verdicts = self.judge.score([r.text for _, r, _ in piece], [t for t, _ in texts],
                                            [a for _, a in texts],
                                            [request_seed(*seed_parts, r.index, j, "judge") for _, r, j in piece])
                for e, verdict in zip(episodes, verdicts):
                    e.info.update(verdict.info())  # into Sample.extra: the rollout dumps keep the judges' texts
                scored = judged([v.score for v in verdicts])
            else:
                scored = self.rewards.submit(texts)
            if self.verification_quality is not None:  # asked while the reward pool scores the chunk
                infos = self.verification_quality.judge(
                    [r.text for _, r, _ in piece], [t for t, _ in texts], [a for _, a in texts],
                    [request_seed(*seed_parts, r.index, j, "judge") for _, r, j in piece])
                for e, info in zip(episodes, infos):
                    e.info.update(info)
                scored = weighted(scored, [info["meta_verifier"]["quality"] for info in infos])
            checked = self.eval_rewards.submit(texts) if check and self.eval_rewards is not None else None
            taught = self.teacher.response_log_probs([e.prompt_ids for e in episodes],
                                                     [e.response_ids for e in episodes],
                                                     top_k=self.opd_top_k) \
                if teacher and temp > 0 else [TaughtResponse(None)] * len(episodes)  # never for greedy rollouts
            return episodes, (scored, checked, taught)

        samples, baselines = [], []
        results = self._threads.map(run, pieces)
        if self.progress:
            from tqdm import tqdm

            results = tqdm(results, total=len(pieces), desc="generate", unit="req", leave=False, dynamic_ncols=True)
        multi_turn = self.env.name is not None
        prompts: dict[int, np.ndarray] = {}
        # Each chunk's token ids and log-probs become arrays as it returns, while later chunks still generate: the
        # step's data is then packed by concatenation (megarl.trainer.batching.PackedRollout), not from lists.
        for (piece, _), (episodes, (scored, checked, taught)) in zip(pieces, results):
            rewards = self.rewards.result(scored, len(piece))
            if checked is not None:  # the checker's score is the reward; the training reward's is kept beside it
                for e, trained_on in zip(episodes, rewards):
                    e.info["train_reward"] = trained_on + e.env_reward
                rewards = self.eval_rewards.result(checked, len(piece))
            for (g, r, j), e, reward, teacher_view in zip(piece, episodes, rewards, taught):
                reward += e.env_reward
                if r.index not in prompts:  # one array per prompt, shared by its samples
                    prompts[r.index] = np.asarray(r.prompt_ids, dtype=np.int32)
                (baselines if j == "greedy" else samples).append(Sample(
                    group=g, prompt_index=r.index, prompt_ids=prompts[r.index],
                    response_ids=np.asarray(e.response_ids, dtype=np.int32),
                    rollout_log_probs=np.asarray(e.log_probs, dtype=np.float32),
                    finish_reason=e.finish_reason, reward=reward, score=reward,
                    loss_mask=np.asarray(e.loss_mask, dtype=np.uint8) if multi_turn else None,
                    routed_experts=e.routed_experts, teacher_log_probs=teacher_view.log_probs,
                    teacher_top_ids=teacher_view.top_ids, teacher_top_log_probs=teacher_view.top_log_probs,
                    token_versions=token_versions(e.segments),
                    extra={"weight_version": e.weight_version, "turns": e.turns, "final_text": e.final_text,
                           **e.info}))
        if greedy_baseline:
            self._shape(baselines)  # the baseline is scored as the samples are (overlong penalty included)
            for s in samples:
                s.baseline = baselines[s.group].score
        return samples

    def collect(self, stream: PromptStream, step: int, workers: Workers = Workers()) -> tuple[list[Sample], dict]:
        """One step's samples (rollout.prompts_per_step groups of n_samples) and rollout statistics; with several
        workers, this worker's share of them (Sample.group is the step-wide group; sample index = group * n + j)."""
        ro, n = self.config, self.config.n_samples
        kept, dropped, rounds, prompts_used = [], [], 0, 0
        while len(kept) < ro.prompts_per_step and rounds < (ro.max_sampling_rounds if ro.dynamic_sampling else 1):
            need = ro.prompts_per_step - len(kept)
            records = stream.take(need)  # every worker: the same records
            prompts_used += len(records)
            mine = list(range(workers.index, len(records), workers.count))
            failure, samples = None, []
            try:
                samples = self.generate([records[p] for p in mine], n, (self.seed, step, rounds),
                                        ro.temperature, ro.max_new_tokens, greedy_baseline=self.greedy_baseline,
                                        teacher=self.teacher is not None)
            except UserError as e:  # the other workers must not wait for this one's round forever
                failure = e
            rounds += 1
            groups = {p: samples[k * n:(k + 1) * n] for k, p in enumerate(mine)}  # generate() keeps prompt order
            varied = torch.zeros(len(records) + 1)
            for p, group in groups.items():
                varied[p] = float(len({s.reward for s in group}) > 1)
            varied[-1] = failure is not None
            varied = workers.sum(varied)
            if varied[-1] > 0:
                raise failure or PeerFailed("another rollout worker failed")
            for p in range(len(records)):
                (kept if varied[p] > 0 or not ro.dynamic_sampling else dropped).append(groups.get(p, []))
        all_groups = kept + dropped[: ro.prompts_per_step - len(kept)]  # refill with zero-variance groups
        samples = []
        for g, group in enumerate(all_groups):
            for s in group:
                s.group = g
                samples.append(s)
        self._shape(samples)
        stats = {"rollout/prompts_used": prompts_used, "rollout/sampling_rounds": rounds,
                 "rollout/kept_group_frac": len(kept) / max(len(all_groups), 1)}
        if self.greedy_baseline:  # the greedy rollouts' mean score over the step's prompts (all workers)
            held = [group[0].baseline for group in all_groups if group]
            total = workers.sum(torch.tensor([sum(held), len(held)], dtype=torch.float64))
            stats["reward/greedy_mean"] = float(total[0] / total[1].clamp(min=1))
        return samples, stats

    def _shape(self, samples: list[Sample]) -> None:
        """Overlong handling: mask truncated responses out of the loss, or the DAPO soft length penalty."""
        ro = self.config
        for s in samples:
            truncated = s.finish_reason == "length"
            if ro.overlong == "mask" and truncated:
                s.trained = False
            elif ro.overlong == "penalty":
                start = ro.max_new_tokens - ro.overlong_buffer
                excess = len(s.response_ids) - start
                if excess > 0:
                    s.score = s.reward - min(excess / ro.overlong_buffer, 1.0) * ro.overlong_penalty

    def evaluate(self, records: list[PromptRecord], n: int, temperature: float, tag) -> tuple[dict, dict]:
        """Held-out metrics over n samples per prompt: pass@1 (mean correctness, %), pass@k for k = 1, 2, 4, .., n
        (unbiased estimator, %), maj@n (majority vote over normalised final answers, %), response and tool-use
        statistics; and the full pass@k curve {k: fraction}."""
        samples = self.generate(records, n, (self.seed, "eval", tag), temperature, self.config.max_new_tokens,
                                check=True)
        groups = [samples[g * n:(g + 1) * n] for g in range(len(records))]
        correct = [[s.reward > 0.5 for s in group] for group in groups]
        curve = pass_at_k_curve(correct)
        votes = [[(normalise_answer(s.extra["final_text"]), s.reward > 0.5) for s in group] for group in groups]
        metrics = {f"eval/pass_at_{k}": 100.0 * v for k, v in curve.items() if k & (k - 1) == 0 or k == n}
        metrics.update({f"eval/maj_at_{n}": 100.0 * majority_at_n(votes), "eval/prompts": len(records),
                        "eval/samples_per_prompt": n})
        metrics.update({"eval/" + k.replace("/", "_"): v for k, v in rollout_metrics(samples).items()
                        if k.startswith(("reward/mean", "response_len/mean", "tool/", "rollout/turns"))})
        if self.eval_rewards is not None:  # pass@1 is the checker's; how often the training reward agrees with it
            trained_on = [s.extra["train_reward"] > 0.5 for s in samples]
            metrics["eval/train_reward_pass_at_1"] = 100.0 * float(np.mean(trained_on))
            metrics["eval/train_reward_false_pass"] = 100.0 * float(np.mean(
                [t and not s.reward > 0.5 for t, s in zip(trained_on, samples)]))
        return metrics, curve

    def close(self) -> None:
        self._threads.shutdown(wait=False)
        self._env_threads.shutdown(wait=False)


_SUMS = ("samples", "reward", "reward_sq", "passed", "response_tokens", "truncated", "multi_turn", "turns", "max_turns",
         "observation_tokens", "with_tool_calls", "tool_calls", "tool_errors", "bad_tool_calls", "stale", "tokens",
         "judged", "judge_parse_errors", "self_verified", "self_format_ok", "proof_score")


def rollout_metrics(samples: list[Sample], workers: Workers = Workers(), weight_version: str | None = None) -> dict:
    """The step's sample statistics: sums (and a max) over this worker's samples, reduced over the workers as one
    tensor, so they are the statistics of all the step's samples wherever they were generated. weight_version: the
    version the step's samples should come from (rollout/stale_weight_frac counts the others)."""
    def total(key, default=0):
        return sum(float(s.extra.get(key, default)) for s in samples)

    sums = torch.tensor([
        len(samples), sum(s.reward for s in samples), sum(s.reward ** 2 for s in samples),
        sum(s.reward > 0.5 for s in samples), sum(len(s.response_ids) for s in samples),
        sum(s.finish_reason == "length" for s in samples), sum(s.loss_mask is not None for s in samples),
        total("turns", 1), sum(s.finish_reason == "max_turns" for s in samples),
        sum(len(s.loss_mask) - int(np.sum(s.loss_mask)) for s in samples if s.loss_mask is not None),
        sum(s.extra.get("tool_calls", 0) > 0 for s in samples), total("tool_calls"), total("tool_errors"),
        sum(s.extra.get("bad_tool_calls", 0) > 0 for s in samples),
        sum(s.extra.get("weight_version") != weight_version for s in samples) if weight_version else 0,
        sum(len(s.prompt_ids) + len(s.response_ids) for s in samples), total("judged"), total("judge_parse_errors"),
        total("self_verified"), total("self_format_ok"), total("proof_score")],
        dtype=torch.float64)
    t = dict(zip(_SUMS, workers.sum(sums).tolist()))
    longest = workers.max(torch.tensor([max((len(s.response_ids) for s in samples), default=0)], dtype=torch.float64))
    n = max(t["samples"], 1)
    mean = t["reward"] / n
    variance = (t["reward_sq"] - n * mean ** 2) / (n - 1) if n > 1 else 0.0
    metrics = {"reward/mean": mean, "reward/std": max(variance, 0.0) ** 0.5, "reward/pass_rate": t["passed"] / n,
               "response_len/mean": t["response_tokens"] / n, "response_len/max": float(longest[0]),
               "rollout/truncated_frac": t["truncated"] / n, "rollout/samples": int(t["samples"]),
               "rollout/tokens": int(t["tokens"])}
    metrics["rollout/stale_weight_frac"] = t["stale"] / n if weight_version else 0.0
    if t["judged"]:  # a generative reward (megarl.rewards.judge): its unparseable judgements, all models
        metrics["reward/judge_parse_errors"] = int(t["judge_parse_errors"])
    if t["self_verified"]:  # self-verification: how often the policy assessed itself, and its solutions' own score
        metrics["reward/self_format_frac"] = t["self_format_ok"] / t["self_verified"]
        metrics["reward/proof_score_mean"] = t["proof_score"] / t["self_verified"]
    if t["multi_turn"]:  # multi-turn episodes
        metrics.update({
            "rollout/turns_mean": t["turns"] / n, "rollout/max_turns_frac": t["max_turns"] / n,
            "rollout/observation_token_frac": t["observation_tokens"] / max(t["response_tokens"], 1),
            "tool/call_rate": t["with_tool_calls"] / n, "tool/calls_per_sample": t["tool_calls"] / n,
            "tool/error_rate": t["tool_errors"] / max(t["tool_calls"], 1), "tool/bad_call_rate": t["bad_tool_calls"] / n})
    return metrics
