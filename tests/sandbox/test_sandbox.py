"""The code sandbox, the "code" reward and the python tool against adversarial programs, through the public entry
points (run_python, code_reward, the python tool, ToolEnv.step): each attack gets the secure outcome, within its
limits, leaves nothing behind, and a correct solution still scores 1 afterwards."""
import ctypes
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import megarl.rewards.code  # noqa: F401  registers "code" in this process
from megarl import sandbox
from megarl.envs import make_env
from megarl.envs.tools import python as python_tool
from megarl.rewards import RewardPool
from megarl.rewards.code import CodeRewardFailure, code_reward
from megarl.sandbox import SandboxLimits, SandboxUnavailable, cgroups, isolation, run_python, seccomp

pytestmark = pytest.mark.unit

GOOD = "Sure:\n```python\ndef add(a, b):\n    return a + b\n```"
WRONG = "```python\ndef add(a, b):\n    return a - b\n```"
TESTS = "assert add(1, 2) == 3\nassert add(-1, 1) == 0"
SLACK_S = 5  # start-up, kill and clean-up on a loaded 2-core machine
ROOT = os.geteuid() == 0


def _solution(code: str) -> str:
    return f"```python\n{code}\n```"


def _good_still_scores() -> None:
    assert code_reward(GOOD, TESTS) == 1.0


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in "ZX"
    except OSError:
        return False


def _sandbox_processes() -> set[int]:
    """Live processes running as a sandbox uid (as root, every execution has one from this range): leftovers. Zombies
    do not count: bwrap's init may be reaped by the host's init a moment after the execution ended."""
    found = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            uid = os.stat(f"/proc/{pid}").st_uid
        except OSError:
            continue
        if isolation.UID_BASE <= uid < isolation.UID_BASE + isolation.UID_SLOTS and _alive(int(pid)):
            found.add(int(pid))
    return found


def _assert_fails(code: str, reason: str, bound_s: float, **limits) -> float:
    """The code scores 0 (CodeRewardFailure naming `reason`) within bound_s, and a correct solution still scores 1."""
    start = time.monotonic()
    with pytest.raises(CodeRewardFailure, match=reason):
        code_reward(_solution(code), TESTS, **limits)
    elapsed = time.monotonic() - start
    assert elapsed < bound_s, f"took {elapsed:.1f} s, limit {bound_s} s"
    _good_still_scores()
    return elapsed


@pytest.fixture
def host_dir():
    """A world-readable, world-writable directory on the host with canary files (0644 and 0600): what a sandbox
    running with the host's filesystem and permissions could read, change or delete."""
    path = tempfile.mkdtemp(prefix="megarl-canary-")
    os.chmod(path, 0o777)
    for name, mode in (("public", 0o644), ("secret", 0o600), ("victim", 0o666)):
        with open(os.path.join(path, name), "w") as f:
            f.write(f"canary-{name}")
        os.chmod(os.path.join(path, name), mode)
    yield path
    subprocess.run(["rm", "-rf", path], check=True)


# ------------------------------------------------------------------------------------------------ filesystem


def test_host_files_are_invisible_read_only_or_absent(host_dir):
    project = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "README.md"))
    code = f"""
import os
for path in [{host_dir + '/public'!r}, {host_dir + '/secret'!r}, {project!r}, '/etc/passwd', '/root/.bashrc']:
    try:
        print('LEAK-READ', path, open(path).read()[:20])
    except OSError as e:
        print('no', path, e.strerror)
for path in [{host_dir + '/new'!r}, '/usr/evil', '/python/evil', '/evil', '/dev/evil']:
    try:
        open(path, 'w').write('x'); print('LEAK-WROTE', path)
    except OSError as e:
        print('no', path, e.strerror)
for path in [{host_dir + '/victim'!r}]:
    try:
        os.remove(path); print('LEAK-DELETED', path)
    except OSError as e:
        print('no', path, e.strerror)
print(sorted(os.listdir('/')))
"""
    for out in (run_python(code).stdout, python_tool(code)):
        assert "LEAK" not in out and out.count("\nno ") == 10, out
        assert set(eval(out.splitlines()[-1])) <= {"bin", "sbin", "lib", "lib32", "lib64", "libx32", "usr", "python",
                                                   "proc", "dev", "tmp", "work"}, out
    assert sorted(os.listdir(host_dir)) == ["public", "secret", "victim"]
    assert open(os.path.join(host_dir, "victim")).read() == "canary-victim"
    _assert_fails(f"def add(a, b):\n    return int(open({host_dir + '/public'!r}).read() and 3)",
                  "FileNotFoundError", SLACK_S)


