"""Reward functions and the reward process pool."""
import pytest

from megarl.rewards import RewardPool, check_reward_call, exact_match, math_reward, resolve_reward


@pytest.mark.unit
def test_math_reward_checks_equivalence():
    assert math_reward("The answer is \\boxed{\\frac{1}{2}}", "0.5") == 1.0
    assert math_reward("68", "68") == 1.0 and math_reward("67", "68") == 0.0
    assert math_reward("no number here", "68") == 0.0


@pytest.mark.unit
def test_math_reward_runs_without_math_verifys_own_timeouts():
    """math-verify's signal-alarm timeouts also timed its first call's lazy set-up (a correct answer scored 0 on a
    loaded machine) and refuse to run off the main thread; the reward pool times responses instead."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(math_reward, "so x = \\boxed{\\frac{3}{4}}", "0.75").result() == 1.0


@pytest.mark.unit
def test_exact_match_normalises():
    assert exact_match(" 042 ", "42") == 1.0 and exact_match("Paris.", "paris") == 1.0
    assert exact_match("41", "42") == 0.0
    with pytest.raises(ValueError, match="needs an answer"):
        exact_match("x", None)


def length_reward(response, answer, **kwargs):  # a user reward by dotted path
    return len(response) * kwargs.get("scale", 1.0)


def failing_reward(response, answer, **_):
    raise RuntimeError(f"cannot score {response!r}")


@pytest.mark.unit
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


def one_argument_reward(response):
    return 1.0


def tagged_reward(response, answer, *, tag):
    return float(f"<{tag}>" in response)


@pytest.mark.unit
def test_a_reward_that_cannot_take_the_call_is_refused_at_start_up():
    """RewardFn: fn(response, answer, **reward.kwargs). A function that cannot take that call, or reward.kwargs it
    does not accept, is refused when the pool is built (naming the field and the fix), not scored 0 on every
    response; a keyword-only parameter given in reward.kwargs is fine."""
    with pytest.raises(ValueError, match=r"reward.name: the reward function 'one_argument_reward'\(response\)"):
        RewardPool("test_rewards:one_argument_reward", workers=1)
    with pytest.raises(ValueError, match=r"reward.kwargs=\['scale', 'tag'\].*Fix: def fn"):
        RewardPool("test_rewards:tagged_reward", workers=1, kwargs={"tag": "b", "scale": 2.0})
    with pytest.raises(ValueError, match="reward.eval_name: the reward function"):
        RewardPool("test_rewards:tagged_reward", workers=1, field="reward.eval_name")  # `tag` missing
    check_reward_call(tagged_reward, {"tag": "b"})
    pool = RewardPool("test_rewards:tagged_reward", workers=1, kwargs={"tag": "b"})
    try:
        assert pool.score([("<b>x</b>", None), ("x", None)]) == [1.0, 0.0]
    finally:
        pool.close()


def _score_in_a_rank():
    pool = RewardPool("exact_match", workers=1)
    try:
        return pool.score([("42", "42"), ("41", "42")])
    finally:
        pool.close()


@pytest.mark.multirank
def test_a_rank_forked_after_the_parent_used_a_pool_scores_with_its_own():
    """run_ranks forks the test process: a forkserver the parent started (an earlier test's RewardPool) is not the
    rank's child, and the rank's pool failed with "ChildProcessError: No child processes" (megarl.testing resets it)."""
    from megarl.testing import run_ranks

    parent = RewardPool("exact_match", workers=1)
    try:
        assert parent.score([("1", "1")]) == [1.0]  # the parent's forkserver is running
        assert run_ranks(2, _score_in_a_rank) == [[1.0, 0.0]] * 2
        assert parent.score([("2", "1")]) == [0.0]  # and the parent's is untouched
    finally:
        parent.close()


@pytest.mark.unit
def test_hung_reward_is_killed_and_the_worker_keeps_scoring():
    pool = RewardPool("reward_fns:hangs_on_hang", workers=1, timeout_s=1.0)
    try:
        # the hang was cut at its own timeout and the worker went on: a hang waited out would reach the pool's
        # backstop, which scores the whole chunk 0
        assert pool.score([("ok", None), ("hang", None), ("ok", None)]) == [1.0, 0.0, 1.0]
        assert pool.errors and "timed out (> 1 s per response)" in pool.errors[0]
        assert pool.take_errors() == 1
        assert pool.score([("ok", None)]) == [1.0]  # the worker is still healthy
    finally:
        pool.close()


@pytest.mark.unit
def test_a_killed_reward_worker_costs_no_score(tmp_path):
    """A pool worker SIGKILLed mid-chunk (the OOM killer, an operator) breaks the executor for every chunk in flight:
    the chunks are scored again on fresh workers, never trained on with reward 0 (the old code scored them 0)."""
    pool = RewardPool("reward_fns:kills_its_worker_once", workers=2, kwargs={"marker": str(tmp_path / "killed")})
    try:
        chunks = [[("ok", None), ("no", None)], [("ok", None)] * 3]
        futures = [pool.submit(items) for items in chunks]  # both in flight when the worker dies
        assert [pool.result(f, len(items)) for f, items in zip(futures, chunks)] == [[1.0, 0.0], [1.0] * 3]
        assert pool.take_errors() == 0 and pool.worker_failures == 1  # one executor replaced, by one thread
        assert pool.score([("ok", None)]) == [1.0]
    finally:
        pool.close()


@pytest.mark.unit
def test_code_block_extraction_is_linear_and_takes_the_last_python_block():
    import time

    from megarl.rewards.code import extract_code

    assert extract_code("a\n```python\nx = 1\n```\ntext\n```js\ny\n```\n```\nz = 2\n```") == "z = 2\n"
    assert extract_code("```py\ncut off") == "cut off"
    assert extract_code("no block") == "no block"
    start = time.monotonic()
    for hostile in ("```" * 200_000, "```python " + "a" * 1_000_000, ("```\n" + "x" * 1000) * 500):
        extract_code(hostile)
    assert time.monotonic() - start < 2


_OWNER = """
import os, time
if __name__ == "__main__":
    from megarl.rewards import RewardPool

    pool = RewardPool("exact_match", workers=2)
    assert pool.score([("1", "1"), ("2", "1")]) == [1.0, 0.0]  # the forkserver and its workers are running

    def descendants(pid):
        children = [int(c) for t in os.listdir(f"/proc/{pid}/task")
                    for c in open(f"/proc/{pid}/task/{t}/children").read().split()]
        return children + [d for c in children for d in descendants(c)]

    print(" ".join(map(str, descendants(os.getpid()))), flush=True)
    time.sleep(3600)
"""


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


@pytest.mark.unit
def test_a_killed_owner_leaves_no_reward_worker_behind():
    """megarl.lifetime: a process SIGKILLed while its RewardPool runs takes the pool's forkserver and workers with it
    (Python's forkserver and ProcessPoolExecutor workers outlive a killed owner by themselves)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    owner = subprocess.Popen([sys.executable, "-c", _OWNER], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in owner.stdout.readline().split()]
    finally:
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait()
    assert len(pids) >= 3, pids  # the resource tracker, the forkserver, its workers
    deadline = time.monotonic() + 120  # the kernel signals them at once; a loaded machine may take a while to reap
    while any(_running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [p for p in pids if _running(p)]
    assert not left, [open(f"/proc/{p}/cmdline").read().replace("\0", " ")[:120] for p in left]
