"""Reward functions and the reward process pool."""
import pytest

from megarl.rewards import RewardPool, exact_match, math_reward, resolve_reward


def test_math_reward_checks_equivalence():
    assert math_reward("The answer is \\boxed{\\frac{1}{2}}", "0.5") == 1.0
    assert math_reward("68", "68") == 1.0 and math_reward("67", "68") == 0.0
    assert math_reward("no number here", "68") == 0.0


def test_exact_match_normalises():
    assert exact_match(" 042 ", "42") == 1.0 and exact_match("Paris.", "paris") == 1.0
    assert exact_match("41", "42") == 0.0
    with pytest.raises(ValueError, match="needs an answer"):
        exact_match("x", None)


def length_reward(response, answer, **kwargs):  # a user reward by dotted path
    return len(response) * kwargs.get("scale", 1.0)


def failing_reward(response, answer, **_):
    raise RuntimeError(f"cannot score {response!r}")


def test_dotted_path_and_errors_score_zero():
    assert resolve_reward("test_rewards:length_reward") is length_reward
    with pytest.raises(ValueError, match="unknown; choose one of"):
        resolve_reward("nope")
    with pytest.raises(ValueError, match="cannot import"):
        resolve_reward("no_such_module:f")
    pool = RewardPool("test_rewards:length_reward", workers=1, kwargs={"scale": 2.0})
    try:
        assert pool.score([("abc", None), ("", None)]) == [6.0, 0.0]
    finally:
        pool.close()
    pool = RewardPool("test_rewards:failing_reward", workers=1)
    try:
        assert pool.score([("x", None), ("y", None)]) == [0.0, 0.0]
        assert pool.take_errors() == 2 and pool.take_errors() == 0
    finally:
        pool.close()