def test_tmp_shm_and_workdir_are_private_and_do_not_persist():
    # names of this test's own (other processes may create files in the host's /tmp meanwhile)
    left, link = f"left-behind-{os.getpid()}", f"link-{os.getpid()}"
    leave = ("import os\nfor d in ['/tmp', '/dev/shm', '/work']:\n"
             f"    open(d + '/{left}', 'w').write('x')\n"
             f"    os.symlink('/proc/self/environ', d + '/{link}')\n"
             "print(os.getcwd(), sorted(os.listdir('/tmp')))")
    first = run_python(leave)
    assert first.ok and first.stdout.split()[0] == "/work", first
    look = "import os\nprint([sorted(os.listdir(d)) for d in ['/tmp', '/dev/shm', '/work']])"
    second = run_python(look)
    assert second.ok and second.stdout.strip() == "[[], [], ['main.py']]", second
    for host in (tempfile.gettempdir(), "/dev/shm"):
        assert not {left, link} & set(os.listdir(host)), host


def test_deep_directory_tree_and_disk_filling():
    deep = ("import os\nfor d in ['/work', '/tmp']:\n    os.chdir(d)\n    for i in range(3000):\n"
            "        os.mkdir('d')\n        os.chdir('d')\nprint('deep')")
    result = run_python(deep)
    assert result.ok and result.stdout.strip() == "deep", result
    # many small files: RLIMIT_FSIZE (per file) does not stop this, the tmpfs size does
    fill = ("for i in range(1000):\n    open(f'/work/f{i}', 'wb').write(b'x' * 2**20)")
    result = run_python(fill, limits=SandboxLimits(disk_mb=8))
    assert not result.ok and result.reason.startswith("disk limit (8 MB)"), result
    env = make_env("tool", tools=["python"])
    env.reset({})
    step = env.step("<tool_call>\n" + json.dumps({"name": "python", "arguments": {"code": deep}}) + "\n</tool_call>")
    assert step.observation[0]["content"].strip() == "deep"
    _good_still_scores()


# -------------------------------------------------------------------------------------------- IPC and network


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
    # the sandbox's own loopback is up but empty: the trainer's port is not there
    assert result.ok and "CONNECTED" not in result.stdout
    assert "Network is unreachable" in result.stdout and "Connection refused" in result.stdout, result.stdout
    _assert_fails(f"import socket\nsocket.create_connection(('127.0.0.1', {listener}), timeout=2)",
                  "Connection refused", SLACK_S)


def test_host_unix_sockets_are_unreachable(host_dir):
    path, abstract = os.path.join(host_dir, "sock"), f"\0megarl-test-{os.getpid()}"
    servers = []
    for address in (path, abstract):
        server = socket.socket(socket.AF_UNIX)
        server.bind(address)
        server.listen()
        servers.append(server)
    os.chmod(path, 0o777)
    try:
        code = (f"import socket\nfor a in [{path!r}, {abstract!r}]:\n    s = socket.socket(socket.AF_UNIX)\n"
                "    try:\n        s.connect(a); print('CONNECTED')\n    except OSError as e:\n"
                "        print('no', e.strerror)")
        result = run_python(code)
        assert result.ok and "CONNECTED" not in result.stdout and result.stdout.count("no ") == 2, result
    finally:
        for server in servers:
            server.close()


