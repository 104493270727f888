"""Rollout on rank 0: prompts -> SGLang (n samples each, token ids + log-probs) -> rewards, with DAPO dynamic sampling
and overlong handling; the held-out evaluation uses the same path.

Requests go to the engines in chunks of rollout.request_size prompts, concurrently; as each chunk returns, its
responses are handed to the reward pool, so scoring overlaps the rest of generation. Every request carries a
sampling seed derived from (run seed, step, round, prompt, sample), so a resumed run draws the same rollouts.
"""
from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor

import torch

from ..data import PromptRecord
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
    def __init__(self, cfg, tokenizer, router, rewards):
        self.cfg, self.tok, self.router, self.rewards = cfg, tokenizer, router, rewards
        self.stop_ids = sorted(set(tokenizer.stop_ids) | set(cfg.rollout.stop_token_ids))
        self._threads = ThreadPoolExecutor(max_workers=8)

    def sampling_params(self, seed: int | None, temperature: float, max_new_tokens: int) -> dict:
        params = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": self.cfg.rollout.top_p,
                  "stop_token_ids": self.stop_ids, "skip_special_tokens": False, "no_stop_trim": True}
        if seed is not None and self.cfg.rollout.deterministic:
            params["sampling_seed"] = seed
        return params

    def generate(self, records: list[PromptRecord], n: int, seed_parts: tuple, temperature: float,
                 max_new_tokens: int) -> list[Sample]:
        """n samples per record, rewarded; sample order = record order, then sample index."""
        requests = [(g, r, j) for g, r in enumerate(records) for j in range(n)]
        chunk = self.cfg.rollout.request_size * n
        pieces = [requests[i:i + chunk] for i in range(0, len(requests), chunk)]

        def run(piece):
            params = [self.sampling_params(request_seed(*seed_parts, r.index, j), temperature, max_new_tokens)
                      for _, r, j in piece]
            completions = self.router.generate([r.prompt_ids for _, r, _ in piece], params)
            texts = [(self.tok.decode(c.output_ids), r.answer) for c, (_, r, _) in zip(completions, piece)]
            return completions, self.rewards.submit(texts)

        samples = []
        results = self._threads.map(run, pieces)
        if self.cfg.logging.progress:
            from tqdm import tqdm

            results = tqdm(results, total=len(pieces), desc="generate", unit="req", leave=False, dynamic_ncols=True)
        for piece, (completions, scored) in zip(pieces, results):
            rewards = self.rewards.result(scored, len(piece))
            for (g, r, _), c, reward in zip(piece, completions, rewards):
                if len(c.output_log_probs) != len(c.output_ids):
                    raise RuntimeError(f"engine returned {len(c.output_ids)} tokens but {len(c.output_log_probs)} "
                                       "log-probs for one response")
                samples.append(Sample(group=g, prompt_index=r.index, prompt_ids=list(r.prompt_ids),
                                      response_ids=list(c.output_ids), rollout_log_probs=list(c.output_log_probs),
                                      finish_reason=c.finish_reason, reward=reward, score=reward,
                                      extra={"weight_version": c.weight_version}))
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

    def evaluate(self, records: list[PromptRecord], n: int, temperature: float, tag) -> dict:
        """pass@1 (mean correctness over n samples per prompt, as a percentage) and response statistics."""
        samples = self.generate(records, n, (self.cfg.seed, "eval", tag), temperature,
                                self.cfg.rollout.max_new_tokens)
        lengths = [len(s.response_ids) for s in samples]
        return {"eval/pass_at_1": 100.0 * sum(s.reward > 0.5 for s in samples) / len(samples),
                "eval/reward_mean": sum(s.reward for s in samples) / len(samples),
                "eval/response_len_mean": sum(lengths) / len(lengths),
                "eval/prompts": len(records), "eval/samples_per_prompt": n}

    def close(self) -> None:
        self._threads.shutdown(wait=False)


def rollout_metrics(samples: list[Sample]) -> dict:
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    lengths = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.float64)
    return {"reward/mean": float(rewards.mean()), "reward/std": float(rewards.std()) if len(samples) > 1 else 0.0,
            "reward/pass_rate": float((rewards > 0.5).double().mean()),
            "response_len/mean": float(lengths.mean()), "response_len/max": float(lengths.max()),
            "rollout/truncated_frac": float(sum(s.finish_reason == "length" for s in samples) / len(samples)),
            "rollout/samples": len(samples)}
