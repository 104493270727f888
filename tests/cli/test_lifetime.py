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