_VSOCK = ("import socket\nfor make in (lambda: socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM),\n"
          "             lambda: socket.socketpair(socket.AF_VSOCK, socket.SOCK_STREAM)):\n"
          "    try:\n        print('OPENED', make())\n    except OSError as e:\n        print('refused', e.errno)\n")
# io_uring_setup(1, params): io_uring can open sockets without the socket system call
_IO_URING = ("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
             "fd = libc.syscall(425, 1, ctypes.create_string_buffer(120))\nprint(fd, ctypes.get_errno())\n")


def test_vsock_and_io_uring_are_refused_by_seccomp():
    """A network namespace does not isolate vsock (on VMs, a way to the host); the seccomp filter refuses the socket
    family, and io_uring, which could open one behind the filter's back. The same programs run unsandboxed here
    show what the filter takes away (skipped where the host kernel itself lacks them)."""
    for out in (run_python(_VSOCK).stdout, python_tool(_VSOCK)):
        assert out.split("\n")[:2] == ["refused 97", "refused 97"], out  # EAFNOSUPPORT
    sandboxed = run_python(_IO_URING)
    assert sandboxed.ok and sandboxed.stdout.split() == ["-1", "1"], sandboxed  # EPERM
    _assert_fails("import socket\nsocket.socket(socket.AF_VSOCK, socket.SOCK_STREAM)", "Address family not supported",
                  SLACK_S)
    host = subprocess.run([sys.executable, "-c", _VSOCK + _IO_URING], capture_output=True, text=True).stdout
    vsock, _, uring = host.split("\n")[:3]
    opened = {"AF_VSOCK": vsock.startswith("OPENED"), "io_uring": int(uring.split()[0]) >= 0}
    lacking = [what for what, ok in opened.items() if not ok]
    if lacking:
        pytest.skip(f"the host kernel refuses {lacking} itself ({host!r}): the sandboxed refusals above still ran")


_IPC_CREAT, _IPC_RMID = 0o1000, 0


def _shm_ids() -> set[str]:
    with open("/proc/sysvipc/shm") as f:
        return {line.split()[1] for line in f.readlines()[1:]}


def test_host_sysv_shared_memory_is_invisible_and_nothing_outlives_the_run():
    libc = ctypes.CDLL(None, use_errno=True)
    key = 0x6D6567 + os.getpid()
    shmid = libc.shmget(key, 4096, _IPC_CREAT | 0o666)
    assert shmid >= 0, os.strerror(ctypes.get_errno())
    try:
        before = _shm_ids()
        code = (f"import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                f"print('host segment', libc.shmget({key}, 0, 0), ctypes.get_errno())\n"
                f"print('own segment', libc.shmget(1234, 4096, {_IPC_CREAT | 0o666}) >= 0)\n"
                "print(open('/proc/sysvipc/shm').read().count(chr(10)))")
        result = run_python(code)
        assert result.ok, result
        host, own, listed = result.stdout.splitlines()
        assert host == "host segment -1 2" and own == "own segment True" and listed == "2"  # ENOENT; header + own
        assert _shm_ids() == before  # the run's own segment died with its IPC namespace
    finally:
        libc.shmctl(shmid, _IPC_RMID, None)


def test_no_new_user_namespaces():
    code = ("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "print(libc.unshare(0x10000000), os.strerror(ctypes.get_errno()))\n"
            "import subprocess\nprint(subprocess.run(['unshare', '--user', '--map-root-user', 'id'], "
            "capture_output=True, text=True).returncode)")
    result = run_python(code)
    assert result.ok, result
    syscall, tool = result.stdout.splitlines()
    assert syscall.startswith("-1 ") and tool != "0", result.stdout


# ------------------------------------------------------------------------------------------------ limits


