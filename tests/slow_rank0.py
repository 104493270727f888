"""`python -m slow_rank0 ARGS`: megarl's command with rank 0 started late, as on a loaded machine where rank 0 is still
importing when the other ranks have already failed their pre-flight checks (tests/cli/test_errors.py)."""
import os
import sys
import time

if __name__ == "__main__":
    if os.environ.get("RANK") == "0":
        time.sleep(8)
    from megarl import cli

    sys.exit(cli.main())
