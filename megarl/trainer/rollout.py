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

import torch

from ..data import PromptRecord
from ..envs import Episode, make_env, run_episodes
from ..envs.episode import check_turn
from ..evaluation import majority_at_n, normalise_answer, pass_at_k_curve
from .batching import Sample


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


class Rollout:
    def __init__(self, cfg, tokenizer, router, rewards, tools=None):
        self.cfg, self.tok, self.router, self.rewards, self.tools = cfg, tokenizer, router, rewards, tools
        self.stop_ids = sorted(set(tokenizer.stop_ids) | set(cfg.rollout.stop_token_ids))
        self._threads = ThreadPoolExecutor(max_workers=8)
        self._env_threads = ThreadPoolExecutor(max_workers=8)  # tool calls (separate: chunks run on _threads)

    def sampling_params(self, seed: int | None, temperature: float, max_new_tokens: int) -> dict:
        params = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": self.cfg.rollout.top_p,
                  "stop_token_ids": self.stop_ids, "skip_special_tokens": False, "no_stop_trim": True}
        if seed is not None and self.cfg.rollout.deterministic:
            params["sampling_seed"] = seed
        return params

    def _episodes(self, piece, seed_parts: tuple, temperature: float, max_new_tokens: int) -> list[Episode]:
        """One episode per request (record, sample index): a single engine turn, or a multi-turn env episode."""
        records = [r for _, r, _ in piece]
        env = self.cfg.env

        def generate(prompts, params):
            return self.router.generate(prompts, params, return_routed_experts=self.cfg.rollout.engine_routing)

        if env.name is None:
            params = [self.sampling_params(request_seed(*seed_parts, r.index, j), temperature, max_new_tokens)
                      for _, r, j in piece]
            completions = generate([r.prompt_ids for r in records], params)
            episodes = []
            for r, c in zip(records, completions):
                check_turn(c)
                episodes.append(Episode(list(r.prompt_ids), list(c.output_ids), [1] * len(c.output_ids),
                                        list(c.output_log_probs), c.finish_reason, 1, self.tok.decode(c.output_ids),
                                        weight_version=c.weight_version, routed_experts=c.routed_experts))
            return episodes
        envs = [make_env(env.name, tools=list(env.tools), tool_call_format=env.tool_call_format, **env.kwargs)
                for _ in piece]

        def params(i: int, turn: int) -> dict:
            _, r, j = piece[i]
            return self.sampling_params(request_seed(*seed_parts, r.index, j, turn), temperature, max_new_tokens)

        return run_episodes(generate, self.tok, envs, records, params, env.max_turns, max_new_tokens,
                            env.max_response_tokens, tools=self.tools, threads=self._env_threads)

    def generate(self, records: list[PromptRecord], n: int, seed_parts: tuple, temperature: float,
                 max_new_tokens: int) -> list[Sample]:
        """n samples per record, rewarded; sample order = record order, then sample index."""
        requests = [(g, r, j) for g, r in enumerate(records) for j in range(n)]
        chunk = self.cfg.rollout.request_size * n
        pieces = [requests[i:i + chunk] for i in range(0, len(requests), chunk)]

        def run(piece):
            episodes = self._episodes(piece, seed_parts, temperature, max_new_tokens)
            texts = [(e.final_text, r.answer) for e, (_, r, _) in zip(episodes, piece)]
            return episodes, self.rewards.submit(texts)

        samples = []
        results = self._threads.map(run, pieces)
        if self.cfg.logging.progress:
            from tqdm import tqdm

            results = tqdm(results, total=len(pieces), desc="generate", unit="req", leave=False, dynamic_ncols=True)
        multi_turn = self.cfg.env.name is not None
        for piece, (episodes, scored) in zip(pieces, results):
            rewards = self.rewards.result(scored, len(piece))
            for (g, r, _), e, reward in zip(piece, episodes, rewards):
                reward += e.env_reward
                samples.append(Sample(group=g, prompt_index=r.index, prompt_ids=list(r.prompt_ids),
                                      response_ids=e.response_ids, rollout_log_probs=e.log_probs,
                                      finish_reason=e.finish_reason, reward=reward, score=reward,
                                      loss_mask=e.loss_mask if multi_turn else None,
                                      routed_experts=e.routed_experts,
                                      extra={"weight_version": e.weight_version, "turns": e.turns,
                                             "final_text": e.final_text, **e.info}))
        return samples

    def collect(self, stream: PromptStream, step: int) -> tuple[list[Sample], dict]:
        """One step's samples (rollout.prompts_per_step groups of n_samples) and rollout statistics."""
        ro = self.cfg.rollout
        kept, dropped, rounds, prompts_used = [], [], 0, 0
        while len(kept) < ro.prompts_per_step and rounds < (ro.max_sampling_rounds if ro.dynamic_sampling else 1):
            need = ro.prompts_per_step - len(kept)
            records = stream.take(need)
            prompts_used += len(records)
            samples = self.generate(records, ro.n_samples, (self.cfg.seed, step, rounds), ro.temperature,
                                    ro.max_new_tokens)
            rounds += 1
            for g in range(len(records)):
                group = samples[g * ro.n_samples:(g + 1) * ro.n_samples]  # generate() keeps prompt order
                varied = len({s.reward for s in group}) > 1
                (kept if varied or not ro.dynamic_sampling else dropped).append(group)
        all_groups = kept + dropped[: ro.prompts_per_step - len(kept)]  # refill with zero-variance groups
        samples = []
        for g, group in enumerate(all_groups):
            for s in group:
                s.group = g
                samples.append(s)
        self._shape(samples)
        stats = {"rollout/prompts_used": prompts_used, "rollout/sampling_rounds": rounds,
                 "rollout/kept_group_frac": len(kept) / max(len(all_groups), 1)}
        return samples, stats

    def _shape(self, samples: list[Sample]) -> None:
        """Overlong handling: mask truncated responses out of the loss, or the DAPO soft length penalty."""
        ro = self.cfg.rollout
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
        samples = self.generate(records, n, (self.cfg.seed, "eval", tag), temperature,
                                self.cfg.rollout.max_new_tokens)
        groups = [samples[g * n:(g + 1) * n] for g in range(len(records))]
        correct = [[s.reward > 0.5 for s in group] for group in groups]
        curve = pass_at_k_curve(correct)
        votes = [[(normalise_answer(s.extra["final_text"]), s.reward > 0.5) for s in group] for group in groups]
        metrics = {f"eval/pass_at_{k}": 100.0 * v for k, v in curve.items() if k & (k - 1) == 0 or k == n}
        metrics.update({f"eval/maj_at_{n}": 100.0 * majority_at_n(votes), "eval/prompts": len(records),
                        "eval/samples_per_prompt": n})
        metrics.update({"eval/" + k.replace("/", "_"): v for k, v in rollout_metrics(samples).items()
                        if k.startswith(("reward/mean", "response_len/mean", "tool/", "rollout/turns"))})
        return metrics, curve

    def close(self) -> None:
        self._threads.shutdown(wait=False)
        self._env_threads.shutdown(wait=False)