def test_fork_bomb_next_to_a_concurrent_correct_solution():
    bomb = _solution("import os\nwhile True:\n    os.fork()")
    with ThreadPoolExecutor(2) as pool:
        bombed = pool.submit(code_reward, bomb, TESTS)
        time.sleep(0.2)  # the bomb is running
        goods = [pool.submit(code_reward, GOOD, TESTS) for _ in range(3)]
        assert [g.result() for g in goods] == [1.0, 1.0, 1.0]
        with pytest.raises(CodeRewardFailure, match=r"process limit \(32\)"):
            bombed.result()
    if ROOT:
        assert _sandbox_processes() == set()


def test_memory_limit_single_allocation():
    _assert_fails("b = bytearray(10 * 1024**3)", r"memory limit \(1024 MB\)", 10 + SLACK_S)


def _cgroup_writable() -> bool:
    return (os.path.exists("/sys/fs/cgroup/cgroup.controllers") and os.access("/sys/fs/cgroup", os.W_OK)) or \
        os.access("/sys/fs/cgroup/memory", os.W_OK)


@pytest.mark.skipif(not _cgroup_writable(), reason="no writable cgroup here: memory is bounded per process only "
                                                   "(the documented fallback)")
def test_memory_limit_is_per_execution_across_processes():
    assert sandbox.describe()["cgroup"] in ("v1", "v2")
    # four processes of 150 MB each: each is under the 400 MB budget, together they are not
    code = ("import os, time\nfor i in range(4):\n    if os.fork() == 0:\n        b = bytearray(150 * 2**20)\n"
            "        for j in range(0, len(b), 4096):\n            b[j] = 1\n        time.sleep(1)\n        os._exit(0)\n"
            "for i in range(4):\n    os.wait()\nprint('all done')")
    result = run_python(code, limits=SandboxLimits(memory_mb=400, wall_s=20))
    assert not result.ok and result.reason.startswith("memory limit (400 MB in total)"), result
    # call_wall_s: on a loaded machine the forks may take longer than the default 10 s per call to touch their
    # memory, and memory is what this case is about
    _assert_fails("import os\nfor i in range(4):\n    if os.fork() == 0:\n        b = bytearray(150 * 2**20)\n"
                  "        b[::4096] = b'x' * len(b[::4096])\n        import time; time.sleep(1)\n        os._exit(0)\n"
                  "for i in range(4):\n    os.wait()\ndef add(a, b):\n    return a + b", "memory limit",
                  20 + SLACK_S, memory_mb=400, wall_s=20, call_wall_s=20)


@pytest.mark.skipif(not _cgroup_writable(), reason="no writable cgroup here: CPU time is limited per process only "
                                                   "(the documented fallback)")
def test_cpu_time_is_limited_per_execution_across_processes():
    code = "import os\nos.fork()\nos.fork()\nwhile True:\n    pass"  # four spinning processes
    result = run_python(code, limits=SandboxLimits(cpu_s=1, wall_s=20))
    assert not result.ok and result.reason == "cpu limit (1 s in total)", result
    assert result.wall_s < 1 + SLACK_S


def test_file_size_limit():
    _assert_fails("with open('big', 'wb') as f:\n    for _ in range(5 * 1024):\n        f.write(b'x' * 2**20)",
                  r"file size limit \(16 MB\)", 10 + SLACK_S)


def test_infinite_loop_hits_cpu_limit():
    # wall well above cpu: with the 2 cores shared, 2 s of CPU can take more than 4 s of wall clock
    elapsed = _assert_fails("while True:\n    pass", r"cpu limit \(2 s", 10 + SLACK_S, cpu_s=2, wall_s=10)
    assert elapsed >= 1.5  # it ran until the limit, not into some earlier failure


def test_sleep_hits_wall_limit():
    result = run_python("import time\nprint('sleeping', flush=True)\ntime.sleep(1000)", limits=SandboxLimits(wall_s=2))
    assert not result.ok and result.exit_code is None and result.reason == "time limit (wall 2 s)"
    assert result.stdout == "sleeping\n" and 2 <= result.wall_s < 2 + SLACK_S


