"""ReMax (arXiv:2310.10505): the advantage is the sample's reward minus the reward of one greedy rollout of the same
prompt. The estimator against a naive per-sample reference; the baseline carried per sample through the packed rollout
(select, concatenation, the dispatch's receive buffers); and, with a real SGLang server on CPU, the rollout's greedy
baseline equal to the reward of the engine's own temperature-0 completion of that prompt, never trained on."""
import pytest
import torch

from megarl.algorithms import compute_advantages
from megarl.algorithms.advantages import estimator
from megarl.trainer.batching import PackedRollout, Sample
from megarl.trainer.dispatch import Shape


def text_checksum(response: str, answer, **_) -> float:
    """A reward that changes with any character of the response (a random model's texts all score differently)."""
    return (sum(map(ord, response)) % 997) / 997


def _naive_remax(scores, baseline, mask):
    adv = torch.zeros_like(mask)
    for i in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if mask[i, t]:
                adv[i, t] = scores[i] - baseline[i]
    return adv


@pytest.mark.unit
def test_remax_matches_naive_and_needs_its_baseline():
    g = torch.Generator().manual_seed(0)
    scores, mask = torch.tensor([0.0, 1.0, 1.0, 0.5, 0.3, 0.5]), (torch.rand(6, 5, generator=g) > 0.3).float()
    mask[:, 0] = 1
    baseline = torch.tensor([0.2, 0.2, 0.9, 0.9, 0.5, 0.5])  # one greedy reward per prompt, repeated per sample
    adv, returns = compute_advantages("remax", scores=scores, baseline=baseline, mask=mask,
                                      group_ids=torch.tensor([0, 0, 1, 1, 2, 2]))
    assert torch.allclose(adv, _naive_remax(scores, baseline, mask))
    assert torch.allclose(returns, scores[:, None] * mask)
    assert adv[:, 0].tolist() == pytest.approx([-0.2, 0.8, 0.1, -0.4, -0.2, 0.0])  # hand-worked r - r_greedy
    assert estimator("remax").greedy_baseline and not estimator("remax").needs_groups  # one sample per prompt is fine
    with pytest.raises(ValueError, match="remax needs `baseline`"):
        compute_advantages("remax", scores=scores, mask=mask)


@pytest.mark.unit
def test_baseline_travels_with_its_sample_through_the_packed_rollout():
    samples = [Sample(group=k // 2, prompt_index=k, prompt_ids=[1, 2], response_ids=[3] * (k + 1),
                      rollout_log_probs=[-0.5] * (k + 1), finish_reason="stop", score=k / 10, baseline=k / 4)
               for k in range(4)]
    packed = PackedRollout.from_samples(samples)
    assert packed.baseline.tolist() == [0.0, 0.25, 0.5, 0.75]
    picked = packed.select([3, 1])
    assert picked.baseline.tolist() == [0.75, 0.25] and picked.score.tolist() == pytest.approx([0.3, 0.1])
    assert PackedRollout.cat([picked, packed.select([2, 0])]).baseline.tolist() == [0.0, 0.25, 0.5, 0.75]
    empty = Shape.of(picked, rows=2, seq_len=8, num_microbatches=1).empty()  # what a DP leader receives into
    assert empty.baseline.shape == picked.baseline.shape and empty.baseline.dtype == torch.float32


# ----------------------------------------------------------------------------------------- with a real engine
@pytest.fixture
def engine(tiny_qwen2_engine):
    return tiny_qwen2_engine  # the session's tiny Qwen2 server (megarl.testing.fixtures)


@pytest.mark.engine
def test_greedy_baseline_is_the_reward_of_the_engines_temperature_0_completion(engine, tmp_path):
    from megarl.data import ChatTokenizer, load_prompts
    from megarl.rewards import RewardPool
    from megarl.rollout import EngineClient, EngineRouter
    from megarl.testing import tiny_model_dir
    from megarl.trainer import load_train_config
    from megarl.trainer.config import rollout_inputs
    from megarl.trainer.rollout import PromptStream
    from megarl.trainer.workers import build_rollout

    path, n, new_tokens = tiny_model_dir("qwen2"), 3, 6
    cfg = load_train_config(None, [f"run_dir={tmp_path}", f"model.path={path}", "algorithm.advantage_estimator=remax",
                                   f"rollout.n_samples={n}", "rollout.prompts_per_step=4", "rollout.request_size=2",
                                   f"rollout.max_new_tokens={new_tokens}", "reward.name=test_remax:text_checksum",
                                   "reward.workers=1", "data.synthetic.num_train=20", "logging.progress=false"])
    tok = ChatTokenizer.from_pretrained(path)
    client = EngineClient(engine.url)
    rewards = RewardPool(cfg.reward.name, cfg.reward.workers)
    rollout = build_rollout(rollout_inputs(cfg), tok, EngineRouter([client]), rewards)
    try:
        samples, stats = rollout.collect(PromptStream(load_prompts("synthetic", tok, cfg.data), seed=0), step=1)
    finally:
        rollout.close()
        rewards.close()
    assert len(samples) == 4 * n  # the greedy rollouts are not among the trained samples
    greedy_rewards = []
    for g in range(4):
        group = [s for s in samples if s.group == g]
        assert len(group) == n
        # independently: the engine's own greedy completion of this prompt, scored by the same reward function
        done = client.generate([group[0].prompt_ids.tolist()], {"max_new_tokens": new_tokens, "temperature": 0.0,
                                                             "stop_token_ids": rollout.stop_ids})[0]
        expected = text_checksum(tok.decode(done.output_ids), None)
        assert all(s.baseline == pytest.approx(expected, abs=1e-6) for s in group), (g, expected)
        greedy_rewards.append(expected)
    assert stats["reward/greedy_mean"] == pytest.approx(sum(greedy_rewards) / 4, abs=1e-6)
    # the sampled (temperature 1) responses are other texts: their rewards are not the baseline
    assert sum(abs(s.score - s.baseline) > 1e-6 for s in samples) >= len(samples) // 2
    packed = PackedRollout.from_samples(samples)
    mask = torch.ones(len(samples), 2)
    adv, _ = compute_advantages("remax", scores=packed.score, baseline=packed.baseline, mask=mask,
                                group_ids=packed.group)
    assert torch.allclose(adv[:, 0], torch.tensor([s.score - s.baseline for s in samples]), atol=1e-6)