def rollout_metrics(samples: list[Sample]) -> dict:
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    lengths = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.float64)
    metrics = {"reward/mean": float(rewards.mean()),
               "reward/std": float(rewards.std()) if len(samples) > 1 else 0.0,
               "reward/pass_rate": float((rewards > 0.5).double().mean()),
               "response_len/mean": float(lengths.mean()), "response_len/max": float(lengths.max()),
               "rollout/truncated_frac": float(sum(s.finish_reason == "length" for s in samples) / len(samples)),
               "rollout/samples": len(samples)}
    if any(s.loss_mask is not None for s in samples):  # multi-turn episodes
        n = len(samples)
        metrics.update({
            "rollout/turns_mean": sum(s.extra.get("turns", 1) for s in samples) / n,
            "rollout/max_turns_frac": sum(s.finish_reason == "max_turns" for s in samples) / n,
            "rollout/observation_token_frac": sum(len(s.loss_mask) - sum(s.loss_mask) for s in samples)
            / max(sum(len(s.response_ids) for s in samples), 1),
            "tool/call_rate": sum(s.extra.get("tool_calls", 0) > 0 for s in samples) / n,
            "tool/calls_per_sample": sum(s.extra.get("tool_calls", 0) for s in samples) / n,
            "tool/error_rate": sum(s.extra.get("tool_errors", 0) for s in samples)
            / max(sum(s.extra.get("tool_calls", 0) for s in samples), 1),
            "tool/bad_call_rate": sum(s.extra.get("bad_tool_calls", 0) > 0 for s in samples) / n})
    return metrics