def test_signals_to_the_supervisor_are_ignored():
    code = ("import os, signal, time\nfor pid in (1, os.getppid()):\n"
            "    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGKILL):\n"
            "        os.kill(pid, sig)\ntime.sleep(0.3)\nprint('still here', os.getpid(), os.getppid())")
    result = run_python(code)
    assert result.ok and result.stdout.strip() == "still here 2 1", result
    _good_still_scores()


def test_trainer_environment_is_invisible(monkeypatch):
    monkeypatch.setenv("MEGARL_TEST_SECRET", "hunter2")
    code = ("import os\nprint(sorted(os.environ))\nprint('hunter2' in str(os.environ))\n"
            f"print(os.path.exists('/proc/{os.getpid()}/environ'))")
    result = run_python(code)
    assert result.ok, result.reason
    names, leaked, trainer_visible = result.stdout.splitlines()
    assert "MEGARL_TEST_SECRET" not in names and leaked == "False" and trainer_visible == "False"
    assert set(eval(names)) <= {"PATH", "LANG", "HOME", "TMPDIR", "LD_LIBRARY_PATH", "PWD"}


def test_concurrent_executions_do_not_see_each_other():
    code = ("import os, time\nme = open('/work/me.txt').read()\nopen('/tmp/' + me, 'w').write(me)\n"
            "time.sleep(0.3)\nprint(me, os.getuid(), sorted(os.listdir('/tmp')), len(os.listdir('/proc')))")
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda i: run_python(code, files={"me.txt": f"run{i}"}), range(6)))
    uids = set()
    for i, result in enumerate(results):
        assert result.ok, result
        me, uid, tmp, _ = result.stdout.split(" ", 3)
        assert me == f"run{i}" and tmp == f"['run{i}']", result.stdout
        uids.add(uid)
    if ROOT:
        assert len(uids) == 6  # one uid per concurrent execution


# ------------------------------------------------------------------------------------------- forging the reward

# Written by a solution inside the sandbox: replies in the session's own framing (megarl.sandbox.plain, rebuilt by
# hand), on every fd it has (one is the reply pipe), as if each call had returned VALUES, then an exit.
_FORGED_REPLIES = (
    "import json, os\ndef frame(value):\n    data = json.dumps(value).encode()\n"
    "    return len(data).to_bytes(8, 'big') + data\n"
    "forged = frame({'t': ['ready']}) + b''.join(frame({'t': ['value', v]}) for v in VALUES)\n"
    "for fd in map(int, os.listdir('/proc/self/fd')):\n    try:\n        os.write(fd, forged)\n    except OSError:\n"
    "        pass\n"
    "print(VALUES)\nos._exit(0)")
