"""`megarl-torchrun` (or `python -m megarl.launch.torchrun`): torchrun with the same flags, and one difference.

When the workers stop on input the user can fix, megarl's rank 0 has already printed the one line that says what to
fix (megarl.errors) and every worker exits with code 2. Plain torchrun then adds its own report: a traceback of the
launcher itself (torch/distributed/launcher/api.py raises ChildFailedError for any failed worker) and a failure table,
and exits 1, which buries the line and loses the exit code. This launcher runs torchrun's own `run()` and, when the
first worker to fail exited with megarl's code 2, exits 2 quietly. Any other failure is reported as torchrun reports
it (the failure table), without the launcher's own traceback, and exits 1.

    megarl-torchrun --nproc_per_node 2 -m megarl.cli train configs/quickstart.yaml
"""
from __future__ import annotations

import logging
import os
import sys

from ..errors import USER_ERROR_EXIT_CODE


def main(argv=None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(sys.argv[1:] if argv is None else argv)
    if "OMP_NUM_THREADS" not in os.environ and str(args.nproc_per_node) != "1":
        os.environ["OMP_NUM_THREADS"] = "1"  # what torchrun sets for its workers anyway, minus its warning banner
    # torchrun logs every failed worker at ERROR level before raising; the failure table below repeats it.
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    try:
        run(args)
    except ChildFailedError as e:
        _, first = e.get_first_failure()
        if first.exitcode == USER_ERROR_EXIT_CODE:
            return USER_ERROR_EXIT_CODE
        print(e.format_msg(), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
