"""The code sandbox and the "code" reward: hostile programs score 0 with the right reason within their limits, leave
nothing behind, and a correct solution still scores 1 afterwards."""
import logging
import os
import socket
import tempfile
import time

import pytest

import megarl.rewards.code  # noqa: F401  registers "code" in this process
from megarl import sandbox
from megarl.rewards import RewardPool
from megarl.rewards.code import CodeRewardFailure, code_reward
from megarl.sandbox import SandboxLimits, SandboxUnavailable, run_python

GOOD = "Sure:\n```python\ndef add(a, b):\n    return a + b\n```"
WRONG = "```python\ndef add(a, b):\n    return a - b\n```"
TESTS = "assert add(1, 2) == 3\nassert add(-1, 1) == 0"
SLACK_S = 5  # start-up, kill and clean-up on a loaded 2-core machine


def _solution(code: str) -> str:
    return f"```python\n{code}\n```"


def _foreign_pid_namespace_processes() -> set[int]:
    """Processes in a pid namespace other than ours: where any sandbox leftover would be."""
    ours, found = os.readlink("/proc/self/ns/pid"), set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.readlink(f"/proc/{pid}/ns/pid") != ours:
                found.add(int(pid))
        except OSError:
            continue  # exited, or a zombie without namespaces
    return found


def _sandbox_dirs() -> set[str]:
    return {name for name in os.listdir(tempfile.gettempdir()) if name.startswith("megarl-sandbox-")}


def _assert_fails(code: str, reason: str, bound_s: float, **limits) -> float:
    """The code scores 0 (CodeRewardFailure naming `reason`) within bound_s, and a correct solution still scores 1."""
    start = time.monotonic()
    with pytest.raises(CodeRewardFailure, match=reason):
        code_reward(_solution(code), TESTS, **limits)
    elapsed = time.monotonic() - start
    assert elapsed < bound_s, f"took {elapsed:.1f} s, limit {bound_s} s"
    assert code_reward(GOOD, TESTS) == 1.0
    return elapsed