FORGERS = {  # name: (solution, why it scores 0)
    "always-equal object": ("class Any:\n    def __eq__(self, other):\n        return True\n"
                            "    __ne__ = lambda self, other: False\ndef add(a, b):\n    return Any()",
                            r"add\(1, 2\) returned a Any, which is not plain data"),
    "int subclass equal to all": ("class I(int):\n    def __eq__(self, other):\n        return True\n"
                                  "def add(a, b):\n    return I(0)", "returned a I, which is not plain data"),
    "exit 0 early": ("import os\nos._exit(0)", "loading the solution: the solution's process ended: exit code 0"),
    "sys.exit(0) early": ("import sys\nsys.exit(0)", "loading the solution raised SystemExit: 0"),
    "sys.exit(0) in a call": ("import sys\ndef add(a, b):\n    sys.exit(0)", "SolutionError: SystemExit: 0"),
    "exit 0 at exit": ("import atexit, os\natexit.register(lambda: os._exit(0))\ndef add(a, b):\n    return 0",
                       r"add\(1, 2\) returned 0"),
    "patched builtins and math": ("import builtins, math\nbuiltins.abs = lambda x: 0\n"
                                  "math.isclose = lambda *a, **k: True\nbuiltins.all = builtins.any = lambda x: True\n"
                                  "def add(a, b):\n    return 0", r"add\(1, 2\) returned 0"),
    # whatever the judged process can read: its files, every frame's code constants and globals; it returns any
    # big number found there, which would be the expected value had the tests been inside
    "expected value from source and code objects": (
        "import os, sys, re\nfound = set()\nfor root, _, names in os.walk('/work'):\n    for n in names:\n"
        "        found |= set(re.findall(r'\\d{6,}', open(os.path.join(root, n)).read()))\n"
        "f = sys._getframe()\nwhile f:\n    found |= {str(c) for c in f.f_code.co_consts if isinstance(c, int)}\n"
        "    found |= {str(v) for v in f.f_globals.values() if isinstance(v, int)}\n    f = f.f_back\n"
        "big = sorted((int(x) for x in found if len(x) >= 6), reverse=True)\n"
        "def add(a, b):\n    return big[0] if big else 0", r"add\(1, 2\) returned 0"),
    "forged replies and exit": (_FORGED_REPLIES.replace("VALUES", "(True, 3, 0, 10)"), r"add\(1, 2\) returned True"),
}
FORGED_TESTS = {  # the same checks as plain asserts and as HumanEval's check(candidate)
    "asserts": "assert add(1, 2) == 3000000\nassert abs(add(5, 5) - 10) < 1e-9",  # the first expected value is unusual
    "check(candidate)": {"format": "humaneval", "entry_point": "add",
                         "test": "def check(candidate):\n    assert candidate(1, 2) == 3000000\n"
                                 "    assert all([abs(candidate(5, 5) - 10) < 1e-9])\n"},
}


@pytest.mark.parametrize("style", list(FORGED_TESTS))
@pytest.mark.parametrize("name", list(FORGERS))
def test_code_reward_cannot_be_forged(name, style):
    tests, (forger, reason) = FORGED_TESTS[style], FORGERS[name]
    with pytest.raises(CodeRewardFailure, match=reason):
        code_reward(_solution(forger), tests)
    assert code_reward(_solution("def add(a, b):\n    return 3000000 if (a, b) == (1, 2) else a + b"), tests) == 1.0


# Truthiness, isclose and helper-based checks: the verdict (true) is guessable, and it is computed in the trusted
# process from the values the solution returned. Each forger gets is_prime right and another function wrong.
VERDICT_TESTS = ("import math\nassert is_prime(7)\nassert not is_prime(8)\n"
                 "assert math.isclose(circle_area(2), 4 * math.pi, rel_tol=1e-9)\n"
                 "def is_sorted(x):\n    return all(a <= b for a, b in zip(x, x[1:]))\n"
                 "assert is_sorted(sort_list([2, 3, 1])) and isinstance(sort_list([2, 1]), list)\n"
                 "assert all(a == b for a, b in zip(sort_list([3, 1, 2]), [1, 2, 3]))")
HONEST = ("import math\ndef is_prime(n):\n    return n > 1 and not [d for d in range(2, n) if n % d == 0]\n"
          "def circle_area(r):\n    return math.pi * r * r\ndef sort_list(x):\n    return sorted(x)")
VERDICT_FORGERS = {  # name: (solution, why it scores 0)
    "patched math.isclose and all": (
        HONEST.replace("math.pi * r * r", "0") + "\nimport builtins\nmath.isclose = lambda *a, **k: True\n"
        "builtins.all = lambda x: True", r"circle_area\(2\) returned 0"),
    "always-equal elements": (HONEST.replace("math.pi * r * r", "4 * math.pi").replace(
        "return sorted(x)", "class Any:\n        __eq__ = __le__ = lambda s, o: True\n    return [Any() for _ in x]"),
        r"sort_list\(\[2, 3, 1\]\) returned a Any, which is not plain data"),
    "forged verdict replies and exit": (_FORGED_REPLIES.replace("VALUES", "(True, False, True, True, True, True)"),
                                        r"circle_area\(2\) returned True"),
}


