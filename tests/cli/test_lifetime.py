"""megarl.lifetime: how megarl's processes end."""
import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

_PROGRAM = """
import atexit, sys, threading, time
from megarl.lifetime import exit_without_teardown

out = sys.argv[1]
atexit.register(lambda: open(out + ".atexit", "w").write("ran"))
def late():
    time.sleep(0.5)
    open(out + ".thread", "w").write("done")
threading.Thread(target=late).start()  # not a daemon: an exit waits for it
sys.stdout.write("buffered, never flushed by the program")
exit_without_teardown(3)
print("not reached")
"""


def test_exit_without_teardown_ends_as_a_normal_exit_does(tmp_path):
    """The exit code, the non-daemon threads' work, the atexit handlers and buffered output all survive; only the
    interpreter's finalization is skipped."""
    out = str(tmp_path / "marker")
    done = subprocess.run([sys.executable, "-c", _PROGRAM, out], capture_output=True, text=True, timeout=300)
    assert done.returncode == 3, done.stderr
    assert done.stdout == "buffered, never flushed by the program", done
    assert open(out + ".atexit").read() == "ran" and open(out + ".thread").read() == "done"


def test_the_command_returns_its_code_when_called_with_arguments(capsys):
    """cli.main(argv) from Python (tests, a user's script) returns; only a program run (argv None) exits itself."""
    from megarl import cli

    assert cli.main(["report", "/nonexistent/run"]) == 2
    assert "megarl: error:" in capsys.readouterr().err


# a server stand-in: a child that ignores its parent's death, then the "server" sleeps (SGLang's children, mid-start-up)
_SERVER = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
           "print('up', flush=True); time.sleep(600)")
_OWNER = """
import subprocess, sys, time
from megarl.lifetime import guarded

guard = subprocess.Popen(guarded([sys.executable, "-c", sys.argv[1]]), start_new_session=True, stdout=sys.stdout)
print(guard.pid, flush=True)
time.sleep(600)
"""


def _alive(group: int) -> dict:
    from megarl.lifetime import group_states

    return {pid: state for pid, state in group_states(group).items() if state != "Z"}


def _wait_gone(group: int) -> dict:
    import time

    deadline = time.monotonic() + 120  # the kernel kills them at once; a loaded machine may take a while to reap
    while _alive(group) and time.monotonic() < deadline:
        time.sleep(0.1)
    return _alive(group)


@pytest.mark.parametrize("stop", ["SIGKILL the owner", "SIGTERM the tree, SIGKILL 5 s later"])
def test_a_guarded_command_and_everything_it_started_end_with_its_owner(stop):
    """megarl.lifetime.guarded (the SGLang servers run under it): whatever stops the owner - SIGKILL, a runner's
    SIGTERM to the tree then SIGKILL - no process of the command's group is left, not even a child that ignores its
    parent's death."""
    import os
    import signal
    import time

    owner = subprocess.Popen([sys.executable, "-c", _OWNER, _SERVER], stdout=subprocess.PIPE, text=True)
    group = int(owner.stdout.readline())
    assert owner.stdout.readline().strip() == "up"
    deadline = time.monotonic() + 60
    while len(_alive(group)) < 3 and time.monotonic() < deadline:  # the guard, the server, its child
        time.sleep(0.05)
    assert len(_alive(group)) == 3, _alive(group)
    if stop == "SIGKILL the owner":
        owner.kill()
    else:
        for pid in (owner.pid, *_alive(group)):
            os.kill(pid, signal.SIGTERM)
        time.sleep(5)
        owner.kill()
    try:
        assert not _wait_gone(group)
    finally:
        owner.kill()
        owner.wait()


def test_a_guarded_command_ends_as_the_command_did():
    """Its exit code, or the signal that killed it, is the guard's: the server's owner sees what the server saw."""
    from megarl.lifetime import guarded

    assert subprocess.run(guarded([sys.executable, "-c", "import sys; sys.exit(3)"]), timeout=120).returncode == 3
    killed = subprocess.run(guarded([sys.executable, "-c", "import os; os.kill(os.getpid(), 9)"]), timeout=120)
    assert killed.returncode == -9