@pytest.fixture
def listener():
    """A server on the trainer's loopback, which the sandbox must not reach."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    yield server.getsockname()[1]
    server.close()


def test_network_is_unreachable(listener):
    code = ("import socket\n"
            "for address in [('1.1.1.1', 80), ('127.0.0.1', %d)]:\n"
            "    try:\n"
            "        socket.create_connection(address, timeout=2).close()\n"
            "    except OSError as e:\n"
            "        print(address, e.errno, e)\n"
            "    else:\n"
            "        print(address, 'CONNECTED')\n"
            "import sys; sys.exit(0)" % listener)
    result = run_python(code)
    assert result.ok and "CONNECTED" not in result.stdout
    assert result.stdout.count("Network is unreachable") == 2, result.stdout
    _assert_fails(f"import socket\nsocket.create_connection(('127.0.0.1', {listener}), timeout=2)",
                  "Network is unreachable", SLACK_S)


def test_fork_bomb_is_contained_and_killed():
    before = _foreign_pid_namespace_processes()
    _assert_fails("import os\nwhile True:\n    os.fork()", r"process limit \(32\)", 10 + SLACK_S)
    assert _foreign_pid_namespace_processes() - before == set()
    if os.geteuid() == 0:
        assert sandbox._tasks_of(sandbox.SANDBOX_UID) == 0


def test_memory_limit():
    _assert_fails("b = bytearray(10 * 1024**3)", r"memory limit \(1024 MB\)", 10 + SLACK_S)


def test_file_size_limit():
    _assert_fails("with open('big', 'wb') as f:\n    for _ in range(5 * 1024):\n        f.write(b'x' * 2**20)",
                  r"file size limit \(16 MB\)", 10 + SLACK_S)


def test_infinite_loop_hits_cpu_limit():
    # wall well above cpu: with the 2 cores shared, 2 s of CPU can take more than 4 s of wall clock
    elapsed = _assert_fails("while True:\n    pass", r"cpu limit \(2 s\)", 10 + SLACK_S, cpu_s=2, wall_s=10)
    assert elapsed >= 1.5  # it ran until the limit, not into some earlier failure


def test_sleep_hits_wall_limit_and_workdir_is_removed():
    result = run_python("import os, time\nprint(os.getcwd(), flush=True)\ntime.sleep(1000)",
                        limits=SandboxLimits(wall_s=2))
    assert not result.ok and result.exit_code is None and result.reason == "time limit (wall 2 s)"
    assert 2 <= result.wall_s < 2 + SLACK_S
    workdir = result.stdout.strip()
    assert workdir.startswith("/") and not os.path.exists(workdir) and not os.path.exists(os.path.dirname(workdir))
    _assert_fails("import time\ntime.sleep(1000)", r"time limit \(wall 2 s\)", 2 + SLACK_S, wall_s=2)


def test_workdir_is_fresh_and_removed():
    result = run_python("import os\nprint(os.getcwd())\nprint(sorted(os.listdir('.')))",
                        files={"helper.py": "X = 1"})
    assert result.ok, result.reason
    workdir, listing = result.stdout.splitlines()
    assert listing == "['helper.py', 'main.py']"
    assert not os.path.exists(workdir) and not os.path.exists(os.path.dirname(workdir))


def test_trainer_environment_is_invisible(monkeypatch):
    monkeypatch.setenv("MEGARL_TEST_SECRET", "hunter2")
    code = ("import os\nprint(sorted(os.environ))\nprint('hunter2' in str(os.environ))\n"
            f"print(os.path.exists('/proc/{os.getpid()}/environ'))")
    result = run_python(code)
    assert result.ok, result.reason
    names, leaked, trainer_visible = result.stdout.splitlines()
    assert "MEGARL_TEST_SECRET" not in names and leaked == "False" and trainer_visible == "False"
    assert set(eval(names)) <= {"PATH", "LANG", "HOME", "TMPDIR", "LD_LIBRARY_PATH"}


FAKE_EPERM = "#!/bin/sh\necho 'unshare: unshare failed: Operation not permitted' >&2\nexit 1\n"
# a wrapper that drops its options and runs the command in the trainer's namespaces, i.e. no isolation at all
FAKE_NOOP = '#!/bin/sh\nwhile [ "$1" != "--" ]; do shift; done\nshift\nexec "$@"\n'


@pytest.mark.parametrize("fake, message", [(FAKE_EPERM, "Operation not permitted"),
                                           (FAKE_NOOP, "no new network namespace")], ids=["eperm", "no-isolation"])
def test_fails_closed_when_isolation_fails(tmp_path, monkeypatch, fake, message):
    unshare = tmp_path / "unshare"
    unshare.write_text(fake)
    unshare.chmod(0o755)
    target = tmp_path / "out"
    target.mkdir()
    target.chmod(0o777)  # writable by the sandbox uid: only the missing isolation may stop the write
    marker = target / "marker"
    monkeypatch.setattr(sandbox, "UNSHARE", str(unshare))
    before = _sandbox_dirs()
    with pytest.raises(SandboxUnavailable, match=message) as raised:
        run_python(f"open({str(marker)!r}, 'w').write('ran')")
    assert "unprivileged_userns_clone" in str(raised.value)
    assert not marker.exists()
    with pytest.raises(SandboxUnavailable, match=message):
        code_reward(_solution(f"open({str(marker)!r}, 'w').write('ran')"), TESTS)
    with pytest.raises(SandboxUnavailable, match=message):
        sandbox.check_sandbox()
    assert not marker.exists()
    assert _sandbox_dirs() == before


def test_early_exit_does_not_pass():
    _assert_fails("import os\nos._exit(0)", "before the tests finished", SLACK_S)


def test_reward_pool_scores_and_logs_failures(caplog):
    # forkserver workers import megarl.rewards but not megarl.rewards.code, so "code" is unknown there; the dotted
    # path imports (and registers) it inside the worker
    pool = RewardPool("megarl.rewards.code:code_reward", workers=1, timeout_s=30, kwargs={"cpu_s": 2, "wall_s": 10})
    items = [(GOOD, TESTS), (WRONG, TESTS),
             (_solution("import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=2)"), TESTS),
             (_solution("while True:\n    pass"), TESTS)]
    try:
        with caplog.at_level(logging.WARNING, logger="megarl.rewards.pool"):
            assert pool.score(items) == [1.0, 0.0, 0.0, 0.0]
        assert pool.take_errors() == 3
    finally:
        pool.close()
    logged = caplog.text
    for reason in ["CodeRewardFailure: exit code 1: AssertionError", "Network is unreachable", "cpu limit (2 s)"]:
        assert reason in logged, logged