@pytest.mark.parametrize("name", list(VERDICT_FORGERS))
def test_truthiness_isclose_and_helper_verdicts_cannot_be_forged(name):
    forger, reason = VERDICT_FORGERS[name]
    with pytest.raises(CodeRewardFailure, match=reason):
        code_reward(_solution(forger), VERDICT_TESTS)
    assert code_reward(_solution(HONEST), VERDICT_TESTS) == 1.0


# ------------------------------------------------------------------------------------------------ fail closed

FAKE_EPERM = "#!/bin/sh\necho 'bwrap: setting up uid map: Operation not permitted' >&2\nexit 1\n"
# a wrapper that drops its options and runs the command in the trainer's namespaces, i.e. no isolation at all
FAKE_NOOP = '#!/bin/sh\nwhile [ "$1" != "--" ]; do shift; done\nshift 2\nexec python3 "$@"\n'


@pytest.mark.parametrize("fake, message", [(FAKE_EPERM, "Operation not permitted"),
                                           (FAKE_NOOP, "no new net namespace"), (None, "bubblewrap .* is not "
                                                                                       "installed")],
                         ids=["eperm", "no-isolation", "missing"])
def test_fails_closed_when_isolation_fails(host_dir, monkeypatch, fake, message):
    bwrap = os.path.join(host_dir, "bwrap")  # reachable by the sandbox uid, as a real bwrap is
    if fake is not None:
        with open(bwrap, "w") as f:
            f.write(fake)
        os.chmod(bwrap, 0o755)
    marker = os.path.join(host_dir, "marker")  # writable by the sandbox uid: only missing isolation may stop it
    monkeypatch.setattr(isolation, "BWRAP", bwrap)
    code = f"open({str(marker)!r}, 'w').write('ran')"
    with pytest.raises(SandboxUnavailable, match=message) as raised:
        run_python(code)
    assert "apt-get install -y bubblewrap" in str(raised.value)
    with pytest.raises(SandboxUnavailable, match=message):
        code_reward(_solution(code), TESTS)
    with pytest.raises(SandboxUnavailable, match=message):
        sandbox.check_sandbox()
    with pytest.raises(SandboxUnavailable, match=message):
        make_env("tool", tools=["python"])
    assert not os.path.exists(marker)


def test_fails_closed_without_the_seccomp_filter(host_dir, monkeypatch):
    """A bwrap that drops --seccomp (all else real): the preamble sees no filter and nothing runs; on a machine the
    filter is not written for, nothing is even started."""
    bwrap = os.path.join(host_dir, "bwrap")
    with open(bwrap, "w") as f:
        f.write('#!/bin/sh\nn=0\nfor a in "$@"; do\n  shift\n  if [ "$n" = 1 ]; then n=0; continue; fi\n'
                '  if [ "$a" = --seccomp ]; then n=1; continue; fi\n  set -- "$@" "$a"\ndone\n'
                f'exec {shutil.which("bwrap")} "$@"\n')
    os.chmod(bwrap, 0o755)
    marker = os.path.join(host_dir, "marker")
    code = f"open({marker!r}, 'w').write('ran')"
    monkeypatch.setattr(isolation, "BWRAP", bwrap)
    with pytest.raises(SandboxUnavailable, match="no seccomp filter is applied"):
        run_python(code)
    with pytest.raises(SandboxUnavailable, match="no seccomp filter is applied"):
        code_reward(_solution(code), TESTS)
    monkeypatch.setattr(isolation, "BWRAP", "bwrap")
    monkeypatch.setattr(seccomp.platform, "machine", lambda: "riscv64")
    with pytest.raises(SandboxUnavailable, match="not 'riscv64'; refusing to run code without it"):
        run_python(code)
    assert not os.path.exists(marker)


def test_tool_env_turns_tool_failures_into_observations(monkeypatch):
    env = make_env("tool", tools=["python"])
    env.reset({})
    call = "<tool_call>\n" + json.dumps({"name": "python", "arguments": {"code": "print(1)"}}) + "\n</tool_call>"

    def broken(**_):
        raise RuntimeError("the tool broke")

    monkeypatch.setattr(env.tools["python"], "fn", broken)
    step = env.step(call)
    assert not step.done and step.info == {"tool_calls": 1, "tool_errors": 1}
    assert step.observation[0]["content"] == "error: RuntimeError: the tool broke"

    def unavailable(**_):
        raise SandboxUnavailable("no isolation here")

    monkeypatch.setattr(env.tools["python"], "fn", unavailable)
    with pytest.raises(SandboxUnavailable):
        env.step(call)


def test_reward_pool_scores_and_logs_failures(caplog):
    # forkserver workers import megarl.rewards but not megarl.rewards.code, so "code" is unknown there; the dotted
    # path imports (and registers) it inside the worker
    # wall clocks far above the CPU limit: on the shared 2-core machine 2 s of CPU can take several seconds
    pool = RewardPool("megarl.rewards.code:code_reward", workers=1, timeout_s=60,
                      kwargs={"cpu_s": 2, "wall_s": 30, "call_wall_s": 30})
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
    for reason in ["CodeRewardFailure: test line 1 `assert add(1, 2) == 3`: assertion failed (last call: add(1, 2) "
                   "returned -1)", "Network is unreachable", "cpu limit (2 s"]:
        assert reason in logged, logged


def _leaves_of(pid: int) -> list[str]:
    """The cgroup leaves process `pid` created that still exist."""
    _, _, parents = cgroups._detect()
    return [os.path.join(p, n) for p in (parents or {}).values() if os.path.isdir(p)
            for n in os.listdir(p) if n.startswith(f"{cgroups._PREFIX}{pid}-")]


def _dead_creators_leaves() -> set[str]:
    """Leaves (in the first hierarchy) whose creating process is gone: nobody will remove them any more."""
    parent = next(iter(cgroups._detect()[2].values()))
    return {n for n in os.listdir(parent) if n.startswith(cgroups._PREFIX)
            and not os.path.exists(f"/proc/{n[len(cgroups._PREFIX):].split('-')[0]}")}


@pytest.mark.skipif(cgroups.available() is None, reason="no writable cgroup hierarchy here")
def test_a_reward_killed_by_its_timeout_leaves_no_cgroup_behind():
    """The pool's timeout SIGKILLs the reward process in the middle of a sandbox run, so the run's own clean-up never
    happens; the pool removes what that process created (else a long run exhausts the host's cgroups)."""
    before = _dead_creators_leaves()
    pool = RewardPool("megarl.rewards.code:code_reward", workers=1, timeout_s=3, kwargs={"wall_s": 120, "cpu_s": 100})
    try:
        slow = _solution("import time\ntime.sleep(60)\ndef add(a, b):\n    return a + b")
        assert pool.score([(slow, TESTS), (GOOD, TESTS)]) == [0.0, 1.0]
    finally:
        pool.close()
    assert _dead_creators_leaves() - before == set()


@pytest.mark.skipif(cgroups.available() is None, reason="no writable cgroup hierarchy here")
def test_remove_left_by_kills_and_removes_a_dead_creators_leaves():
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # create a leaf with a process inside, report, then die without cleaning up
        try:
            group = cgroups.Group.create(64 << 20, 8)
            sleeper = subprocess.Popen(["sleep", "300"])
            for procs in group.procs_files():
                with open(procs, "w") as f:
                    f.write(str(sleeper.pid))
            os.write(write, str(sleeper.pid).encode())
        finally:
            os._exit(0)
    os.close(write)
    sleeper = int(os.read(read, 100) or 0)
    os.close(read)
    os.waitpid(pid, 0)
    assert sleeper and len(_leaves_of(pid)) == len(cgroups._detect()[2])  # one leaf per hierarchy
    assert cgroups.remove_left_by(pid) == 1
    assert _leaves_of(pid) == []
    for _ in range(100):  # SIGKILLed; reaped by init
        if not _alive(sleeper):
            break
        time.sleep(0.05)
    else:
        raise AssertionError("the process inside the leaf was not killed")
